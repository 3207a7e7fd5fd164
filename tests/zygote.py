"""A warm patchkit that forks one child per run: the fault walks pay no interpreter start.

The write-point walk runs patchkit hundreds of times, each with a fault hook
installed (an audit hook cannot be removed, so every faulty run needs a
process of its own). Starting a Python and importing patchkit cost about
0.3 s a run; a fork of this process, which has imported patchkit already,
costs a few milliseconds. The child is a real process: SIGKILL kills it, a
KeyboardInterrupt ends it with the CLI's exit status 130, as in a fresh
interpreter.

Protocol (one JSON object per line, both ways): {"args": [...], "code": "...",
"env": {...}} -> {"returncode": N, "stdout": "...", "stderr": "..."}; a
negative returncode is the signal that ended the child.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from patchkit.cli.main import main  # imported once, before any fork


def run(request: dict) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            _child(request, out.fileno(), err.fileno())
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}  # fmt: skip


def _child(request: dict, out: int, err: int) -> None:
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = os.fdopen(1, "w", closefd=False)
        sys.stderr = os.fdopen(2, "w", closefd=False)
        os.environ.update(request.get("env") or {})
        exec(request.get("code") or "", {"__name__": "__hook__"})
        main(request["args"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    for line in sys.stdin:
        sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
        sys.stdout.flush()
