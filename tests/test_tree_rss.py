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


# A harness in its own process (a subreaper is per process): it adopts orphans as
# tree_rss.main does, starts a shell that starts the 200-MB holder in the background and
# exits at once (the holder's parent gone), waits until the holder gives its pid (its
# memory written), and
# prints the tree it measures from itself, as main does, then kills the holder.
ORPHAN_HARNESS = """
import importlib.util, json, os, subprocess, sys
spec = importlib.util.spec_from_file_location("t", sys.argv[1])
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
adopted = t.adopt_orphans() if sys.argv[3] == "adopt" else False
ready = sys.argv[2]
os.mkfifo(ready)
hold = "import os, signal, sys; a = b'x' * 200_000_000"
hold += "; open(sys.argv[1], 'w').write(str(os.getpid())); signal.pause()"
shell = f'{sys.executable} -c "{hold}" {ready} < /dev/null > /dev/null 2>&1 & exit 0'
subprocess.run(["bash", "-c", shell], check=True)
with open(ready) as fifo:
    holder = int(fifo.read())
tree = t.tree_memory(os.getpid(), include_root=False)
os.kill(holder, 9)
print(json.dumps({"adopted": adopted, **tree}), flush=True)
"""


@pytest.mark.parametrize("adopt", ["adopt", "no"])
def test_a_process_whose_parent_exited_stays_in_the_tree(tmp_path, adopt):
    """A vLLM engine core whose front end exited is reparented: to init it left the tree
    (and its memory the record); tree_rss adopts orphans (PR_SET_CHILD_SUBREAPER) and
    measures from itself, so the 200 MB held by one whose parent exited are counted."""
    script = str(REPO / "scripts/proofs/tree_rss.py")
    done = subprocess.run([sys.executable, "-c", ORPHAN_HARNESS, script, str(tmp_path / "ready"),
                           adopt], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout)
    if adopt == "adopt":
        assert tree["adopted"] and tree["processes"] == 1 and tree["RssAnon"] >= 200_000_000
    else:  # init took it: what tree_rss measured before
        assert tree["processes"] == 0 and tree["RssAnon"] == 0
