"""How the reports are laid out: one row set, one wrap rule, a short `list`.

`status`, `apply` and `revert` show the same rows (every catalogue patch, in
series order, opt-in ones in status's word) with the same columns, in text and
in --json; `--only` limits what a run does, not what it shows, and the
summary's states are the ones `status` says next. Text wraps at the terminal's
width, at most 100 columns, 100 where stdout is not a terminal; a word is never
split. `list` is a patch's releases then its title; `list -v` and `show ID` give the full
text. Each test runs the real catalogue on a real 0.26.0 tree.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import termios

import pytest

from tests.conftest import CATALOGUE, PATCHKIT, REPO, run_cli, run_subprocess
from tests.helpers import report_row

IDS = [p.id for p in CATALOGUE.patches]
ROW_KEYS = {"id", "state", "state_before", "action", "reason", "variant", "files", "warnings",
            "notices", "hunks"}  # fmt: skip
TOP_KEYS = {"format", "ok", "command", "vllm", "patches", "warnings", "notices", "notes", "summary",
            "dry_run", "bytecode_removed", "caches_removed", "runner"}  # fmt: skip
SPLIT = "split-in-proj-qkvz"  # not-applicable on 0.26.0, with a 125-character reason


def report(*args: str) -> dict:
    result = run_cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def status_summary(tree) -> str:
    return run_cli("status", "--target", str(tree)).stdout.splitlines()[-1]


def rows(text: str) -> list[str]:
    """The patch ids of a text report's rows (the lines indented exactly 2), in order."""
    return [line.split()[0] for line in text.splitlines()
            if line.startswith("  ") and not line.startswith("   ")]  # fmt: skip


# ----- one row set -----


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("apply",),
        ("apply", "--dry-run"),
        ("apply", "--only", "expand-block-n"),
        ("apply", "--only", "nan-probe"),
        pytest.param(("revert",), marks=pytest.mark.slow),
        ("revert", "--only", "nan-probe"),
    ],
    ids=lambda a: " ".join(a),
)
def test_every_command_shows_every_patch_with_the_same_keys(slim_tree_0260, args):
    """apply and revert used to leave nan-probe out (status listed it), and `--only X`
    showed X alone; status's JSON lacked state_before, action and hunks."""
    target = ("--target", str(slim_tree_0260))
    if args[0] == "revert":
        assert run_cli("apply", *target).exit_code == 0
    data = report(*args, *target)
    assert [p["id"] for p in data["patches"]] == IDS
    assert set(data) == TOP_KEYS
    extra = {"would_leave"} if "--dry-run" in args else set()
    assert [set(p) for p in data["patches"]] == [ROW_KEYS | extra] * len(IDS)
    text = run_cli(*args, *target)
    assert rows(text.stdout) == IDS, text.stdout


def test_a_patch_left_out_by_only_is_shown_as_status_shows_it(slim_tree_0260):
    target = ("--target", str(slim_tree_0260))
    before = {p["id"]: p for p in report("status", *target)["patches"]}
    data = report("apply", "--only", "expand-block-n", *target)
    after = {p["id"]: p for p in data["patches"]}
    assert (after["expand-block-n"]["action"], after["expand-block-n"]["state"]) == (
        "applied", "applied"
    )  # fmt: skip
    for patch_id in IDS[1:]:
        assert after[patch_id]["action"] == "none"
        assert (after[patch_id]["state"], after[patch_id]["reason"]) == (
            before[patch_id]["state"], before[patch_id]["reason"]
        )  # fmt: skip


@pytest.mark.parametrize(
    "runs",
    [
        [("apply",)],
        [("apply", "--only", "nan-probe")],
        [("apply",), ("apply", "--only", "nan-probe")],
        [("apply",), ("revert", "--only", "partial-gdn-adapter")],
        [("apply",), ("revert",)],
    ],
    ids=lambda r: " then ".join(" ".join(a) for a in r),
)
def test_the_summary_says_what_status_says_next(slim_tree_0260, runs):
    """`apply --only nan-probe` on a pristine tree ended "now 1 applied" while status
    then said 4 needed, 1 not-applicable, 1 applied: the same tree, two counts."""
    target = ("--target", str(slim_tree_0260))
    for args in runs:
        result = run_cli(*args, *target)
        assert result.exit_code == 0, result.output
    now = result.stdout.splitlines()[-1].split("; now ")[1]
    assert status_summary(slim_tree_0260) == f"status: {now}"


