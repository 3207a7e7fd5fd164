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
import threading
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
    """Hold SIGINT, SIGTERM and SIGHUP for the block; they are acted on as it ends.

    The mask keeps them off this thread's system calls (no EINTR mid-write); it is this
    thread's alone, and a signal sent to the process goes to a thread that does not
    block it (fetch's range reads run in threads of their own), whose handler Python
    then runs in the main thread, inside the block. So the handlers are deferred too
    (:func:`deferred`): what another thread took is raised as the block ends.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        with deferred():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def deferred():
    """The three signals noted during the block and raised again as it ends, where
    :func:`held` cannot hold them or must not: in a process with threads of its own,
    around starting a child.

    A mask is the blocking thread's own: the kernel gives a signal sent to the process
    to any thread that does not block it (signal(7)), and Python runs the handler in
    the main thread all the same; verify's process has CUDA's threads and the merged
    references' writer. And a child started inside held() inherits the blocked mask (a
    vLLM engine would not act on the SIGTERM its own shutdown sends). Here the handlers
    themselves are swapped for the block, which the main thread alone can do; in
    another thread no handler runs anyway.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {}
    for signum in HELD:
        handler = signal.getsignal(signum)
        if handler not in (signal.SIG_IGN, None):  # None: set outside Python, left alone
            previous[signum] = signal.signal(signum, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)  # its own handler now: raises, or ends the process
