"""Failure paths on real vLLM trees: each must exit non-zero and leave the tree byte-identical."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from patchkit.fs.safepath import Root
from patchkit.patching.transaction import TreeLock
from tests.conftest import (
    CATALOGUE,
    REPO,
    copy_tree,
    release_tree,
    run_cli,
    run_subprocess,
    snapshot,
)
from tests.helpers import FILES, MARK, REPORT_IMPORTS, make_catalogue

UTILS = "vllm/lora/ops/triton_ops/utils.py"
BLOCK_N_LINE = '"block_n": 64 if num_slices > 1 else 128,'


def test_drifted_file_differs_from_record(slim_tree_0260: Path):
    """An edit elsewhere in the file still lets the hunk apply, but RECORD catches it."""
    path = slim_tree_0260 / UTILS
    path.write_text(path.read_text() + "# local edit\n")
    before = snapshot(slim_tree_0260)
    result = run_cli("apply", "--target", str(slim_tree_0260))
    assert result.exit_code == 1
    assert "expand-block-n: conflict" in result.stderr
    assert UTILS in result.stderr and "RECORD" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert snapshot(slim_tree_0260) == before
    status = json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)
    assert status["patches"][0]["state"] == "conflict"


def test_drifted_hunk_without_record_names_the_hunk(tree_0260: Path):
    """A checkout has no RECORD: the hunk context is the check, and the message names it."""
    shutil.rmtree(next(tree_0260.glob("vllm-*.dist-info")))
    path = tree_0260 / UTILS
    path.write_text(path.read_text().replace(BLOCK_N_LINE, '"block_n": 256,'))
    before = snapshot(tree_0260)
    result = run_cli("apply", "--target", str(tree_0260))
    assert result.exit_code == 1
    message = result.stderr.strip()
    assert f"{UTILS}: hunk #1 (@@ -251,7 +251,18 @@)" in message
    assert "block_n" in message and "nothing was changed" in message
    assert snapshot(tree_0260) == before
    status = json.loads(run_cli("status", "--target", str(tree_0260), "--json").stdout)
    assert status["vllm"]["source"] == "file" and status["vllm"]["version"] == "0.26.0"


def test_malformed_patch_file(slim_tree_0260: Path, tmp_path: Path):
    catalogue = make_catalogue(
        tmp_path / "cat",
        release_tree("0.26.0"),
        diff_text="--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n",
    )
    before = snapshot(slim_tree_0260)
    result = run_cli(
        "apply", "--target", str(slim_tree_0260), env={"PATCHKIT_PATCHES_DIR": str(catalogue)}
    )
    assert result.exit_code == 1
    assert "two-files.diff: malformed unified diff" in result.stderr
    assert "Traceback" not in result.output
    assert snapshot(slim_tree_0260) == before


def test_unwritable_file_mid_apply_rolls_back(slim_tree_0260, two_file_catalogue, monkeypatch):
    """The second file cannot be written: the first is restored, exit 1."""
    import patchkit.patching.transaction as transaction

    real_write = transaction._write
    calls = []

    def failing_write(fs, path, data):
        calls.append(path)
        if len(calls) == 2:
            raise PermissionError(13, "Permission denied", str(path))
        real_write(fs, path, data)

    monkeypatch.setattr(transaction, "_write", failing_write)
    before = snapshot(slim_tree_0260)
    result = run_cli(
        "apply",
        "--target",
        str(slim_tree_0260),
        env={"PATCHKIT_PATCHES_DIR": str(two_file_catalogue)},
    )
    assert result.exit_code == 1
    assert "permission denied" in result.stderr.lower()
    assert "restored, nothing changed" in result.stderr
    assert calls[:2] == list(FILES)  # the second write failed; then the undo writes
    assert snapshot(slim_tree_0260) == before


CRASH_ON_SECOND_WRITE = """
import os, patchkit.patching.transaction as t
_real, _n = t._write, []
def _crash(fs, path, data):
    _n.append(path)
    if len(_n) == 2:
        os._exit(137)  # killed between the two file writes
    _real(fs, path, data)