def test_a_dry_run_would_leave_what_the_run_then_leaves(slim_tree_0260):
    target = ("--target", str(slim_tree_0260))
    dry = run_cli("apply", "--dry-run", *target).stdout.splitlines()[-1]
    assert run_cli("apply", *target).exit_code == 0
    assert dry.split("it would leave ")[1] == status_summary(slim_tree_0260).split(": ")[1]


def test_a_patch_left_out_by_only_is_not_judged_by_strict(slim_tree_0260):
    """--strict judges what the run does: a warning of a patch the run leaves alone (an
    outdated record, here one written by hand) does not stop `apply --only` another."""
    target = ("--target", str(slim_tree_0260))
    assert run_cli("apply", "--only", "expand-block-n", *target).exit_code == 0
    state_file = slim_tree_0260 / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    data["patches"][0]["patch_sha256"] = "0" * 64  # expand-block-n: "changed since applied"
    state_file.write_text(json.dumps(data))
    assert any("changed since" in w["message"] for w in report("status", *target)["warnings"])
    only = run_cli("apply", "--only", "partial-gdn-adapter", "--strict", *target)
    assert only.exit_code == 0, only.output
    strict = run_cli("apply", "--strict", *target)
    assert strict.exit_code == 1 and "changed since" in strict.stderr


# ----- one wrap rule -----


def widths(text: str) -> list[int]:
    return [len(line) for line in text.splitlines()]


@pytest.mark.parametrize(
    "columns,widest", [pytest.param(None, 100, marks=pytest.mark.slow), ("300", 100), ("72", 72)]
)
def test_status_and_list_wrap_at_the_terminal_width_at_most_100(slim_tree_0260, columns, widest):
    """status's reasons ran 170 characters on one line while `list` wrapped at 100."""
    env = {"COLUMNS": columns}
    for args in (("status", "--target", str(slim_tree_0260)), ("list",), ("list", "-v")):
        if columns is None:  # a child, so that stdout is a pipe: not a terminal
            result = run_subprocess(*args, env=env)
            assert result.returncode == 0, result.stderr
        else:
            result = run_cli(*args, env=env)
            assert result.exit_code == 0, result.output
        over = [line for line in result.stdout.splitlines() if len(line) > widest]
        # only where one word (an identifier, a URL) is longer than the room left
        assert all(len(line.split()[-1]) > 40 for line in over), (args, over)
        assert max(widths(result.stdout)) > widest - 15, args  # it fills the line, too


def test_a_wrapped_reason_keeps_its_words_and_its_column(slim_tree_0260):
    result = run_cli("status", "--target", str(slim_tree_0260), env={"COLUMNS": "100"})
    reason = report("status", "--target", str(slim_tree_0260))["patches"][2]["reason"]["message"]
    assert len(reason) > 100
    lines = result.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"  {SPLIT} "))
    column = lines[first].index("not-applicable") + len("not-applicable   ")
    assert lines[first + 1].startswith(" " * column) and lines[first + 1][column] != " "
    assert report_row(result.stdout, SPLIT).split("not-applicable", 1)[1].strip() == reason


def test_a_word_longer_than_the_line_is_never_split():
    """A URL is copied from the report whole, however narrow the terminal."""
    result = run_cli("show", "expand-block-n", env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    words = [w.rstrip(",") for w in result.stdout.split()]
    assert set(CATALOGUE.get("expand-block-n").upstream) <= set(words)
    assert max(widths(result.stdout)) > 40  # the URLs are longer than the line


def test_a_narrow_terminal_continues_a_reason_at_8(slim_tree_0260):
    """At 72 columns the detail column (43) leaves too little room: its next lines start
    at column 8 and fill the line, rather than a ribbon 29 characters wide."""
    result = run_cli("status", "--target", str(slim_tree_0260), env={"COLUMNS": "72"})
    lines = result.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"  {SPLIT} "))
    assert lines[first + 1].startswith(" " * 8) and lines[first + 1][8] != " "
    assert len(lines[first + 1]) > 50


# ----- list short, list -v and show in full -----


def list_blocks(text: str) -> dict[str, list[str]]:
    """`list`'s lines per patch: from its "ID: " line to the line before the next one's."""
    lines = text.splitlines()
    lines = lines[: next(i for i, x in enumerate(lines) if "tested release" in x)]  # the footer
    starts = [i for i, line in enumerate(lines) for p in IDS if line.startswith(f"{p}: ")]
    ends = [*starts[1:], len(lines)]
    return {lines[i].split(":")[0]: lines[i:j] for i, j in zip(starts, ends, strict=True)}


