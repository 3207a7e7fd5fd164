"""Faults injected into a child patchkit: audit-hook write faults, a warm zygote, strace.

tests/test_write_points.py, tests/test_signals.py and the refresh transaction
tests use them; PATCHKIT (the command line that starts patchkit) is in
conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

from tests.conftest import REPO

STRACE = shutil.which("strace")

ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}


def default_dispositions() -> None:
    """In the child: SIGINT and SIGTERM acted on, whoever started the tests.

    A shell without job control starts a background command (`pytest &`) with
    SIGINT ignored; the ignore is inherited through strace by patchkit, which
    (as Python does, like nohup'ed programs) then lets Ctrl-C pass. That is
    right for patchkit and wrong for this test, which must see the signals.
    """
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


HOOK = r"""
import errno, os, signal, sys
_ROOT, _MODE, _AT = {root!r}, {mode!r}, {at}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_EVENTS = {{"os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.chmod"}}
_seen = [0]

def _hook(event, args):
    if event == "open":
        if not (isinstance(args[2], int) and args[2] & _WRITE):
            return
        creating = True
    elif event in _EVENTS:
        creating = event == "os.mkdir"
    else:
        return
    path = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes)) else ""
    if path.startswith("/") and not path.startswith(_ROOT):
        return
    _seen[0] += 1
    if _seen[0] != _AT:
        return
    sys.stderr.write("FAULT-POINT-REACHED\n")
    sys.stderr.flush()
    if _MODE == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if _MODE == "interrupt":
        raise KeyboardInterrupt
    if _MODE == "enospc" and creating:
        raise OSError(errno.ENOSPC, "No space left on device", path)

sys.addaudithook(_hook)
"""

MARK = "FAULT-POINT-REACHED\n"


class Zygote:
    """tests/zygote.py in a child: each run is a fork of a warm patchkit process."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "zygote.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip

    def run(self, *args: str, code: str = "", env: dict | None = None,
            strace: list[str] | None = None) -> SimpleNamespace:  # fmt: skip
        """patchkit ``args`` in a fork; ``strace``: strace's arguments, attached to the fork."""
        request = {"args": list(args), "code": code, "env": env or {}}
        if strace is not None:
            request["strace"] = [STRACE, *strace]
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return SimpleNamespace(**json.loads(self.process.stdout.readline()))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def zygotes(count: int):
    """``count`` warm zygotes in a queue: a thread takes one for a run and puts it back."""
    started = [Zygote() for _ in range(count)]
    free = queue.Queue()
    for zygote in started:
        free.put(zygote)
    try:
        yield free
    finally:
        for zygote in started:
            zygote.close()


def on_a_free_zygote(free, use):
    """``use(zygote)`` with a zygote taken from the queue ``free`` and given back, so that
    the points a pool of threads runs share a few warm zygotes, one point each at a time."""
    warm = free.get()
    try:
        return use(warm)
    finally:
        free.put(warm)
