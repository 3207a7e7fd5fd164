"""A warm patchkit that forks one child per run: the fault walks pay no interpreter start.

The write-point walk runs patchkit hundreds of times, each with a fault hook
installed (an audit hook cannot be removed, so every faulty run needs a
process of its own). Starting a Python and importing patchkit cost about
0.3 s a run; a fork of this process, which has imported patchkit already,
costs a few milliseconds. The child is a real process: SIGKILL kills it, a
KeyboardInterrupt ends it with the CLI's exit status 130, as in a fresh
interpreter.

With "strace" (strace's command line without ``-p``), the child stops
itself before it runs anything and the zygote attaches strace to it: the
syscall faults strace injects (a signal at the N-th write, an error) reach
patchkit's own syscalls only, while strace stops the child at patchkit's few
thousand syscalls instead of the interpreter start's and the imports' too
(three times faster a run). The child restores what a fresh interpreter has:
SIGINT raises KeyboardInterrupt, SIGTERM is at its default.

Protocol (one JSON object per line, both ways): {"args": [...], "code": "...",
"env": {...}, "strace": [...]} -> {"returncode": N, "stdout": "...", "stderr":
"..."}; a negative returncode is the signal that ended the child.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import signal
import subprocess
import sys
import tempfile

from patchkit.cli.main import main  # imported once, before any fork


def run(request: dict) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        traced = request.get("strace")
        pid = os.fork()
        if pid == 0:
            _child(request, out.fileno(), err.fileno(), stop=bool(traced))
        problem = _attach(pid, traced) if traced else None
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode(errors="replace") + (problem or "")
        return {"returncode": code, "stdout": out.read().decode(errors="replace"),
                "stderr": stderr}  # fmt: skip


PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)


def _attach(pid: int, strace: list[str]) -> str | None:
    """strace attached to the stopped child, then the child let go; a problem, or None."""
    os.waitpid(pid, os.WUNTRACED)
    tracer = subprocess.Popen([*strace, "-p", str(pid)], stderr=subprocess.PIPE, text=True)
    line = tracer.stderr.readline()  # "strace: Process N attached", before it runs on
    if "attached" not in line:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        tracer.wait()
        return f"ZYGOTE: strace did not attach: {line.strip()}\n"
    os.kill(pid, signal.SIGCONT)
    tracer.stderr.read()
    tracer.wait()
    return None


def _like(stream, fd: int) -> io.TextIOWrapper:
    """A text stream on ``fd`` built as the interpreter built ``stream`` (PYTHONUNBUFFERED and
    all), so that the fork makes the same write syscalls as a fresh patchkit."""
    unbuffered = isinstance(stream.buffer, io.FileIO)  # -u or PYTHONUNBUFFERED
    raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    return io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors,
                            line_buffering=stream.line_buffering,
                            write_through=stream.write_through)  # fmt: skip


def _child(request: dict, out: int, err: int, stop: bool) -> None:
    code = 1
    try:
        if stop:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            # Where Yama restricts ptrace to ancestors: strace is a sibling.
            ctypes.CDLL(None).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
            os.kill(os.getpid(), signal.SIGSTOP)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = _like(sys.stdout, 1)
        sys.stderr = _like(sys.stderr, 2)
        os.environ.update(request.get("env") or {})
        exec(request.get("code") or "", {"__name__": "__hook__"})
        main(request["args"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # never back into the zygote's loop, whatever the flush raised


if __name__ == "__main__":
    for line in sys.stdin:
        sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
        sys.stdout.flush()
