"""A report never contradicts the tree: what a command did stands, whatever happens to stdout.

Exit 1 says nothing changed. So once apply, revert, refresh or fetch has done
its work, a stdout that cannot take the report (a full disk, a reader that
left the pipe) or a failure to tidy up or to clear caches is a warning on
stderr, with what the command did, and the exit status is 0; ``--json``
never prints a traceback. A stdout closed before patchkit starts can carry no
report: the command refuses before doing anything. Each test runs patchkit in
a child process on a copy of the real 0.26.0 tree, with stdout a full file
system (/dev/full), a pipe whose reader has left, or a closed descriptor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from patchkit.catalogue.model import Variant
from tests.conftest import CATALOGUE, release_tree, run_cli, run_subprocess, snapshot

UTILS = "vllm/lora/ops/triton_ops/utils.py"


def _default_set_on(version: str) -> tuple[int, int, int]:
    """(patches the default set applies, patches not applicable, opt-in patches) on a
    release, from the catalogue: a patch added to it changes the summary line, not this
    test."""
    wanted = [p for p in CATALOGUE.patches if not p.opt_in]
    made = sum(isinstance(p.expected_for(Version(version)), Variant) for p in wanted)
    return made, len(wanted) - made, len(CATALOGUE.patches) - len(wanted)


_MADE, _NA, _OPT = _default_set_on("0.26.0")
APPLIED = f"apply: {_MADE} applied now; now {_MADE} applied, {_NA} not-applicable, {_OPT} opt-in"


def patchkit(*args: str, stdout, code: str = "", cwd=None, env=None, preexec_fn=None):
    """patchkit in a child Python, its stdout given (a file, a descriptor), stderr read."""
    prelude = code + "\nfrom patchkit.cli.main import main\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", prelude, *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec_fn,
    )


def to_full_disk(*args: str, **kwargs):
    with open("/dev/full", "w") as full:
        return patchkit(*args, stdout=full, **kwargs)


def to_gone_reader(*args: str, **kwargs):
    """stdout a pipe whose reader has left (`| head` after its lines): writes fail, EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return patchkit(*args, stdout=write_end, **kwargs)
    finally:
        os.close(write_end)


def states(tree: Path) -> set[str]:
    status = json.loads(run_cli("status", "--target", str(tree), "--json").stdout)
    return {p["state"] for p in status["patches"] if p["state"] not in ("not-applicable", "opt-in")}


def assert_done(done, what: str) -> None:
    """Exit 0; stderr says the report was lost and what the command did; no traceback."""
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("patchkit: warning: stdout could not take the report ("), lines
    assert f"patchkit:   {what}" in lines, lines


@pytest.mark.slow
@pytest.mark.parametrize("json_flag", [(), ("--json",)], ids=["text", "json"])
def test_apply_and_revert_into_a_full_disk_exit_0_and_say_what_they_did(tree_0260, json_flag):
    """Both changed the tree and used to exit 1 "accessing the tree failed: no space left
    on the device" (with --json: a traceback)."""
    applied = to_full_disk("apply", "--target", str(tree_0260), *json_flag)
    assert_done(applied, APPLIED)
    assert "no space left on the device" in applied.stderr.splitlines()[0]
    assert states(tree_0260) == {"applied"}
    reverted = to_full_disk("revert", "--target", str(tree_0260), *json_flag)
    assert_done(
        reverted,
        f"revert: {_MADE} reverted now; now {_MADE} needed, {_NA} not-applicable, {_OPT} opt-in",
    )
    assert states(tree_0260) == {"needed"}


@pytest.mark.slow
@pytest.mark.parametrize("json_flag", [(), ("--json",)], ids=["text", "json"])
def test_a_report_lost_before_any_change_exits_1_and_names_the_command(tree_0260, json_flag):
    """status changes nothing: losing its report is its failure, said in one line."""
    before = snapshot(tree_0260)
    done = to_full_disk("status", "--target", str(tree_0260), *json_flag)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "patchkit: error: stdout could not take the report of `patchkit status` (no space "
        "left on the device); nothing was changed"
    ]
    assert snapshot(tree_0260) == before


