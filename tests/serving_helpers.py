"""A stand-in engine for serving's pool, and a run of the pool under strace.

``python -m tests.serving_helpers JOB OUT`` is what serving.start runs for a Job whose
runner is this module: started as a vLLM engine is (its own session, its log), it
exits 1 at once when the job's name starts with "fails" and otherwise waits until it
is killed, so a test sees whether the parent killed every engine it started.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

# Run under strace in a child Python (argv: workdir, at_once, job names): serve_all
# over stand-in engines, then what is left: the exception it ended with, and the pids
# of this process's children still there (each killed here, so none outlives the test).
# A signal that never came ends the run all the same, by each engine's 30 s.
POOL_RUN = r"""
import json, os, signal, sys
from pathlib import Path
from patchkit import signals
from patchkit.verify import serving

signals.install()
work, at_once, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
jobs = [serving.Job(n, "/m", "eager", {}, [], runner="tests.serving_helpers") for n in names]
raised = None
try:
    serving.serve_all(jobs, work, 30.0, at_once)
except BaseException as exc:
    raised = f"{type(exc).__name__}: {exc}"
left = []
for entry in os.listdir("/proc"):
    try:
        stat = Path(f"/proc/{entry}/stat").read_text()
    except (OSError, ValueError):
        continue
    if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
        left.append(int(entry))
for pid in left:
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(json.dumps({"raised": raised, "left": left}))
"""


def stand_in(job_file: Path) -> None:
    """The engine's stand-in: exit 1 ("fails..."), or wait for the signal that kills it."""
    if json.loads(job_file.read_text())["name"].startswith("fails"):
        sys.exit(1)
    while True:
        signal.pause()


if __name__ == "__main__":
    stand_in(Path(sys.argv[1]))
