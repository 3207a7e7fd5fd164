"""scripts/proofs/tree_rss.py: the peak host memory of a process tree (verify's memory target)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

HOLD = "import sys; a = b'x' * 200_000_000; print('ready', flush=True); sys.stdin.read()"


def _module():
    spec = importlib.util.spec_from_file_location("tree_rss", REPO / "scripts/proofs/tree_rss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_grandchilds_memory_counts_in_the_tree():
    """The engines are the verify process's descendants, not the process itself: 200 MB
    held by a grandchild (under a shell) is in the tree's sum, and not in a stranger's."""
    tree_rss = _module()
    shell = subprocess.Popen(["bash", "-c", f'{sys.executable} -c "{HOLD}"; exit 0'],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert shell.stdout.readline().strip() == "ready"
        tree = tree_rss.tree_memory(shell.pid)
        assert tree["processes"] == 2, tree
        for field in ("VmRSS", "RssAnon", "Pss", "Pss_Anon"):
            assert tree[field] >= 200_000_000, (field, tree)
        stranger = subprocess.Popen(["sleep", "30"])
        try:
            assert tree_rss.tree_memory(stranger.pid)["VmRSS"] < 100_000_000
        finally:
            stranger.kill()
            stranger.wait()
    finally:
        shell.stdin.close()
        shell.wait(timeout=60)


def test_the_record_keeps_the_commands_exit_status(tmp_path):
    out = tmp_path / "rss.json"
    done = subprocess.run([sys.executable, "scripts/proofs/tree_rss.py", str(out), "--",
                           "bash", "-c", "exit 3"], cwd=REPO, timeout=60)  # fmt: skip
    assert done.returncode == 3
    record = json.loads(out.read_text())
    assert record["exit"] == 3 and record["command"] == ["bash", "-c", "exit 3"]
    assert record["largest_process_rss_bytes"] > 0  # bash's own, at least
    assert set(record) >= {"peak_pss_bytes", "peak_private_bytes", "peak_anon_bytes"}


def test_a_call_without_its_separator_is_refused(tmp_path):
    command = [sys.executable, "scripts/proofs/tree_rss.py", str(tmp_path / "x"), "true"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr
    assert not (tmp_path / "x").exists()