t._write = _crash
"""


def test_crash_between_writes_is_rolled_back_by_next_apply(slim_tree_0260, two_file_catalogue):
    env = {"PATCHKIT_PATCHES_DIR": str(two_file_catalogue)}
    pristine = snapshot(slim_tree_0260)
    crashed = run_subprocess(
        "apply", "--target", str(slim_tree_0260), env=env, code=CRASH_ON_SECOND_WRITE
    )
    assert crashed.returncode == 137
    first, second = (slim_tree_0260 / f for f in FILES)
    assert MARK in first.read_text() and MARK not in second.read_text()  # half-applied

    status = run_cli("status", "--target", str(slim_tree_0260), env=env)
    assert "interrupted" in status.stderr

    recovered = run_cli("apply", "--target", str(slim_tree_0260), env=env)
    assert recovered.exit_code == 0, recovered.output
    assert f"rolled back an interrupted run: restored {FILES[0]}" in recovered.stdout
    assert MARK in first.read_text() and MARK in second.read_text()
    assert run_cli("revert", "--target", str(slim_tree_0260), env=env).exit_code == 0
    assert snapshot(slim_tree_0260) == pristine


def test_crash_between_writes_is_rolled_back_by_revert(slim_tree_0260, two_file_catalogue):
    env = {"PATCHKIT_PATCHES_DIR": str(two_file_catalogue)}
    pristine = snapshot(slim_tree_0260)
    run_subprocess("apply", "--target", str(slim_tree_0260), env=env, code=CRASH_ON_SECOND_WRITE)
    result = run_cli("revert", "--target", str(slim_tree_0260), env=env)
    assert result.exit_code == 0, result.output
    assert "rolled back an interrupted run" in result.stdout
    assert snapshot(slim_tree_0260) == pristine


def test_a_run_that_fails_after_rolling_back_says_the_roll_back_stands(
    slim_tree_0260, two_file_catalogue
):
    """A roll-back changes the tree: a later refusal must not say nothing was changed."""
    env = {"PATCHKIT_PATCHES_DIR": str(two_file_catalogue)}
    run_subprocess("apply", "--target", str(slim_tree_0260), env=env, code=CRASH_ON_SECOND_WRITE)
    refuse = (  # the commit finds a file changed since it was assessed: a refusal
        "import patchkit.patching.operations as o\n"
        "from patchkit.codes import Code, Reason\n"
        "from patchkit.errors import Refused\n"
        "def _refuse(*a, **k):\n"
        "    raise Refused(Reason.of(Code.CHANGED_WHILE_RUNNING, path='x'))\n"
        "o._execute = _refuse\n"
    )
    result = run_subprocess("apply", "--target", str(slim_tree_0260), env=env, code=refuse)
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "nothing was changed" not in line, line
    assert f"rolled back an interrupted run: restored {FILES[0]}; that stands" in line
    assert "nothing else was changed" in line


# The first run, inside the tree's lock at its commit, says so on its pipe and waits for
# the test's word; the second says on its own pipe when it finds the lock taken. No
# sleep decides who is first: the lock does, and the test sees it (a loaded machine
# only makes each step slower).
HOLDS_THE_LOCK = """
import os, patchkit.patching.operations as o
_real = o.commit
def _held(*a, **k):
    os.write(int(os.environ["TEST_SAID"]), b"locked\\n")
    os.read(int(os.environ["TEST_GO"]), 1)  # until the test says go
    _real(*a, **k)
o.commit = _held
"""
WAITS_FOR_THE_LOCK = """
import os, patchkit.fs.locks as locks
_real = locks.try_flock
_told = []
def _trying(fd):
    taken = _real(fd)
    if not taken and not _told:
        _told.append(os.write(int(os.environ["TEST_SAID"]), b"waiting\\n"))
    return taken
locks.try_flock = _trying
"""


def started(code: str, args: list[str], extra: tuple[int, ...] = ()):
    """patchkit with ``code`` first; its pipe for what it says, and (``extra``) the
    read end of the test's pipe as TEST_GO."""
    said_r, said_w = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TEST_SAID": str(said_w),
           "PATCHKIT_LOCK_TIMEOUT": "600"}  # fmt: skip
    if extra:
        env["TEST_GO"] = str(extra[0])
    command = [sys.executable, "-c", code + "\nfrom patchkit.cli.main import main\nmain()\n"]
    child = subprocess.Popen(command + args, stdout=subprocess.PIPE, text=True, env=env,
                             pass_fds=(said_w, *extra))  # fmt: skip
    os.close(said_w)
    return child, os.fdopen(said_r, "rb")


