"""Reading never writes: only refresh acts on the journal a refresh killed mid-write left.

`patchkit list` and `show` once finished or undid that journal inside the
catalogue's loader, so a command that only reads wrote into ``patches/``
(and read its files whole: a huge staged file stopped every command, even
`list`). Now every command but refresh only notices the journal: list, show,
status and doctor say so on stderr and read the catalogue as it is; apply and
revert, which would write a tree from a catalogue half one refresh's, refuse.
refresh, which owns the journal, finishes or undoes it first and says so, and
`refresh --recover` does only that; no file it reads is read past its bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CATALOGUE, ENTRY, REPO, run_cli, slim_tree, snapshot

DIFF = "expand-block-n/block-k-32.diff"  # the variant 0.26.0 gets
STAGING = ".patchkit-refresh"
# what the interrupted refresh wrote: a diff of its own (the catalogue loads with it)
NEW = (CATALOGUE.root / "expand-block-n" / "block-k-16.diff").read_bytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def interrupted(tmp_path: Path, committed: bool) -> tuple[Path, Path]:
    """A catalogue copy and a 0.26.0 tree, with the journal a refresh of DIFF leaves when
    it is killed before installing anything: committed (the tree's record is the one it
    wrote, so recovery finishes it) or not (recovery rolls it back)."""
    catalogue = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, catalogue)
    tree = slim_tree(tmp_path / "site")
    assert run_cli("apply", "--target", str(tree), env=env(catalogue)).exit_code == 0
    record = (tree / ".patchkit" / "state.json").read_bytes()
    old = (catalogue / DIFF).read_bytes()
    staging = catalogue / STAGING
    for side, data in (("new", NEW), ("old", old)):
        (staging / side / DIFF).parent.mkdir(parents=True)
        (staging / side / DIFF).write_bytes(data)
    entry = {"path": DIFF, "before": sha(old), "after": sha(NEW)}
    after = sha(record) if committed else "1" * 64
    journal = {"tree": os.path.realpath(tree), "state_after": after, "files": [entry]}
    (staging / "journal.json").write_text(json.dumps(journal))
    return catalogue, tree


def env(catalogue: Path) -> dict:
    return {"PATCHKIT_PATCHES_DIR": str(catalogue)}


def one_warning(result, catalogue: Path) -> None:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: "), result.stderr
    assert "a patchkit refresh was interrupted while writing the catalogue" in lines[0]
    assert str(catalogue / STAGING) in lines[0] and "`patchkit refresh --recover`" in lines[0]


@pytest.mark.parametrize("committed", [True, False])
def test_list_show_status_and_doctor_read_and_say_so_and_write_nothing(tmp_path, committed):
    catalogue, tree = interrupted(tmp_path, committed)
    before, tree_before = snapshot(catalogue), snapshot(tree)
    for args in (["list"], ["list", "-v"], ["list", "--json"], ["show", "expand-block-n"],
                 ["doctor", "--target", str(tree)]):  # fmt: skip
        result = run_cli(*args, env=env(catalogue))
        assert result.exit_code == 0, (args, result.output)
        one_warning(result, catalogue)
    status = run_cli("status", "--target", str(tree), "--json", env=env(catalogue))
    assert status.exit_code == 0, status.output
    [warning] = [
        w["message"] for w in json.loads(status.stdout)["warnings"] if "refresh" in w["message"]
    ]
    assert "`patchkit refresh --recover` finishes or undoes it" in warning
    assert snapshot(catalogue) == before and snapshot(tree) == tree_before


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_apply_and_revert_refuse_a_half_written_catalogue(tmp_path, command):
    catalogue, tree = interrupted(tmp_path, committed=False)
    if command == "apply":
        assert run_cli("revert", "--target", str(tree)).exit_code == 0  # something to apply
    before, tree_before = snapshot(catalogue), snapshot(tree)
    result = run_cli(command, "--target", str(tree), env=env(catalogue))
    assert result.exit_code == 1, result.output
    [line] = result.stderr.strip().splitlines()
    assert "`patchkit refresh --recover`" in line and "nothing was changed" in line, line
    if command == "apply":  # a dry run reads only: it says so and goes on
        dry = run_cli(command, "--dry-run", "--target", str(tree), env=env(catalogue))
        assert dry.exit_code == 0 and "patchkit refresh --recover" in dry.stderr, dry.output
    assert snapshot(catalogue) == before and snapshot(tree) == tree_before


@pytest.mark.parametrize("committed, word", [(True, "finished"), (False, "rolled back")])
def test_refresh_recover_finishes_or_undoes_it_and_says_which(tmp_path, committed, word):
    catalogue, tree = interrupted(tmp_path, committed)
    old = (catalogue / DIFF).read_bytes()
    result = run_cli("refresh", "--recover", env=env(catalogue))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"refresh: {word} an interrupted refresh of {DIFF}\n"
    assert (catalogue / DIFF).read_bytes() == (NEW if committed else old)
    assert not (catalogue / STAGING).exists()
    again = run_cli("refresh", "--recover", "--json", env=env(catalogue))
    assert json.loads(again.stdout) == {"format": 1, "command": "refresh", "ok": True,
                                        "recover": True, "recovered": []}  # fmt: skip
    assert run_cli("list", env=env(catalogue)).stderr == ""


def test_a_refresh_recovers_first_and_its_report_says_so(tmp_path):
    catalogue, tree = interrupted(tmp_path, committed=False)
    args = ["refresh", "expand-block-n", "--target", str(tree)]
    result = run_cli(*args, env=env(catalogue))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"note: rolled back an interrupted refresh of {DIFF}", lines
    assert lines[1].startswith("refreshed expand-block-n (variant block-k-32)"), lines
    assert not (catalogue / STAGING).exists()
    catalogue, tree = interrupted(tmp_path / "json", committed=False)
    result = run_cli(*args[:2], "--target", str(tree), "--json", env=env(catalogue))
    assert json.loads(result.stdout)["recovered"] == [
        {
            "code": "catalogue-recovered",
            "message": f"rolled back an interrupted refresh of {DIFF}",
            "finished": False,
            "paths": [DIFF],
        }
    ]


def test_recover_takes_nothing_else_and_refresh_still_needs_an_id():
    for args in (["--recover", "expand-block-n"], ["--recover", "--target", "/tmp"]):
        result = run_cli("refresh", *args)
        assert result.exit_code == 2 and "--recover takes no ID" in result.stderr, result.output
    result = run_cli("refresh")
    assert result.exit_code == 2 and "Missing argument 'ID'" in result.stderr, result.output


def limited(args: list[str], catalogue: Path, memory: int = 1 << 30):
    """patchkit in a child whose address space is ``memory`` bytes: a file read whole
    past that is a MemoryError (exit 3), not a machine out of memory."""
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
            + ENTRY)  # fmt: skip
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": path, **env(catalogue)},
    )  # fmt: skip


@pytest.mark.parametrize("what", ["staged", "journal"])
def test_a_huge_staged_file_or_journal_is_never_read_whole(tmp_path, what):
    """A 4 GiB (sparse) staged copy once went whole into memory in every command that
    loaded the catalogue, `list` first: now list never reads it, and refresh refuses it
    by its size, before a byte, with one line."""
    catalogue, _ = interrupted(tmp_path, committed=True)  # recovery reads the staged copy
    huge = catalogue / STAGING / ("new/" + DIFF if what == "staged" else "journal.json")
    with open(huge, "r+b") as handle:
        handle.truncate(4 << 30)
    listed = limited(["list"], catalogue)
    assert listed.returncode == 0, listed.stderr
    assert "`patchkit refresh --recover`" in listed.stderr
    recovered = limited(["refresh", "--recover"], catalogue)
    assert recovered.returncode == 1, recovered.stderr
    [line] = recovered.stderr.strip().splitlines()
    assert "is larger than" in line and "it was not acted on" in line, line
    assert huge.stat().st_size == 4 << 30 and (catalogue / DIFF).read_bytes() != NEW
