"""The advice patchkit prints is right: every command it suggests does what it says.

Tried as a new user and as a maintainer would, on real release trees: install
lines that name real packages, a conflict that points at the real site, a
stale-cache verdict that is not about doctor's own scan and keeps `--target`,
known issues that follow the patch's state, a release newer than the
catalogue, and a file edited after apply.
"""

from __future__ import annotations

import ast
import json
import os
import py_compile
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.version import Version

from tests.conftest import CATALOGUE, RELEASES, REPO, release_tree, run_cli, snapshot
from tests.helpers import report_row

# ----- install lines name the packages or the distribution (the index's `patchkit` is
# another project) -----

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DISTRIBUTION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
PIP = re.compile(r"\bpip3?\s+(?:install|uninstall|show|download)\b([^\n`\"]*)")
PATCHKIT_NAME = re.compile(r"(patchkit[\w.-]*)(\[[^\]]*\])?([<>=!~].*)?")
EXTRA = re.compile(r"(?<![\w/.-])patchkit\[")  # "install patchkit[gpu]", pip or not


def user_texts() -> dict[str, str]:
    """Every string constant of the package, and the pages and scripts a user reads."""
    texts = {}
    for path in sorted((REPO / "patchkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)]  # fmt: skip
        texts[str(path.relative_to(REPO))] = "\n".join(strings)
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *REPO.glob("docker/*")]
    pages += [p for p in REPO.glob("docs/**/*.md")]
    pages += [p for p in REPO.glob("scripts/**/*") if p.is_file() and p.suffix != ".pyc"]
    pages += [p for p in REPO.glob("patches/**/*.toml")]
    pages += [p for p in REPO.glob(".ci/*") if p.is_file()]
    for path in pages:
        texts[str(path.relative_to(REPO))] = path.read_text(errors="replace")
    return texts


def wrong_installs(text: str) -> list[str]:
    """The pip lines of ``text`` that name a patchkit distribution other than this one's
    (`pip install patchkit` fetches the index's unrelated project), and `patchkit[extra]`."""
    found = [m.group(0) for m in EXTRA.finditer(text)]
    for match in PIP.finditer(text):
        words = [w.strip("'\"") for w in match.group(1).split()]
        names = [m.group(1) for w in words if (m := PATCHKIT_NAME.fullmatch(w))]
        found += [match.group(0) for name in names if name != DISTRIBUTION]
    return found


def test_the_detector_finds_what_the_old_lines_said():
    """The scan below would have caught each line these commands printed before."""
    old = [
        "patchkit canary needs httpx and prometheus-client: pip install 'patchkit[canary]'",
        "verify needs torch with CUDA (install patchkit[gpu] next to vLLM)",
        "`--e2e` transformers >= 5.17 and peft: `pip install 'patchkit[gpu]'`",
        "pip install patchkit",
        "python3 -m pip install -U patchkit==0.1.0",
        "pip uninstall patchkit",
        "pip show patchkit",
        "pip install patchkit-cli",  # another name that is not this distribution's
    ]
    assert [line for line in old if not wrong_installs(line)] == []
    fine = [
        "pip install -e '/path/to/checkout[gpu]'",
        "python3 -m pip install --quiet /opt/patchkit",
        ".venv/bin/pip install -q -e '.[test]'",
        "pip install 'httpx>=0.27' 'prometheus-client>=0.20'",
        f"pip install '{DISTRIBUTION}[gpu]'",
        f"pip uninstall {DISTRIBUTION}",
    ]
    assert [line for line in fine if wrong_installs(line)] == []


def test_no_install_line_names_patchkit_from_the_index():
    found = {name: hits for name, text in user_texts().items() if (hits := wrong_installs(text))}
    assert found == {}


def test_the_distribution_has_a_name_of_its_own_and_version_reads_it(monkeypatch):
    """`patchkit` on the index is an unrelated project ("A toolkit to apply and revert
    patches on models"); the command and the import package keep the name, the
    distribution does not, and `patchkit --version` asks for the distribution's metadata
    (asking for `patchkit` would report the other project's version where it is installed)."""
    import importlib.metadata

    assert DISTRIBUTION == "patchkit-vllm"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"patchkit": "patchkit.cli.entry:main"}
    asked = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: asked.append(name) or "9.9")
    result = run_cli("--version")
    assert result.exit_code == 0, result.output
    assert asked == [DISTRIBUTION] and "9.9" in result.stdout