@pytest.mark.slow
@pytest.mark.parametrize("command", ["list", "status"])
def test_a_reader_that_leaves_is_named_for_the_command_that_ran(tree_0260, command):
    """`patchkit list | head -2` used to print "`patchkit status` shows the tree"."""
    target = ("--target", str(tree_0260)) if command == "status" else ()
    done = to_gone_reader(command, *target)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"patchkit: error: stdout could not take the report of `patchkit {command}` (broken "
        "pipe: its reader left); nothing was changed"
    ]


def test_apply_whose_reader_left_exits_0_and_says_what_it_did(tree_0260):
    """`patchkit apply | head`: the apply stands; exit 1 would say nothing changed."""
    done = to_gone_reader("apply", "--target", str(tree_0260))
    assert_done(done, APPLIED)
    assert "broken pipe" in done.stderr.splitlines()[0]
    assert states(tree_0260) == {"applied"}


def close_stdout() -> None:
    os.close(1)


@pytest.mark.parametrize("command", ["apply", "status"])
def test_a_closed_stdout_refuses_before_doing_anything(tree_0260, command):
    """`patchkit apply >&-` used to patch the tree and exit 0 without a word."""
    before = snapshot(tree_0260)
    done = patchkit(
        command, "--target", str(tree_0260), stdout=subprocess.DEVNULL, preexec_fn=close_stdout
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "patchkit: error: stdout is closed, so patchkit could not report what it does; "
        "nothing was done (send it to a file, a pipe or /dev/null instead)"
    ]
    assert snapshot(tree_0260) == before


STDERR_TARGET = """
import atexit, os
atexit.register(lambda: os.write(1, ("STDERR=" + os.readlink("/proc/self/fd/2")).encode()))
"""


def test_a_closed_stderr_points_at_dev_null_and_the_command_runs(tree_0260):
    """Left closed, descriptor 2 would be the first file patchkit opens, and a child's
    stderr would write into it."""
    done = patchkit(
        "apply",
        "--target",
        str(tree_0260),
        stdout=subprocess.PIPE,
        code=STDERR_TARGET,
        preexec_fn=lambda: os.close(2),
    )
    assert done.returncode == 0
    assert done.stdout.splitlines()[-2:] == [APPLIED, "STDERR=/dev/null"]


def test_caches_that_cannot_be_cleared_after_apply_are_a_warning(tree_0260, tmp_path):
    """In a deleted working directory, clearing caches failed after the commit: exit 1,
    "accessing the tree failed", over an applied tree."""
    gone = tmp_path / "gone"
    gone.mkdir()
    code = f"import os; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})"
    done = run_subprocess("apply", "--target", str(tree_0260), "--clear-caches", code=code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == APPLIED
    assert "warning: the caches were left alone: accessing the caches failed" in done.stderr
    assert states(tree_0260) == {"applied"}


TIDY_FAILS = """
import errno, os
from patchkit.patching import operations
def _tidy(fs, lock):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
operations.tidy = _tidy
"""


def test_tidying_up_after_the_commit_failing_is_a_warning(tree_0260):
    """The commit stands; a full disk while tidying .patchkit/ used to exit 1."""
    done = run_subprocess("apply", "--target", str(tree_0260), code=TIDY_FAILS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == APPLIED
    assert (
        "warning: the tree was changed as reported, but tidying up failed: accessing the tree "
        "failed: no space left on the device" in done.stderr
    )
    assert states(tree_0260) == {"applied"}


def test_refresh_into_a_full_disk_exits_0_and_says_what_it_wrote(tree_0260, tmp_path):
    root = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, root)
    env = {"PATCHKIT_PATCHES_DIR": str(root)}
    target = ("--target", str(tree_0260))
    assert run_cli("apply", *target, "--only", "expand-block-n", env=env).exit_code == 0
    path = tree_0260 / UTILS
    path.write_text(path.read_text().replace("Hopper takes 32", "Hopper takes 32 (edited)"))
    for json_flag in ((), ("--json",)):
        done = to_full_disk("refresh", "expand-block-n", *target, *json_flag, env=env)
        diff = root / "expand-block-n" / "block-k-32.diff"
        assert_done(
            done,
            f"refresh: wrote {diff} (patch expand-block-n, variant block-k-32): 1 diffed, "
            "0 created, 0 left out",
        )
        assert "Hopper takes 32 (edited)" in diff.read_text()


def test_fetch_into_a_full_disk_gives_the_path_on_stderr(tmp_path):
    """fetch's product is the tree; its path goes to stderr when stdout cannot take it."""
    dest = tmp_path / "vllm"
    shutil.copytree(release_tree("0.26.0"), dest, symlinks=True)
    done = to_full_disk("fetch", "0.26.0", "--dest", str(dest))
    assert_done(done, f"fetch: vLLM 0.26.0 is at {dest}")


def test_a_bad_add_path_is_a_usage_error(tree_0260):
    """It used to exit 1, as if the tree were at fault."""
    before = snapshot(tree_0260)
    for path in ("/etc/passwd", "vllm/../setup.py", "setup.py"):
        done = run_cli("refresh", "expand-block-n", "--target", str(tree_0260), "--add", path)
        assert done.exit_code == 2, (path, done.output)
        assert "Invalid value for '--add'" in done.stderr
    assert snapshot(tree_0260) == before


def test_a_weight_file_that_cannot_be_read_is_named(tmp_path):
    """A weight file linked to /proc/self/mem (read() fails, EIO) was "reading the tree
    failed": no file, and no tree involved."""
    model, adapter = tmp_path / "model", tmp_path / "adapter"
    model.mkdir()
    adapter.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 8}')
    (model / "model.safetensors").symlink_to("/proc/self/mem")
    (adapter / "adapter_config.json").write_text(
        '{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}'
    )
    (adapter / "adapter_model.safetensors").symlink_to("/proc/self/mem")
    done = run_cli("verify", "--model", str(model), "--lora", f"x={adapter}")
    assert done.exit_code == 1
    assert done.stderr.strip() == (
        f"patchkit: error: reading {model / 'model.safetensors'} failed: Input/output error"
    )


