"""FIFOs and devices where patchkit expects a regular file are refused, never waited on.

In place of a patched file, of the journal's copy, of the lock, of a tuned
Triton config or of a model's config.json: one line naming the file (or a
finding, for doctor), and no command hangs or opens a device.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_subprocess
from tests.helpers import UTILS, one_error_line, one_line


@pytest.mark.slow
def test_a_fifo_in_place_of_a_patched_file(slim_tree_0260):
    (slim_tree_0260 / UTILS).unlink()
    os.mkfifo(slim_tree_0260 / UTILS)
    for command in ("status", "apply", "revert"):
        line = one_line(run_subprocess(command, "--target", str(slim_tree_0260), timeout=30))
        assert "a FIFO" in line and UTILS in line


CRASH_AT_STATE = """
import os, patchkit.fs.safepath as s
_real = s.Root.write
def _crash(self, relpath, data, origin):
    if relpath.endswith("state.json"):
        os._exit(137)
    _real(self, relpath, data, origin)
s.Root.write = _crash
"""


def test_a_fifo_in_the_journal_copy(slim_tree_0260):
    assert (
        run_subprocess("apply", "--target", str(slim_tree_0260), code=CRASH_AT_STATE).returncode
        == 137
    )
    orig = slim_tree_0260 / ".patchkit/txn/orig" / UTILS
    orig.unlink()
    os.mkfifo(orig)
    for command in ("apply", "revert"):
        line = one_line(run_subprocess(command, "--target", str(slim_tree_0260), timeout=30))
        assert "a FIFO" in line


def test_a_fifo_in_the_tuned_config_folder(tmp_path, slim_tree_0260):
    folder = tmp_path / "tuned"
    folder.mkdir()
    os.mkfifo(folder / "NVIDIA_H200_EXPAND_TRUE.json")
    result = run_subprocess("doctor", "--target", str(slim_tree_0260), "--json", timeout=30,
                      env={"VLLM_TUNED_CONFIG_FOLDER": str(folder)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "a FIFO, not a regular file" in result.stdout


def test_a_device_at_the_lock_is_refused_before_it_is_opened(slim_tree_0260):
    (slim_tree_0260 / ".patchkit").mkdir()
    try:
        os.mknod(slim_tree_0260 / ".patchkit" / "lock", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root")
    traced = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=openat", sys.executable, "-c",
         "from patchkit.cli.entry import main; main()", "apply", "--target", str(slim_tree_0260)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    ) if shutil.which("strace") else None  # fmt: skip
    result = run_subprocess("apply", "--target", str(slim_tree_0260))
    assert "not a regular file" in one_line(result)
    if traced is not None:
        assert '"lock", O_RDWR' not in traced.stderr


def test_a_fifo_named_config_json_is_refused_not_waited_on(tmp_path):
    """verify --model and doctor --kernels --model read config.json with read_text():
    a FIFO there hung both for ever."""
    import os

    model, adapter = tmp_path / "model", tmp_path / "adapter"
    model.mkdir()
    adapter.mkdir()
    os.mkfifo(model / "config.json")
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    verify = run_subprocess("verify", "--model", str(model), "--lora", f"a={adapter}")
    one_error_line(verify, 2, str(model), "config.json", "not a regular file")
    doctor = run_subprocess("doctor", "--kernels", "--model", str(model), "--target", str(model))
    assert doctor.returncode in (1, 2) and "Traceback" not in doctor.stderr, doctor.stderr


def test_an_entry_that_vanishes_during_the_mount_check_is_not_a_mount(tmp_path, monkeypatch):
    """Another run renames its temporary file away between the listing and the check:
    status once failed with '....patchkit-tmp is a mount point' under concurrent applies."""
    from patchkit.fs import safepath

    listed = safepath._children

    def with_a_ghost(fd, path):
        yield "ghost.patchkit-tmp", os.stat(tmp_path / "real"), path / "ghost.patchkit-tmp"
        yield from listed(fd, path)

    (tmp_path / "real").write_text("x")
    monkeypatch.setattr(safepath, "_children", with_a_ghost)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert safepath.mount_points_below(fd, tmp_path) is None
    finally:
        os.close(fd)