def test_canary_names_its_packages():
    from patchkit.canary.check import MISSING_DEPS

    assert "pip install 'httpx>=0.27' 'prometheus-client>=0.20'" in MISSING_DEPS


# ----- a conflict points at the real site -----

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
COLUMN = "vllm/lora/layers/column_parallel_linear.py"


def line_of(path: Path, text: str, after: str = "") -> int:
    """The 1-based number of the first line that is ``text`` (stripped), after the first
    line that starts with ``after``."""
    lines = path.read_text().split("\n")
    first = next(i for i, line in enumerate(lines) if line.strip().startswith(after))
    return next(i for i in range(first, len(lines)) if lines[i].strip() == text) + 1


def insert_after(path: Path, number: int, line: str) -> None:
    lines = path.read_text().split("\n")
    lines.insert(number, line)
    path.write_text("\n".join(lines))


def patch_line(root: Path, patch_id: str) -> str:
    return report_row(run_cli("status", "--target", str(root)).stdout, patch_id)


def test_a_line_inserted_in_load_model_is_named_where_it_is(tree_0260: Path):
    """nan-probe's third hunk sits ~1000 lines below its 0.17.0 header on 0.26.0; one line
    added between its two context lines (a `)` and the drafter check in load_model) is
    named there, not at the first `)` 800 lines away."""
    runner = tree_0260 / RUNNER
    drafter = line_of(runner, 'if hasattr(self, "drafter"):', after="def load_model(")
    insert_after(runner, drafter - 1, "                pass")
    line = patch_line(tree_0260, "nan-probe")
    assert (
        f"closest at line {drafter - 1}, where line {drafter} should be "
        "'if hasattr(self, \"drafter\"):' but is 'pass'"
    ) in line, line
    applied = run_cli("apply", "--only", "nan-probe", "--target", str(tree_0260))
    assert applied.exit_code == 1 and f"closest at line {drafter - 1}," in applied.stderr


def test_partial_gdn_adapter_conflicts_are_named_exactly(slim_tree_0260: Path):
    """The hunk at expand_packed_lora's loop: a line inserted, then a line changed."""
    column = slim_tree_0260 / COLUMN
    pristine = column.read_text()
    loop = line_of(column, "for a_i, b_i in zip(lora_a, lora_b):")
    insert_after(column, loop - 1, "        # a local note")
    assert (
        f"closest at line {loop - 3}, where line {loop} should be "
        "'for a_i, b_i in zip(lora_a, lora_b):' but is '# a local note'"
    ) in patch_line(slim_tree_0260, "partial-gdn-adapter")
    column.write_text(pristine.replace("        start_idx = 0\n", "        start_idx = 1\n", 1))
    assert (
        f"closest at line {loop - 3}, where line {loop - 1} should be 'start_idx = 0' "
        "but is 'start_idx = 1'"
    ) in patch_line(slim_tree_0260, "partial-gdn-adapter")


# ----- doctor's stale-cache verdict -----

STALE = "stale bytecode"
TRITON_KEY = "A" * 52  # a Triton cache entry's name: base32 of a sha256