@pytest.mark.slow
def test_two_concurrent_applies(slim_tree_0260: Path):
    """The second run waits for the lock, then finds the patch applied."""
    args = ["apply", "--target", str(slim_tree_0260), "--json"]
    go_r, go_w = os.pipe()
    first, first_said = started(HOLDS_THE_LOCK, args, (go_r,))
    os.close(go_r)
    try:
        assert first_said.readline() == b"locked\n"  # it holds the lock, before its commit
        second, second_said = started(WAITS_FOR_THE_LOCK, args)
        assert second_said.readline() == b"waiting\n"  # it found the lock taken
        os.write(go_w, b"g")
    finally:
        os.close(go_w)
    outputs = [json.loads(p.communicate(timeout=120)[0]) for p in (first, second)]
    first_said.close()
    second_said.close()
    assert [first.returncode, second.returncode] == [0, 0]
    actions = [(o["patches"][0]["action"], o["patches"][0]["state"]) for o in outputs]
    assert actions == [("applied", "applied"), ("none", "applied")]
    state = json.loads(((slim_tree_0260 / ".patchkit") / "state.json").read_text())
    assert [p["id"] for p in state["patches"]] == [
        "expand-block-n",
        "matmul-add-lora-linear",
        "partial-gdn-adapter",
        "partial-moe-adapter",
    ]


def test_lock_timeout_is_a_clear_error(slim_tree_0260: Path):
    before = snapshot(slim_tree_0260)
    with Root.open(slim_tree_0260) as fs, TreeLock(fs):
        result = run_subprocess(
            "apply", "--target", str(slim_tree_0260), env={"PATCHKIT_LOCK_TIMEOUT": "0.3"}
        )
    assert result.returncode == 1
    assert "another patchkit run holds" in result.stderr
    shutil.rmtree(slim_tree_0260 / ".patchkit")  # the lock file this test made
    assert snapshot(slim_tree_0260) == before


