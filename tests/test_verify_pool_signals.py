"""A signal while serving's pool starts or kills its engines leaves none of them running.

strace's ``inject`` delivers SIGTERM to patchkit at a chosen system call of a run of
serving.serve_all over stand-in engines (tests/serving_helpers.py): at the fork of an
engine, SIGTERM was raised before the pool knew the child (inside Popen, or before
start() returned), and the engine went on, orphaned, holding its GPU; at the kill of
the first engine, a second SIGTERM left the others. Each run ends with Terminated and
no child of patchkit left.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest

from patchkit import signals
from tests.conftest import REPO
from tests.fault_helpers import ENV, STRACE, default_dispositions
from tests.serving_helpers import POOL_RUN

pytestmark = pytest.mark.skipif(
    STRACE is None or subprocess.run([STRACE, "-o", "/dev/null", "true"]).returncode != 0,
    reason="strace is not installed or cannot trace here (apt-get install strace)",
)

FORKS = "vfork,fork,clone,clone3"  # how Popen may start a child (no thread in this run)


def pool_run(tmp_path, injections: list[str], at_once: int, *names: str) -> dict:
    """serve_all over stand-ins named ``names`` with strace's ``injections``: what it raised,
    which children were left and how many SIGTERMs strace injected (to the traced
    process itself: no -f)."""
    work, log = tmp_path / "work", tmp_path / "strace.log"
    work.mkdir()
    traced = ",".join(inject.split(":")[0] for inject in injections)  # inject needs them traced
    strace = [STRACE, "-qq", "-o", str(log), "-e", f"trace={traced}"]
    for inject in injections:
        strace += ["-e", f"inject={inject}"]
    done = subprocess.run(
        [*strace, sys.executable, "-c", POOL_RUN, str(work), str(at_once), *names],
        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120,
        preexec_fn=default_dispositions,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    delivered = log.read_text().count("--- SIGTERM {si_signo=SIGTERM, si_code=SI_KERNEL")
    return json.loads(done.stdout.splitlines()[-1]) | {"delivered": delivered}


@pytest.mark.parametrize("at", [1, 2])
def test_sigterm_at_an_engines_fork_leaves_no_engine_running(tmp_path, at):
    """The first engine's fork, or the second's with the first running beside it."""
    found = pool_run(tmp_path, [f"{FORKS}:signal=SIGTERM:when={at}"], 2, "a", "b")
    assert found == {"raised": "Terminated: SIGTERM", "left": [], "delivered": 1}


def test_sigterm_at_the_fork_of_a_failed_engines_second_attempt_leaves_none(tmp_path):
    """serve_all runs a failed engine again alone, after the pool: its fork is the
    second of the run (the first engine exited 1 at once)."""
    found = pool_run(tmp_path, [f"{FORKS}:signal=SIGTERM:when=2"], 1, "fails-once")
    assert found == {"raised": "Terminated: SIGTERM", "left": [], "delivered": 1}


def test_a_second_sigterm_while_the_engines_are_killed_leaves_none(tmp_path):
    """SIGTERM at the second engine's fork, and again at the kill of the first."""
    injections = [f"{FORKS}:signal=SIGTERM:when=2", "kill:signal=SIGTERM:when=1"]
    found = pool_run(tmp_path, injections, 2, "a", "b")
    assert found == {"raised": "Terminated: SIGTERM", "left": [], "delivered": 2}


def test_sigterm_while_the_pool_waits_kills_its_engines(tmp_path):
    """The pool asleep between two looks at its engines (time.sleep), both running."""
    found = pool_run(tmp_path, ["clock_nanosleep:signal=SIGTERM:when=1"], 2, "a", "b")
    assert found == {"raised": "Terminated: SIGTERM", "left": [], "delivered": 1}


def test_deferred_raises_a_signal_of_the_block_as_it_ends_and_leaves_ignored_ones():
    """What the pool holds its starts and kills with: the handlers, not the mask (a child
    started inside inherits no blocked signal), each put back afterwards."""
    before = {signum: signal.getsignal(signum) for signum in signals.HELD}
    signals.install()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        reached = []
        with pytest.raises(signals.Terminated, match="SIGTERM"):
            with signals.deferred():
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGHUP)  # ignored: stays ignored
                assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & signals.HELD
                reached.append("the end of the block")
        assert reached == ["the end of the block"]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_held_holds_a_signal_another_thread_took_until_the_block_ends():
    """The mask is the main thread's alone: a SIGTERM that another thread took (fetch's
    range reads run in threads) ran its handler in the main thread inside the block, and
    a staging directory lost its marker half way. held() defers the handlers too."""
    before = {signum: signal.getsignal(signum) for signum in signals.HELD}
    signals.install()
    go, took = threading.Event(), threading.Event()

    def other():  # started before the block: its mask is open, as a range read's is
        go.wait()
        signal.raise_signal(signal.SIGTERM)  # delivered to this thread
        took.set()

    worker = threading.Thread(target=other)
    worker.start()
    try:
        reached = []
        with pytest.raises(signals.Terminated, match="SIGTERM"):
            with signals.held():
                go.set()
                took.wait()
                worker.join()
                reached.append("the end of the block")
        assert reached == ["the end of the block"]
    finally:
        go.set()
        worker.join()
        for signum, handler in before.items():
            signal.signal(signum, handler)
