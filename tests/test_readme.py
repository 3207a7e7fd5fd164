"""The README's synopsis and `--help` agree: every command, every option; its release
ranges are the catalogue's; it stays short and its links resolve.

A new user reads the synopsis first; it lacked --branch and --allow-dirty
once. Each line of the block under "## Commands" must name exactly the
options its command has (-h/--help aside), and every command must have a line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from patchkit.catalogue.load import load_catalogue
from patchkit.cli.commands.catalogue import coverage
from patchkit.cli.main import main
from tests.conftest import ENTRY, REPO, copy_tree, run_cli, slim_tree
from tests.wheelserver_helpers import PIP_ENV, WHEEL, Index, build_wheel, serving

THIS = Path(__file__).resolve()


def synopsis() -> dict[str, set[str]]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Commands", 1)[1].split("```", 2)[1]
    found: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        match = re.match(r"patchkit (\w+)", line)
        if match:
            command = match.group(1)
            found[command] = set()
        if command:
            found[command] |= set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", line))
    return found


def options(command: click.Command) -> set[str]:
    """A command's options; a group's (`probe report`) are its subcommands'."""
    if isinstance(command, click.Group):
        return set().union(*(options(c) for c in command.commands.values()))
    names = {opt for param in command.params for opt in getattr(param, "opts", [])}
    names |= {opt for param in command.params for opt in getattr(param, "secondary_opts", [])}
    return {n for n in names if n.startswith("-")} - {"-h", "--help"}


def test_every_command_is_in_the_synopsis_with_exactly_its_options():
    written = synopsis()
    assert set(written) == set(main.commands), set(written) ^ set(main.commands)
    for name, command in main.commands.items():
        assert written[name] == options(command), (name, written[name] ^ options(command))


def metavars() -> dict[tuple[str, str], str]:
    """(command, option) -> the metavar the synopsis writes after it (`--keep DIR`)."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Commands", 1)[1].split("```", 2)[1]
    found, command = {}, None
    for line in block.splitlines():
        match = re.match(r"patchkit (\w+)", line)
        if match:
            command = match.group(1)
        for option, metavar in re.findall(r"(--[a-z][a-z0-9-]*) ([A-Z][A-Z=]*)\b", line):
            found[(command, option)] = metavar
    return found


def test_help_names_each_options_value_as_the_synopsis_does():
    """`--help` said `--seed INTEGER`, `--keep DIRECTORY`, `--url TEXT`, `--timeout FLOAT
    RANGE` where the synopsis says N, DIR, URL, S."""
    ctx = click.Context(main)
    for (name, option), metavar in metavars().items():
        command = main.commands[name]
        commands = command.commands.values() if isinstance(command, click.Group) else [command]
        for one in commands:
            for param in one.params:
                if option in getattr(param, "opts", []):
                    shown = param.make_metavar(click.Context(one, parent=ctx))
                    assert shown == metavar, (name, option, shown, metavar)


def fixes_table() -> dict[str, str]:
    """{patch id: tested-releases cell} of the table under README's `## What it fixes`."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## What it fixes\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        re.match(r"^\| `([a-z0-9-]+)` \|.*\| ([^|]+) \|$", line) for line in section.splitlines()
    ]
    return {m[1]: m[2].strip() for m in rows if m}


def test_the_readmes_release_ranges_are_the_catalogues():
    """Each patch's releases as `patchkit list` computes them from patches/*.toml, so a
    new release or a changed decision cannot leave the README's ranges stale."""
    catalogue = load_catalogue()
    table = fixes_table()
    assert list(table) == [p.id for p in catalogue.patches]
    for patch in catalogue.patches:
        assert table[patch.id] == coverage(patch, catalogue), patch.id
    releases = catalogue.tested_releases
    line = f"{len(releases)} tested releases, {releases[0]} to {releases[-1]}"
    assert line in (REPO / "README.md").read_text()


def test_the_readme_fits_five_minutes_and_links_each_features_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    linked = set(re.findall(r"\]\(((?:docs/[\w-]+|CONTRIBUTING|scripts/README)\.md)\)", text))
    pages = {"verify", "canary", "nan-probe", "adapter-check", "kernel-scan", "torch-lora-path"}
    pages |= {"docker", "fork-mode", "commands", "patches", "troubleshooting", "evidence"}
    assert {f"docs/{p}.md" for p in pages} | {"CONTRIBUTING.md"} <= linked
    assert [p for p in linked if not (REPO / p).is_file()] == []