@pytest.mark.parametrize("command", ["status", "apply", "revert", "doctor"])
def test_a_wrong_target_is_the_same_usage_error_in_every_command(tmp_path: Path, command):
    """A missing --target once exited 2 in one command, 1 in another, 0 in doctor."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for target, why in ((empty, "no vllm/ package there"), (tmp_path / "nowhere", "no such")):
        result = run_cli(command, "--target", str(target), "--json")
        assert result.exit_code == 2, (command, result.output)
        line = result.stderr.strip()
        assert why in line and "pass the directory that contains vllm/" in line
        assert json.loads(result.stdout)["exit_code"] == 2


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is importable in this environment"
)
def test_no_importable_vllm_and_no_target():
    result = run_cli("status")
    assert result.exit_code == 1
    assert "vLLM is not installed for this Python" in result.stderr
    assert "--target" in result.stderr and "patchkit fetch" in result.stderr


def set_version(root: Path, version: str) -> None:
    metadata = next(root.glob("vllm-*.dist-info")) / "METADATA"
    text = metadata.read_text()
    metadata.write_text(text.replace("Version: 0.26.0", f"Version: {version}", 1))


def test_unknown_version_with_matching_content_works_and_warns(slim_tree_0260: Path):
    set_version(slim_tree_0260, "0.30.1rc1.dev630+g18f8f9602")
    before = snapshot(slim_tree_0260)
    strict = run_cli("apply", "--target", str(slim_tree_0260), "--strict")
    assert strict.exit_code == 1
    assert "--strict: vLLM 0.30.1rc1.dev630+g18f8f9602 is not a tested release" in strict.stderr
    assert snapshot(slim_tree_0260) == before

    result = run_cli("apply", "--target", str(slim_tree_0260), "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["vllm"]["version"] == "0.30.1rc1.dev630+g18f8f9602"
    assert report["patches"][0]["action"] == "applied"
    assert any("not a tested release" in w["message"] for w in report["warnings"])


def test_unknown_version_with_other_content_is_a_conflict(slim_tree_0260: Path):
    set_version(slim_tree_0260, "0.40.0")
    shutil.rmtree(next(slim_tree_0260.glob("vllm-*.dist-info")) / "RECORD", ignore_errors=True)
    (next(slim_tree_0260.glob("vllm-*.dist-info")) / "RECORD").unlink(missing_ok=True)
    path = slim_tree_0260 / UTILS
    path.write_text(path.read_text().replace(BLOCK_N_LINE, '"block_n": select_block_n(),'))
    before = snapshot(slim_tree_0260)
    status = json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)
    assert status["patches"][0]["state"] == "conflict"
    assert "hunk #1" in status["patches"][0]["reason"]["message"]
    result = run_cli("apply", "--target", str(slim_tree_0260))
    assert result.exit_code == 1 and "conflict" in result.stderr
    assert snapshot(slim_tree_0260) == before


def test_edited_after_patching_revert_refuses_then_force(slim_tree_0260: Path):
    pristine = snapshot(slim_tree_0260)
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    path = slim_tree_0260 / UTILS
    path.write_text(path.read_text() + "# edited after patching\n")
    edited = snapshot(slim_tree_0260)
    refused = run_cli("revert", "--target", str(slim_tree_0260))
    assert refused.exit_code == 1
    assert "edited after patchkit applied expand-block-n" in refused.stderr
    assert "--force" in refused.stderr
    assert snapshot(slim_tree_0260) == edited
    forced = run_cli("revert", "--target", str(slim_tree_0260), "--force")
    assert forced.exit_code == 0, forced.output
    assert snapshot(slim_tree_0260) == pristine


def test_revert_without_backup_reverse_applies(slim_tree_0260: Path):
    pristine = snapshot(slim_tree_0260)
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    shutil.rmtree(slim_tree_0260 / ".patchkit")  # state and backups lost
    status = json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)
    assert status["patches"][0]["state"] == "applied"
    assert "no record" in status["patches"][0]["reason"]["message"]
    assert run_cli("revert", "--target", str(slim_tree_0260)).exit_code == 0
    assert snapshot(slim_tree_0260) == pristine


def test_reinstalled_tree_makes_the_record_stale(slim_tree_0260: Path):
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    shutil.copy2(release_tree("0.26.0") / UTILS, slim_tree_0260 / UTILS)  # pip reinstall
    status = json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)
    assert status["patches"][0]["state"] == "needed"
    again = run_cli("apply", "--target", str(slim_tree_0260), "--json")
    assert json.loads(again.stdout)["patches"][0]["action"] == "applied"


def test_changed_patch_file_is_reported(slim_tree_0260: Path, two_file_catalogue: Path):
    env = {"PATCHKIT_PATCHES_DIR": str(two_file_catalogue)}
    assert run_cli("apply", "--target", str(slim_tree_0260), env=env).exit_code == 0
    diff = two_file_catalogue / "two-files" / "two-files.diff"
    diff.write_text(diff.read_text().replace("@@ -", "@@ -", 1) + "\n")
    after_apply = snapshot(slim_tree_0260)
    result = run_cli("apply", "--target", str(slim_tree_0260), env=env)
    assert result.exit_code == 0
    assert "the patch file changed since it was applied" in result.stderr
    assert "patchkit revert --only two-files" in result.stderr
    strict = run_cli("apply", "--target", str(slim_tree_0260), "--strict", env=env)
    assert strict.exit_code == 1
    assert snapshot(slim_tree_0260) == after_apply


def test_only_unknown_id_is_a_usage_error(slim_tree_0260: Path):
    result = run_cli("apply", "--target", str(slim_tree_0260), "--only", "no-such-patch")
    assert result.exit_code == 2
    assert "unknown patch 'no-such-patch'" in result.output


@pytest.mark.slow
def test_only_a_patch_that_is_upstream_warns_and_strict_fails(tmp_path: Path):
    root = copy_tree("0.33.0", tmp_path / "sp")
    before = snapshot(root)
    result = run_cli("apply", "--target", str(root), "--only", "expand-block-n")
    assert result.exit_code == 0
    reason = CATALOGUE.get("expand-block-n").expected_for(Version("0.33.0")).reason
    assert reason.endswith("(upstream fix of triton#9433)")  # brackets of its own: not in more
    assert (
        "warning: expand-block-n was asked for with --only but is not applied; it is upstream "
        f"here: {reason}"
    ) in result.stderr
    strict = run_cli("apply", "--target", str(root), "--only", "expand-block-n", "--strict")
    assert strict.exit_code == 1
    assert snapshot(root) == before


def test_status_imports_neither_vllm_nor_torch(slim_tree_0260: Path):
    """status must work on GPU-less build machines and stay fast: files only."""
    result = run_subprocess("status", "--target", str(slim_tree_0260), code=REPORT_IMPORTS)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED: []" in result.stderr


def test_a_partial_reinstall_is_a_conflict_and_revert_removes_the_rest(slim_tree_0260: Path):
    """Seen on the test H200: vLLM's files unpacked again over a patched tree.

    punica_gpu.py is back to the wheel's, the new patchkit_lora_matmul.py is still
    there: neither applied nor pristine. status says so in one line (no crash) and
    names the way out; a plain revert gives the pristine tree back: it deletes only
    the file patchkit created, whose bytes are still what it wrote (no
    --force needed for what is safe).
    """
    pristine = snapshot(slim_tree_0260)
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    punica = "vllm/lora/punica_wrapper/punica_gpu.py"
    (slim_tree_0260 / punica).write_bytes((release_tree("0.26.0") / punica).read_bytes())
    status = json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)
    matmul = next(p for p in status["patches"] if p["id"] == "matmul-add-lora-linear")
    assert matmul["state"] == "conflict" and "partly reinstalled" in matmul["reason"]["message"]
    assert "patchkit revert --only matmul-add-lora-linear" in matmul["reason"]["message"]
    assert run_cli("revert", "--target", str(slim_tree_0260)).exit_code == 0
    assert snapshot(slim_tree_0260) == pristine


@pytest.mark.slow
def test_an_io_error_at_every_fsync_of_apply_leaves_the_tree_as_it_was_or_applied(scratch_path):
    """EIO at apply's last fsync (the directory's, after state.json's rename) left a
    .patchkit/state.json recording patches on a tree whose files were put back, and
    empty .patchkit/backups/ folders, while the message said nothing changed."""
    from tests.conftest import PATCHKIT, slim_tree
    from tests.fault_helpers import ENV, STRACE, Zygote, default_dispositions

    if STRACE is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    pristine = slim_tree(scratch_path / "pristine")
    with Zygote() as zygote:  # each EIO run: a fork of a warm patchkit, strace attached

        def traced(work: Path, extra: list[str], fork: bool = True):
            shutil.copytree(pristine, work, symlinks=True)
            if fork:
                return zygote.run("apply", "--target", str(work), strace=extra)
            command = [STRACE, "-qq", *extra, *PATCHKIT, "apply", "--target", str(work)]
            return subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV,
                                  preexec_fn=default_dispositions)  # fmt: skip

        counts = []
        for fork in (False, True):  # the console script's fsyncs, and the fork's: the same
            log = scratch_path / f"fsyncs-{fork}.log"
            done = traced(
                scratch_path / f"count-{fork}", ["-o", str(log), "-e", "trace=fsync"], fork
            )
            assert done.returncode == 0, done.stderr
            counts.append(sum(line.startswith("fsync(") for line in log.read_text().splitlines()))
        count = counts[0]
        assert count > 5 and counts[1] == count, counts
        before = snapshot(pristine)
        for n in range(1, count + 1):
            work = scratch_path / f"eio-{n}"
            result = traced(work, ["-o", "/dev/null", "-e", "trace=fsync", "-e",
                                   f"inject=fsync:error=EIO:when={n}"])  # fmt: skip
            if result.returncode == 1:
                assert "nothing" in result.stderr, (n, result.stderr)
                assert snapshot(work) == before, (n, result.stderr)
            else:
                assert result.returncode == 0, (n, result.stderr)
                status = run_cli("status", "--target", str(work), "--json")
                states = {p["state"] for p in json.loads(status.stdout)["patches"]}
                assert "needed" not in states, (n, states)
