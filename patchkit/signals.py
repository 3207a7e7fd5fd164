"""Ctrl-C, SIGTERM and SIGHUP never split a step that changes a tree.

A KeyboardInterrupt raised between a rename and the journal entry that
records it once left a patched ``punica_gpu.py`` importing a module that was
never written, with no state to undo it. So every stretch that changes the
tree runs under :func:`held`: the three signals are blocked there
(``pthread_sigmask``), stay pending, and are acted on right after the
stretch ends, when the tree is in a state the journal and the state file
describe. SIGKILL cannot be held; the journal covers it (the next run rolls
back).

Python turns SIGINT into KeyboardInterrupt; :func:`install` makes SIGTERM and
SIGHUP raise :class:`Terminated`, so they too end at a safe point with their
own exit status (143, 129) instead of killing the process mid-write.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised at a safe point; exit status 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def install() -> None:
    """Let SIGTERM and SIGHUP end patchkit like Ctrl-C does, unless they are ignored."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _raise_terminated)


@contextmanager
def swallowed():
    """Hold the three signals for the block and drop those that arrived meanwhile.

    For the final output of a finished run: a report cut in half, or a second
    JSON document after the first, helps no one. The mask is restored after
    (a blocked mask would be inherited by every process started later).
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        while signal.sigtimedwait(HELD, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def held():
    """Hold SIGINT, SIGTERM and SIGHUP for the block; they are acted on as it ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