def test_a_dry_run_shows_the_state_the_tree_is_in(tree_0260):
    """`apply --dry-run` showed `applied` in the state column of an untouched tree."""
    text = run_cli("apply", "--target", str(tree_0260), "--dry-run").stdout.splitlines()
    # a patch's row (two spaces in); not a hunk, a wrapped reason or the tree's wrapped path
    rows = {line.split()[0]: line.split()[1:3] for line in text if line.startswith("  ") and
            not line.startswith("   ")}  # fmt: skip
    assert rows["expand-block-n"] == ["needed", "would"]
    assert not any(state == "applied" for state, _ in rows.values())
    data = json.loads(run_cli("apply", "--target", str(tree_0260), "--dry-run", "--json").stdout)
    block_n = next(p for p in data["patches"] if p["id"] == "expand-block-n")
    assert (block_n["state"], block_n["action"], block_n["would_leave"]) == (
        "needed",
        "would-apply",
        "applied",
    )


def test_counts_are_in_their_number():
    """ "all 1 models answer sanely", "(and 1 more warnings)"."""
    from patchkit.canary.report import ModelCheck, Report
    from patchkit.cli.words import say
    from patchkit.codes import Code, Reason
    from patchkit.errors import Refused
    from patchkit.patching.decide import _fail_strict

    assert say(Report("http://h", models=[ModelCheck("m")]).outcome()) == (
        "the 1 model answers sanely"
    )
    assert say(Report("http://h", models=[ModelCheck("m"), ModelCheck("n")]).outcome()) == (
        "all 2 models answer sanely"
    )
    a, b = (Reason.of(Code.NOT_APPLIED, patch=p, state="needed") for p in "ab")
    with pytest.raises(Refused) as two:
        _fail_strict([a, b])
    assert say(two.value.reason).startswith(
        "--strict: a is not applied (needed) (and 1 more warning); "
    )
    with pytest.raises(Refused) as one:
        _fail_strict([a])
    assert say(one.value.reason) == "--strict: a is not applied (needed); nothing was changed"


def test_render_counts_in_their_number():
    from patchkit.cli.render import counted

    assert [counted(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert counted(1, "entry", "entries") == "1 entry"


def test_the_probe_report_counts_in_their_number(tmp_path):
    from tests.helpers import record, write_log

    log = write_log(tmp_path, record(5, 1, "mlp.down_proj", "lora", ["b"], order=5))
    lines = run_cli("probe", "report", str(log)).stdout.splitlines()
    assert lines[0] == f"nan-probe log {log}: 1 record over 1 step"
    assert lines[-1] == "probe report: 1 affected request"
