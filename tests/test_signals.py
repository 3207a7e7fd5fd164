"""Signals at every write syscall of apply and revert.

strace's ``inject`` delivers SIGINT (or SIGTERM) to patchkit when it makes
the N-th rename, unlink, write or fsync, for every N the run reaches. A
signal acted on between a file's rename and the journal entry that records
it once left vLLM importing a module that did not exist, with no way back.
Now signals are held while a run changes the tree: each interrupted run
exits 0, 130 or 143 with one line, and a plain ``revert`` afterwards gives
the pristine tree back, ``.patchkit/`` and all.

Each point's run is a fork of a warm patchkit with strace attached
(tests/zygote.py): the same write syscalls as the console script's run (the
test checks the counts are equal), without tracing an interpreter start for
each of the ~350 points.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import PATCHKIT, normalized, slim_tree
from tests.fault_helpers import ENV, STRACE, default_dispositions, on_a_free_zygote, zygotes

SYSCALLS = ("rename", "renameat", "renameat2", "unlink", "unlinkat", "write", "fsync", "fdatasync")

pytestmark = pytest.mark.skipif(
    STRACE is None or subprocess.run([STRACE, "-o", "/dev/null", "true"]).returncode != 0,
    reason="strace is not installed or cannot trace here (apt-get install strace)",
)


def traced(args: list[str], strace_args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [STRACE, "-qq", *strace_args, *PATCHKIT, *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        preexec_fn=default_dispositions,
    )


def syscall_counts(log: Path) -> dict[str, int]:
    """How often a traced run made each of SYSCALLS, from strace's log."""
    counts = dict.fromkeys(SYSCALLS, 0)
    for line in log.read_text().splitlines():
        name = line.split("(", 1)[0]
        if name in counts:
            counts[name] += 1
    return counts


def counted(tree: Path, command: str, log: Path, zygote=None) -> dict[str, int]:
    """SYSCALLS made by ``command`` on ``tree``: as the console script runs it, or in a fork."""
    trace = ["-o", str(log), "-e", ",".join(SYSCALLS)]
    if zygote is None:
        done = traced([command, "--target", str(tree)], trace)
    else:
        done = zygote.run(command, "--target", str(tree), strace=trace)
    assert done.returncode == 0, done.stderr
    return syscall_counts(log)


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("signal-refs")
    pristine = slim_tree(base / "pristine")
    patched = slim_tree(base / "patched")
    done = subprocess.run([*PATCHKIT, "apply", "--target", str(patched)], env=ENV)
    assert done.returncode == 0
    return {"pristine": pristine, "patched": patched, "reference": normalized(pristine)}


def interrupt_at(trees: dict, start: str, command: str, syscall: str, n: int, signal: str,
                 work: Path, zygote) -> tuple[int, str | None]:  # fmt: skip
    """Deliver ``signal`` at the n-th ``syscall``, then revert: (exit status, problem or None)."""
    tree = work / f"{command}-{syscall}-{n}-{signal}"
    shutil.copytree(trees[start], tree, symlinks=True)
    inject = ["-o", "/dev/null", "-e", f"trace={syscall}",
              "-e", f"inject={syscall}:signal={signal}:when={n}"]  # fmt: skip
    result = zygote.run(command, "--target", str(tree), strace=inject)
    expected = {"INT": 130, "TERM": 143}[signal]
    problem = None
    if result.returncode not in (0, expected) or "Traceback" in result.stderr:
        problem = f"exit {result.returncode}: {result.stderr.strip()[-300:]}"
    else:
        clean = zygote.run("revert", "--target", str(tree))
        if clean.returncode != 0:
            problem = f"revert afterwards failed: {clean.stderr.strip()}"
        elif normalized(tree) != trees["reference"]:
            problem = "revert afterwards did not give the pristine tree back"
    shutil.rmtree(tree)
    where = f"{command}, {signal} at {syscall} #{n}"
    return result.returncode, None if problem is None else f"{where}: {problem}"


@pytest.mark.slow
@pytest.mark.parametrize("command,start", [("apply", "pristine"), ("revert", "patched")])
def test_a_signal_at_every_write_syscall_is_recoverable(trees, scratch_path, command, start):
    workers = max(2, os.cpu_count() or 2)
    with zygotes(workers) as free:
        copies = [scratch_path / "count-script", scratch_path / "count-fork"]
        for copy in copies:
            shutil.copytree(trees[start], copy, symlinks=True)
        counts = counted(copies[0], command, scratch_path / "script.log")
        forked = on_a_free_zygote(
            free, lambda z: counted(copies[1], command, scratch_path / "fork.log", z)
        )
        assert forked == counts, "the fork makes other write syscalls than the console script"
        assert counts["write"] > 5 and counts["fsync"] > 2
        assert counts["renameat"] + counts["rename"] > 2
        points = [(name, n, "INT") for name, total in counts.items() for n in range(1, total + 1)]
        points += [(name, n, "TERM") for name in ("rename", "renameat") for n in
                   range(1, counts[name] + 1)]  # fmt: skip

        def point_at(point):
            return on_a_free_zygote(
                free, lambda z: interrupt_at(trees, start, command, *point, scratch_path, z)
            )

        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(point_at, points))
    found = [problem for _, problem in results if problem]
    assert not found, f"{len(found)} of {len(points)} points: " + "; ".join(found[:5])
    codes = [code for code, _ in results]
    assert codes.count(130) > len(points) // 2 and 143 in codes  # the signals did arrive