def test_every_link_between_the_docs_pages_resolves():
    problems = []
    for page in [REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                problems.append(f"{page.relative_to(REPO)}: {target}")
    assert problems == []


ISSUE_NUMBER = re.compile(r"\bissues?\s+\d|\(items?\s+\d", re.IGNORECASE)
OWN_TEXTS = ("README.md", "CONTRIBUTING.md", "docs", "scripts", "tests", "patches", "patchkit")


def test_no_page_script_or_test_names_the_trackers_issue_numbers():
    """`issue 20, item 5` means nothing to a reader of the repository; upstream references
    (vLLM #48590, vllm#49063, triton#9433) are written with their project and `#`."""
    hits = []
    for name in OWN_TEXTS:
        root = REPO / name
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            if path.suffix not in {".md", ".py", ".sh", ".toml", ".diff"} or path == THIS:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if ISSUE_NUMBER.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert hits == [], "\n".join(hits)


@pytest.mark.slow
def test_the_try_it_output_is_what_apply_prints_on_the_real_release(tmp_path):
    """The sample under "Try it" is what `apply` prints on the real 0.26.0 tree today
    (it went stale once when a patch gained a file)."""
    text = (REPO / "README.md").read_text()
    start = text.index("```text\nvLLM 0.26.0 at ") + len("```text\n")
    sample = text[start : text.index("```", start)]
    tree = copy_tree("0.26.0", tmp_path / "vllm-0.26.0")
    result = run_cli("apply", "--target", str(tree))
    assert result.exit_code == 0, result.output
    first, _, rows = sample.partition("\n")  # the tree's line wraps with a long tmp path
    assert result.stdout.endswith(rows) and rows.count("\n") > 10
    header = " ".join(result.stdout[: -len(rows)].split())  # its own path, wrapped or not
    assert header == re.sub(r"/tmp/tmp\.\w+", str(tree), first)


def try_it_command() -> str:
    """The command under "Try it" after its install: the fetch and the apply."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Try it", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    install = ".venv/bin/pip install -q . && "
    assert block.startswith("python3 -m venv .venv && " + install), block
    return block.split(install, 1)[1]


def test_the_try_it_command_patches_a_copy_not_fetchs_cache(tmp_path):
    """The first command patched the tree `fetch` caches (~/.cache/patchkit/trees), which
    the next fetch hands out as the pristine original. Run as written (its patchkit this
    checkout's, the index a local one serving the real 0.26.0 files as a wheel), it
    patches a directory of its own and leaves the cache without a tree."""
    command = try_it_command()
    bin_dir = tmp_path / "work" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    patchkit = bin_dir / "patchkit"
    patchkit.write_text(f'#!/bin/sh\nexec {sys.executable} -c "$PATCHKIT_ENTRY" "$@"\n')
    patchkit.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    wheel = build_wheel(slim_tree(tmp_path / "slim"), tmp_path / WHEEL).read_bytes()
    index = Index(wheel=wheel)
    env = {name: value for name, value in os.environ.items() if name not in PIP_ENV}
    env.update(
        PIP_CONFIG_FILE=os.devnull, HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp")
    )
    env.update(PYTHONPATH=str(REPO), PATCHKIT_ENTRY=ENTRY)
    env.pop("PATCHKIT_CACHE_DIR", None)  # the default cache: under this HOME
    with serving(index):
        env["PIP_INDEX_URL"] = f"{index.url}/simple"
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path / "work", env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "apply: 4 applied now" in done.stdout
    trees = tmp_path / "home" / ".cache" / "patchkit" / "trees"
    assert not trees.exists() or list(trees.iterdir()) == []  # fetch's cache: no tree
    [patched] = (tmp_path / "tmp").iterdir()
    assert f"vLLM 0.26.0 at {patched} (version" in " ".join(done.stdout.split())
    assert (patched / ".patchkit" / "state.json").is_file()


# ----- docs/: the release ranges written in the pages are the catalogue's -----

DOC_PAGES = sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "evidence.md")
SPAN = r"(\d+\.\d+\.\d+)\s*(?:–|-|to)\s*(\d+\.\d+\.\d+)"


def runs_in_docs_notation(patch) -> list[str]:
    """A patch's runs of tested releases as the pages write them: "0.17.0–0.32.0" where it
    applies, "`upstream` 0.33.0–0.34.0" (one release alone: "`upstream` 0.34.0")."""
    from patchkit.cli.commands.catalogue import coverage_runs

    written = []
    for run in coverage_runs(patch, load_catalogue()):
        if run == "opt-in":
            continue
        word, span = run.rsplit(" ", 1) if "(" not in run else run.split(" (")[0].rsplit(" ", 1)
        span = span.replace("-", "–")
        written.append(span if word == "applies to" else f"`{word}` {span}")
    return written


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_every_tested_range_a_page_names_is_the_catalogues(page: Path):
    """A page that names the tested range names the catalogue's (docs/evidence.md's dated
    entries say what was true on their day, and are left as they are)."""
    releases = load_catalogue().tested_releases
    text = " ".join(page.read_text().split())
    for match in re.finditer(r"tested (?:range|releases)[^.\d]{0,20}" + SPAN, text):
        assert match.groups() == (releases[0], releases[-1]), (page.name, match[0])


def test_docs_patches_table_gives_each_patch_the_catalogues_releases():
    """docs/patches.md's releases column (and the opt-in probe's sentence) holds each of a
    patch's runs of tested releases, in the states' words, as `patchkit list` computes them."""
    text = (REPO / "docs" / "patches.md").read_text()
    cells = {m[1]: m[2] for m in re.finditer(r"^\| `([a-z0-9-]+)` \|.*\| ([^|]+) \|$", text, re.M)}
    probe = re.search(r"opt-in: `nan-probe` \(([^)]*)\)", " ".join(text.split()))
    cells["nan-probe"] = probe[1] if probe else ""
    for patch in load_catalogue().patches:
        for run in runs_in_docs_notation(patch):
            assert run in cells[patch.id], (patch.id, run, cells[patch.id])


def proof_rows() -> list[tuple[list[str], str, str]]:
    """(releases, torch pin, GPU column) per row of the README's "proven where" table."""
    text = (REPO / "README.md").read_text()
    table = text.split("| releases | torch they pin |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((spans(cells[0]), cells[1], cells[2]))
    return rows


def spans(cell: str) -> list[str]:
    """The tested releases a cell like "0.20.0-0.21.0, 0.22.1-0.25.1" names."""
    from packaging.version import Version

    from tests.conftest import RELEASES

    found = []
    for part in cell.split(","):
        low, _, high = part.strip().partition("-")
        found += [r for r in RELEASES if Version(low) <= Version(r) <= Version(high or low)]
    return found


def test_the_proof_table_names_each_release_once_with_the_torch_it_pins():
    """Every tested release in one row; its torch is its wheel's own pin (METADATA)."""
    from tests.conftest import RELEASES, release_tree

    named = [r for releases, _, _ in proof_rows() for r in releases]
    assert sorted(named) == sorted(RELEASES) and len(named) == len(set(named))
    for releases, torch, _ in proof_rows():
        for release in releases:
            metadata = (
                release_tree(release) / f"vllm-{release}.dist-info" / "METADATA"
            ).read_text()
            assert f"Requires-Dist: torch=={torch}\n" in metadata, (release, torch)


def test_a_release_proven_on_the_gpu_runs_there_and_has_a_ledger_entry():
    """A row that claims a GPU run pins the GPU host's torch (2.11.0) and the ledger has
    a run of that release on an H200 or H100; the others say they were not run."""
    ledger = (REPO / "docs" / "evidence.md").read_text()
    for releases, torch, gpu in proof_rows():
        if gpu.startswith("cannot run"):
            assert torch != "2.11.0", releases
        elif "not run" in gpu:
            assert torch == "2.11.0", releases
        else:
            assert torch == "2.11.0" and len(releases) == 1, releases
            runs = [
                line
                for line in ledger.splitlines()
                if f"({releases[0]})" in line or f"vLLM {releases[0]}" in line
            ]
            assert any(("H200" in line or "H100" in line) for line in runs), releases