@pytest.mark.parametrize("columns", ["100", "72"])
def test_list_is_the_releases_then_the_title_per_patch(columns: str):
    """`list` printed 141 lines for five patches (each one's whole Why). Now each patch is
    its releases, then its title at column 4: two lines unless the releases are longer
    than the line; then they continue under themselves (never at the title's column 4),
    a run ("upstream 0.34.0") never split. Nothing of the why or remove-when."""
    result = run_cli("list", env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    blocks = list_blocks(result.stdout)
    assert list(blocks) == IDS
    for patch in CATALOGUE.patches:
        block = blocks[patch.id]
        title_at = next(i for i, line in enumerate(block) if line[:5] == "    " + line[4:5]
                        and line[4] != " ")  # fmt: skip
        assert " ".join(line.strip() for line in block[title_at:]) == patch.title
        assert all(line.startswith("    ") for line in block[title_at:])
        releases = block[:title_at]
        assert releases, block
        for line in releases[1:]:  # under the releases, never at the title's column
            assert len(line) - len(line.lstrip()) >= 8, block
        said = " ".join(line.strip() for line in releases).split(": ", 1)[1]
        assert said == listed_releases(patch.id)
        for run in said.split(", "):  # each run whole on one line
            assert any(run in line for line in releases), (run, block)
        assert all(len(line) <= int(columns) for line in block)
        assert "why:" not in result.stdout and patch.remove_when[:40] not in result.stdout
    assert "`patchkit show ID`" in " ".join(result.stdout.splitlines()[-3:])


def listed_releases(patch_id: str) -> str:
    """What `list` says of a patch's releases, from the catalogue: runs of tested releases
    with one word each, in the states' words."""
    from packaging.version import Version

    from patchkit.catalogue.model import Variant

    patch, runs = CATALOGUE.get(patch_id), []
    for release in CATALOGUE.tested_releases:
        entry = patch.expected_for(Version(release))
        word = "applies to" if isinstance(entry, Variant) else entry.state
        name = entry.name if isinstance(entry, Variant) else None
        if runs and runs[-1][0] == word:
            runs[-1][2] = release
        else:
            runs.append([word, release, release, set()])
        runs[-1][3] |= {name} - {None}
    words = [f"{w} {a}" + (f"-{b}" if b != a else "") + (f" ({len(n)} variants)" if len(n) > 1
             else "") for w, a, b, n in runs]  # fmt: skip
    return ", ".join((["opt-in"] if patch.opt_in else []) + words)


def test_list_names_the_releases_in_the_states_words():
    text = run_cli("list", env={"COLUMNS": "100"}).stdout
    blocks = list_blocks(text)
    for patch_id in IDS:
        lines = blocks[patch_id][:-1]
        said = " ".join(line.strip() for line in lines).split(": ", 1)[1]
        assert said == listed_releases(patch_id)
    assert blocks["nan-probe"][0].startswith("nan-probe: opt-in, applies to 0.17.0-")


def test_each_release_in_list_is_what_status_says_on_a_pristine_tree(tmp_path):
    """The words `list` gives a release are status's on that release (applies to: needed)."""
    from tests.conftest import release_tree

    text = run_cli("list", env={"COLUMNS": "300"}).stdout
    for version, expected in (("0.18.1", "needed"), ("0.19.0", "upstream"),
                              ("0.21.0", "not-applicable")):  # fmt: skip
        states = {p["id"]: p["state"] for p in report("status", "--target",
                  str(release_tree(version)))["patches"]}  # fmt: skip
        assert states[SPLIT] == expected
    assert f"{SPLIT}: applies to 0.17.0-0.18.1, upstream 0.19.0-0.20.2" in text


@pytest.mark.parametrize("how", [("list", "-v"), ("show",)])
def test_list_v_and_show_give_the_full_text(how):
    for patch in CATALOGUE.patches:
        args = (*how, patch.id) if how == ("show",) else how
        result = run_cli(*args, env={"COLUMNS": "100"})
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.split())
        for words in (patch.title, patch.why, patch.remove_when, *patch.upstream):
            assert " ".join(words.split()) in text, (patch.id, words[:60])
        for variant in patch.variants:
            assert f"variant {variant.name} ({variant.diff_path.name})" in text
        for decision in patch.decisions:
            assert f"{decision.state}: {' '.join(decision.reason.split())}" in text
        for notice in patch.notices:
            assert f"known issue: {' '.join(notice.message.split())}" in text