def doctor_json(root: Path, env: dict) -> dict:
    result = run_cli("doctor", "--target", str(root), "--json", env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def stale_verdict(report: dict) -> dict:
    return next(v for v in report["verdicts"] if v["bug"].startswith(STALE))


def caches_env(tmp_path: Path) -> dict:
    return {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "VLLM_CACHE_ROOT": str(tmp_path / "v"),
            "PATCHKIT_CACHE_DIR": str(tmp_path / "patchkit-cache")}  # fmt: skip


def old_triton_entry(cache: Path, name: str = TRITON_KEY) -> Path:
    """A Triton cache entry (a directory of files) written an hour ago."""
    entry = cache / name
    entry.mkdir(parents=True)
    (entry / "kernel.cubin").write_bytes(b"\0" * 16)
    hour_ago = time.time() - 3600
    os.utime(entry, (hour_ago, hour_ago))
    return entry


@pytest.mark.slow
def test_the_stale_cache_fix_keeps_target_and_needs_no_revert(tree_0260: Path, tmp_path: Path):
    """The command doctor gives is the least that works, run as given: the caches go, the
    tree stays as it is."""
    env = caches_env(tmp_path)
    assert run_cli("apply", "--target", str(tree_0260)).exit_code == 0
    old_triton_entry(tmp_path / "triton")
    verdict = stale_verdict(doctor_json(tree_0260, env))
    assert verdict["status"] == "exposed"
    assert verdict["fix"]["message"] == f"patchkit apply --clear-caches --target {tree_0260}"
    before = snapshot(tree_0260)
    command = shlex.split(verdict["fix"]["message"])
    assert command[0] == "patchkit"
    assert run_cli(*command[1:], env=env).exit_code == 0
    assert snapshot(tree_0260) == before  # nothing reverted, nothing re-applied
    assert list((tmp_path / "triton").iterdir()) == []
    assert stale_verdict(doctor_json(tree_0260, env))["status"] == "not-affected"


@pytest.mark.slow
def test_stale_bytecode_is_deleted_not_reverted(tree_0260: Path, tmp_path: Path):
    """apply rewrites nothing on a patched tree, so it removes no .pyc: the fix says to
    delete them, and for old caches as well, the apply that clears them."""
    env = caches_env(tmp_path)
    assert run_cli("apply", "--target", str(tree_0260)).exit_code == 0
    module = tree_0260 / "vllm/lora/punica_wrapper/punica_gpu.py"
    pyc = module.parent / "__pycache__" / "punica_gpu.cpython-311.pyc"
    py_compile.compile(
        str(module), cfile=str(pyc), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
    )
    old_triton_entry(tmp_path / "triton")
    verdict = stale_verdict(doctor_json(tree_0260, env))
    assert "revert" not in verdict["fix"]["message"]
    assert verdict["fix"]["message"] == (
        "delete the stale .pyc files listed (Python rebuilds them from the source), then "
        f"patchkit apply --clear-caches --target {tree_0260}"
    )


# ----- a known issue follows the state of the patch that fixes it -----

PARTIAL = "partial-gdn-adapter"


def notices(root: Path) -> list[str]:
    result = run_cli("status", "--target", str(root), "--json")
    patches = json.loads(result.stdout)["patches"]
    return [n["message"] for n in next(p for p in patches if p["id"] == PARTIAL)["notices"]]


def test_a_reinstall_named_for_a_version_with_an_epoch_is_quoted(slim_tree_0260: Path):
    """The real 0.26.0 tree relabelled 1!0.26.0 (PEP 440's epoch), a line added at the end
    of a file a patch changes (it differs from RECORD): the reinstall apply names quotes the
    requirement, as bash expands a pasted '!' (!5: its history's fifth command) first."""
    relabel(slim_tree_0260, "1!0.26.0")
    with (slim_tree_0260 / UTILS).open("a") as handle:
        handle.write("# a local note\n")
    before = snapshot(slim_tree_0260)
    refused = run_cli("apply", "--target", str(slim_tree_0260))
    assert refused.exit_code == 1 and snapshot(slim_tree_0260) == before
    assert "(`pip install --force-reinstall --no-deps 'vllm==1!0.26.0'`) to patch" in refused.stderr


def test_a_needed_fix_is_offered_and_0_29_is_not_said_to_fix_it(slim_tree_0260: Path):
    """0.29.0 (#47640) loads an in_proj_qkv-only adapter; an in_proj_z-only one still
    raises there (tests/test_partial_adapter.py runs both on 0.29.0's real code)."""
    (notice,) = notices(slim_tree_0260)
    assert "fixed in 0.29.0" not in notice
    assert "0.29.0 (PR #47640) loads an in_proj_qkv-only adapter" in notice
    assert "in_proj_z-only one still raises there (PR #57851, open)" in notice
    assert notice.endswith("; `patchkit apply` fixes it")


def test_a_fix_in_conflict_is_not_offered(slim_tree_0260: Path):
    column = slim_tree_0260 / COLUMN
    loop = line_of(column, "for a_i, b_i in zip(lora_a, lora_b):")
    insert_after(column, loop - 1, "        # a local note")
    (notice,) = notices(slim_tree_0260)
    assert "patchkit apply` fixes it" not in notice
    assert (
        "partial-gdn-adapter is in conflict here, so patchkit cannot apply it (its line says "
        "what differs): until its files are vLLM 0.26.0's own again (`pip install "
        "--force-reinstall --no-deps vllm==0.26.0`, then `patchkit apply`), the issue stays"
    ) in notice
    report = json.loads(run_cli("doctor", "--target", str(slim_tree_0260), "--json").stdout)
    verdict = next(v for v in report["verdicts"] if v["bug"].startswith("vLLM #47639"))
    assert verdict["status"] == "exposed"
    assert verdict["fix"]["message"].startswith(
        "apply refuses partial-gdn-adapter while it is in conflict"
    )


@pytest.mark.slow
def test_0_29_names_what_it_still_gets_wrong(tmp_path: Path):
    from tests.conftest import copy_tree

    tree = copy_tree("0.29.0", tmp_path / "v29")
    (notice,) = notices(tree)
    assert notice == (
        "an adapter with in_proj_z but not in_proj_qkv still raises 'Cannot determine how to "
        "split lora_b' in expand_packed_lora (vLLM PR #57851, open); adapters with both, or "
        "with in_proj_qkv only, load; `patchkit apply` fixes it"
    )


READING = re.compile(r"[0-9a-f]{64}\.json")  # a launch's or a cubin's SASS reading


def share_readings(cache: Path) -> None:
    """Hand the SASS readings this scan made to the kernel-scan tests' shared cache.

    A reading is keyed by its launch (or cubin), Triton and ptxas, so it holds in any
    patchkit cache, and the suite's 0.26.0 scans make most of these launches again: on
    a fresh machine they would compile them a second time. Triton's own entries stay
    here (their group files name this directory); a reading already there is kept.
    """
    from tests.kernelscan_helpers import scan_env

    shared = Path(scan_env()["PATCHKIT_CACHE_DIR"]) / "kernel-scan"
    shared.mkdir(parents=True, exist_ok=True)
    for reading in (cache / "kernel-scan").iterdir():
        target = shared / reading.name
        if READING.fullmatch(reading.name) and not target.exists():
            partial = shared / f".{reading.name}.{os.getpid()}"
            shutil.copyfile(reading, partial)
            os.replace(partial, target)  # another process reads it whole or not at all


@pytest.mark.network
def test_the_kernel_scans_own_triton_entries_are_not_stale(tmp_path: Path):
    """`doctor --kernels`, `apply`, `doctor`: the Triton entries the scan compiled are not
    "older than the patch"; an entry someone else wrote before the patch is, and so is
    one of the scan's rewritten since. The scan is of one small MoE model and one rank:
    every kind of LoRA kernel (shrink, expand, the fused MoE ones) in about 95 cache
    entries, where the default scan (two models, two ranks) compiles about 150."""
    from tests.conftest import copy_tree
    from tests.kernelscan_helpers import scan_env, small_moe_model

    tree = copy_tree("0.26.0", tmp_path / "site-packages")
    model, adapter = small_moe_model(tmp_path, "bfloat16", {"r": 16})
    env = {**scan_env(), **caches_env(tmp_path)}  # a cold scan: it compiles into an empty cache
    command = [sys.executable, "-m", "patchkit", "doctor", "--kernels", "--target", str(tree),
               "--model", str(model), "--adapter", str(adapter)]  # fmt: skip
    scan = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert scan.returncode == 0, scan.stderr
    written = sorted((tmp_path / "triton").iterdir())
    assert len(written) > 10
    share_readings(tmp_path / "patchkit-cache")
    assert run_cli("apply", "--target", str(tree)).exit_code == 0
    plain = {k: env[k] for k in caches_env(tmp_path)}
    report = doctor_json(tree, plain)
    assert report["old_caches"] == []
    assert stale_verdict(report)["status"] == "not-affected"

    old_triton_entry(tmp_path / "triton")  # not the scan's
    hour_ago = time.time() - 3600
    os.utime(written[0], (hour_ago, hour_ago))  # the scan's, changed since
    report = doctor_json(tree, plain)
    assert [c["entries"] for c in report["old_caches"]] == [2]
    assert (
        stale_verdict(report)["fix"]["message"] == f"patchkit apply --clear-caches --target {tree}"
    )


# ----- a release newer than the catalogue -----


def relabel(root: Path, version: str) -> None:
    """Change only the version in the tree's dist-info METADATA (how patchkit reads it)."""
    (metadata,) = root.glob("vllm-*.dist-info/METADATA")
    text = metadata.read_text()
    metadata.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", text, count=1))


NEWER = "newer than every release this catalogue was tested on"
# The newest tested release, and the next minor one: untested until a maintainer adds it.
NEWEST = max(RELEASES, key=Version)
UNTESTED = f"{Version(NEWEST).major}.{Version(NEWEST).minor + 1}.0"


def test_apply_on_a_newer_release_says_so_and_what_to_do(slim_tree_0260: Path):
    relabel(slim_tree_0260, UNTESTED)
    status = run_cli("status", "--target", str(slim_tree_0260), "--json")
    assert json.loads(status.stdout)["vllm"]["version"] == UNTESTED
    # its code still fits every patch: applied, with the warning that says why to look
    applied = run_cli("apply", "--target", str(slim_tree_0260))
    assert applied.exit_code == 0
    assert (
        f"vLLM {UNTESTED} is not a tested release: it is {NEWER} (newest {NEWEST}); decided by "
        "content; a newer patchkit may cover it, or add the release (CONTRIBUTING.md, "
        "'A new vLLM release')"
    ) in applied.stderr


def test_a_conflict_on_a_newer_release_says_so_and_what_to_do(slim_tree_0260: Path):
    """As a release whose code moved: one line added in expand_packed_lora."""
    relabel(slim_tree_0260, UNTESTED)
    column = slim_tree_0260 / COLUMN
    loop = line_of(column, "for a_i, b_i in zip(lora_a, lora_b):")
    insert_after(column, loop - 1, "        # a local note")
    before = snapshot(slim_tree_0260)
    applied = run_cli("apply", "--target", str(slim_tree_0260))
    assert applied.exit_code == 1 and snapshot(slim_tree_0260) == before
    (line,) = applied.stderr.strip().splitlines()
    assert line.startswith("patchkit: error: partial-gdn-adapter: conflict: ")
    target = f"--target {slim_tree_0260}"
    assert line.endswith(
        f"nothing was changed (vLLM {UNTESTED} is {NEWER}, the newest {NEWEST}: a newer patchkit "
        f"may cover it; `patchkit status {target}` shows which patches fit, `patchkit apply "
        f"--only ID {target}` applies one at your own risk; CONTRIBUTING.md, 'A new vLLM "
        "release', says how to add the release)"
    )
    # the same conflict on a tested release names the commands that go on
    relabel(slim_tree_0260, "0.26.0")
    line = run_cli("apply", "--target", str(slim_tree_0260)).stderr.strip()
    assert line.endswith(
        "nothing was changed; `patchkit apply --only expand-block-n --only "
        f"matmul-add-lora-linear --only partial-moe-adapter {target}` applies the others; or "
        "`pip install --force-reinstall --no-deps vllm==0.26.0` makes vLLM's files its own "
        f"again, then `patchkit apply {target}`"
    )


def test_a_conflict_refusal_names_the_commands_that_go_on(slim_tree_0260: Path, tmp_path: Path):
    """A conflict on a tested release ended "(apply the others with --only)": it names the
    apply --only of the patches that still fit, and the reinstall that gives the files
    back; each command, run as it is written, goes on (a reinstall: vLLM's file copied back)."""
    utils = "vllm/lora/ops/triton_ops/utils.py"  # expand-block-n's, the series' first
    edited = slim_tree_0260 / utils
    edited.write_text(edited.read_text().replace("block_n", "block_m"))  # an edit
    before = snapshot(slim_tree_0260)
    refused = run_cli("apply", "--target", str(slim_tree_0260))
    assert refused.exit_code == 1 and snapshot(slim_tree_0260) == before
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("patchkit: error: expand-block-n: conflict: ")
    others, repair, then = re.findall(r"`([^`]+)`", line.split("nothing was changed; ")[1])
    target = f"--target {slim_tree_0260}"
    assert others == (
        "patchkit apply --only matmul-add-lora-linear --only partial-gdn-adapter "
        f"--only partial-moe-adapter {target}"
    )
    assert (repair, then) == (
        "pip install --force-reinstall --no-deps vllm==0.26.0",
        f"patchkit apply {target}",
    )
    second = tmp_path / "second"  # the tree as it was refused, for the other way
    shutil.copytree(slim_tree_0260, second)
    done = run_cli(*shlex.split(others)[1:])
    assert done.exit_code == 0, done.output
    assert "apply: 3 applied now" in done.stdout
    shutil.copy2(release_tree("0.26.0") / utils, second / utils)  # what the reinstall does
    done = run_cli(*shlex.split(then.replace(str(slim_tree_0260), str(second)))[1:])
    assert done.exit_code == 0, done.output
    assert "apply: 4 applied now" in done.stdout


# ----- a file edited after apply -----

UTILS = "vllm/lora/ops/triton_ops/utils.py"
EDIT = "# a maintainer's edit"


def catalogue_at(directory: Path) -> dict:
    """A copy of the catalogue at ``directory``, as the env that makes patchkit use it."""
    shutil.copytree(REPO / "patches", directory)
    return {"PATCHKIT_PATCHES_DIR": str(directory)}


def edited_after_apply(root: Path, env: dict) -> str:
    assert run_cli("apply", "--target", str(root), env=env).exit_code == 0
    with (root / UTILS).open("a") as handle:
        handle.write(f"{EDIT}\n")
    result = run_cli("status", "--target", str(root), "--json", env=env)
    patches = json.loads(result.stdout)["patches"]
    return next(p for p in patches if p["id"] == "expand-block-n")["reason"]["message"]


def run_suggested(reason: str, name: str, env: dict):
    """Run the `patchkit NAME ...` command quoted in ``reason``, as a user would paste it."""
    quoted = re.search(rf"`(patchkit {name} [^`]*)`", reason).group(1)
    return run_cli(*shlex.split(quoted)[1:], env=env)


def test_in_a_source_checkout_refresh_keeps_the_edit(slim_tree_0260: Path, tmp_path: Path):
    env = catalogue_at(tmp_path / "checkout" / "patches")
    reason = edited_after_apply(slim_tree_0260, env)
    target = f"--target {slim_tree_0260}"
    assert (
        f"`patchkit revert --only expand-block-n --force {target}` restores the original and "
        "discards the edit; to keep the edit in the patch, `patchkit refresh expand-block-n "
        f"{target}` rewrites its diff from the tree"
    ) in reason
    assert run_suggested(reason, "refresh", env).exit_code == 0
    diff = (tmp_path / "checkout/patches/expand-block-n/block-k-32.diff").read_text()
    assert f"+{EDIT}\n" in diff
    assert EDIT in (slim_tree_0260 / UTILS).read_text()
    status = run_cli("status", "--target", str(slim_tree_0260), "--json", env=env)
    states = {p["id"]: p["state"] for p in json.loads(status.stdout)["patches"]}
    assert states["expand-block-n"] == "applied"


def test_an_installed_catalogue_offers_revert_and_says_the_edit_goes(slim_tree_0260, tmp_path):
    installed = tmp_path / "lib/python3.12/site-packages/patchkit/patches"
    env = catalogue_at(installed)
    reason = edited_after_apply(slim_tree_0260, env)
    assert "refresh" not in reason
    assert reason.endswith(
        f"`patchkit revert --only expand-block-n --force --target {slim_tree_0260}` restores the "
        "original and discards the edit"
    )
    assert run_suggested(reason, "revert", env).exit_code == 0
    assert EDIT not in (slim_tree_0260 / UTILS).read_text()  # as it said: the edit is gone


def test_no_catalogue_notice_says_what_to_do_itself():
    """status adds the advice by the patch's state; a notice that said it too printed it
    twice ("`patchkit apply` fixes it; `patchkit apply` fixes it")."""
    notices = [(p.id, n.message) for p in CATALOGUE.patches for n in p.notices]
    said = [(patch, message) for patch, message in notices if "patchkit apply" in message]
    assert not said, said
