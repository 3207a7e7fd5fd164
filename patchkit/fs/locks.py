"""Waiting for a lock: one rule for the tree's lock and the catalogue's.

Two runs that write the same tree (apply, revert, refresh) or the same
catalogue (refresh) take an exclusive ``flock`` there; the second waits for
the first, up to ``PATCHKIT_LOCK_TIMEOUT`` seconds (60 when unset), then
stops with one line. The variable is read here and nowhere else: a value
that is not a number of seconds (``abc``, ``-1``, ``nan``) is an error in
every command that would wait, never a silent 60. ``inf`` waits without end.
"""

from __future__ import annotations

import fcntl
import math
import os
import time
from collections.abc import Callable

from patchkit.codes import Code, Reason
from patchkit.errors import Refused

LOCK_TIMEOUT_ENV = "PATCHKIT_LOCK_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
POLL_SECONDS = 0.05  # how often a waiting run tries the lock again


def lock_timeout() -> float:
    """PATCHKIT_LOCK_TIMEOUT in seconds (unset or empty: 60); anything else is refused."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "")
    if not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0:  # nan and negative numbers too
        raise Refused(
            Reason.of(
                Code.LOCK_TIMEOUT_INVALID,
                variable=LOCK_TIMEOUT_ENV,
                value=raw[:40],
                default=DEFAULT_TIMEOUT,
            )
        )
    return value


def try_flock(fd: int) -> bool:
    """Take the exclusive flock on ``fd`` if it is free; False if another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def release(fd: int) -> None:
    """Give the flock on ``fd`` back (closing the descriptor does it too)."""
    fcntl.flock(fd, fcntl.LOCK_UN)


def wait_for(try_lock: Callable[[], bool], timeout: float, busy: Reason) -> None:
    """Call ``try_lock`` until it takes the lock; after ``timeout`` seconds (from
    :func:`lock_timeout`) refuse with ``busy`` (which lock, and how long it waited). A
    timeout of 0 tries once."""
    deadline = time.monotonic() + timeout
    while not try_lock():
        if time.monotonic() >= deadline:
            raise Refused(busy)
        time.sleep(POLL_SECONDS)