@pytest.mark.parametrize("how", [("list", "-v"), ("show", "partial-gdn-adapter")])
def test_a_list_in_why_keeps_its_lines(how):
    """ "... the other: - 0.21.0-0.28.x: ... - 0.29.0 ..." read as one run-on paragraph:
    each "- " line of a patch's why starts its own line at 8, its next lines under its text
    at 10, and the paragraph after the list starts a line at 8 again."""
    why = CATALOGUE.get("partial-gdn-adapter").why.splitlines()
    items = [line for line in why if line.startswith("- ")]
    after = next(line for line in why[why.index(items[-1]) :] if line[0] not in " -")
    assert len(items) == 2
    result = run_cli(*how, env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for item in items:
        start = next(i for i, line in enumerate(lines) if line.startswith(" " * 8 + item[:20]))
        assert lines[start + 1].startswith(" " * 10) and lines[start + 1][10] != " "
    assert any(line.startswith(" " * 8 + after[:20]) for line in lines)
    assert not any(f" {item[:20]}" in line.strip() for line in lines for item in items)


def test_show_prints_one_patch_and_its_json_has_lists_shape():
    shown = run_cli("show", SPLIT)
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith(f"{SPLIT}: ")
    assert not any(f"{i}: " in shown.stdout for i in IDS if i != SPLIT)
    data = report("show", SPLIT)
    listed = report("list")
    assert data["patches"] == [p for p in listed["patches"] if p["id"] == SPLIT]
    assert data["tested_releases"] == listed["tested_releases"]


def test_show_of_an_unknown_id_is_a_usage_error_naming_the_known_ones():
    result = run_subprocess("show", "nope", "--json")
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout)
    assert (
        error["ok"] is False
        and "unknown patch 'nope'; known: expand-block-n" in error["error"]["message"]
    )
    assert "Traceback" not in result.stderr


def on_a_terminal(columns: int, *args: str) -> str:
    """patchkit's stdout on a pseudo-terminal ``columns`` wide (no COLUMNS set)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"PYTHONPATH": path}
    child = subprocess.Popen([*PATCHKIT, *args], stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert child.wait(timeout=60) == 0, child.stderr.read()
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.parametrize("columns,widest", [(64, 64), (160, 100)])
def test_the_width_is_the_terminals_at_most_100(columns, widest):
    """On a terminal its own width counts (COLUMNS unset), and never more than 100."""
    text = on_a_terminal(columns, "list")
    assert widest - 15 < max(widths(text)) <= widest, text


def test_a_range_is_written_lower_bound_first(slim_tree_0260):
    """show and doctor wrote `<0.18.0,>=0.17.0` (SpecifierSet's own order); they write
    a range as the catalogue does, lower bound first, in text and in --json."""
    upper_first = re.compile(r"<=?[0-9][0-9.]*,>")
    shown = run_cli("show", "expand-block-n").stdout
    assert ">=0.17.0,<0.18.0  variant block-k-16" in shown
    document = json.loads(run_cli("show", "expand-block-n", "--json").stdout)
    assert [v["versions"] for v in document["patches"][0]["variants"]] == [
        ">=0.17.0,<0.18.0",
        ">=0.18.0,<0.33.0",
    ]
    doctor = " ".join(run_cli("doctor", "--target", str(slim_tree_0260)).stdout.split())
    assert "vLLM 0.26.0 is not in >=0.17.0,<0.19.0" in doctor  # vllm#35286's range
    for text in (run_cli("list", "-v").stdout, doctor, json.dumps(document)):
        assert not upper_first.search(text), upper_first.search(text)


def test_a_command_in_backticks_is_never_split(monkeypatch):
    """A reinstall wrapped after "-m" in status's table ran the pip on PATH where a user
    copied its second line: a `command` stays on one line, the words around it flow."""
    from patchkit.cli import render

    monkeypatch.setenv("COLUMNS", "60")
    command = "/srv/my env/bin/python3.11 -m pip install --force-reinstall --no-deps vllm==0.26.0"
    text = f"the file differs from RECORD; reinstall vLLM (`{command}`) to patch it"
    lines = render.wrap("  expand-block-n  conflict  ", text)
    [holding] = [line for line in lines if "`" in line]
    assert f"`{command}`" in holding
    assert " ".join(line.strip() for line in lines).endswith(text)
    words = render.wrap("  x  ", "a `b\ue000c d` e")  # the placeholder itself: shown escaped
    assert words == ["  x  a `b\\ue000c d` e"]
