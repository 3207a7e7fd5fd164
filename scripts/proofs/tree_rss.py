"""Run a command and write the peak host memory of its whole process tree.

verify --model is a tree: the verify process, its vLLM engines and their workers,
the PEFT reference's child. verify's memory target bounds the tree's peak host
RSS (16 GB, docs/verify.md), which no one process's ru_maxrss says: this samples every process
under the command twice a second from /proc and keeps the peak of the sum.

    python3 scripts/proofs/tree_rss.py OUT.json -- COMMAND [ARG ...]

OUT.json, each a peak over the samples:
- peak_rss_bytes: the sum of VmRSS over the tree. Pages shared between processes (a
  model's safetensors mmap-ed by three engines, CUDA's libraries) count once per
  process: an upper bound, 44.9 GB for a run whose private memory was 8.0 GB.
- peak_pss_bytes: the sum of Pss (smaps_rollup): each shared page divided among the
  processes that map it, so the tree's pages count once. File-backed pages among them
  are page cache the kernel can drop.
- peak_private_bytes: the sum of Pss_Anon and Pss_Shmem, memory the kernel cannot drop.
- peak_anon_bytes: the sum of RssAnon.
- largest_process_rss_bytes: the largest one process's peak RSS (getrusage of the
  waited-for children: what /usr/bin/time -v reports as its maximum resident set).
Also peak_processes, at_s (when the RSS peak came), seconds, samples, orphans_counted
(whether processes whose parent exited were kept in the tree: adopt_orphans) and the
command's exit status, which is also this script's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

INTERVAL_S = 0.5
PEAKS = {"peak_rss_bytes": "VmRSS", "peak_pss_bytes": "Pss", "peak_private_bytes": "Private",
         "peak_anon_bytes": "RssAnon", "peak_processes": "processes"}  # fmt: skip


SUMMED = ("VmRSS", "RssAnon", "Pss", "Pss_Anon", "Pss_Shmem")


def _fields(path: str, fields: dict[str, int]) -> None:
    """The SUMMED fields of one /proc file, in bytes (/proc's kB are KiB); none if gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in SUMMED:
            fields[key] = int(value.split()[0]) * 1024


def _parent(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return None


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def adopt_orphans() -> bool:
    """Make this process the subreaper of what it starts: a process whose parent exits
    (a vLLM engine core whose front end died, a daemonized helper) is then reparented
    here, not to init, and stays in the tree this script measures. False where prctl
    cannot (not Linux): orphans are then not counted."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tree_memory(root: int, include_root: bool = True) -> dict[str, int]:
    """The SUMMED fields over ``root`` and every descendant (``root`` itself left out
    when not ``include_root``: this script, measuring what it started), and "processes"."""
    parents = {int(e): _parent(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total = dict.fromkeys(SUMMED, 0) | {"processes": 0}
    todo = [root]
    while todo:
        pid = todo.pop()
        fields: dict[str, int] = {}
        if pid != root or include_root:
            _fields(f"/proc/{pid}/status", fields)
            _fields(f"/proc/{pid}/smaps_rollup", fields)
        if fields:
            total["processes"] += 1
            for key, value in fields.items():
                total[key] += value
        todo.extend(children.get(pid, ()))
    return total


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: tree_rss.py OUT.json -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    started = time.monotonic()
    adopted = adopt_orphans()
    child = subprocess.Popen(command)
    peak = dict.fromkeys(PEAKS, 0) | {"at_s": 0.0}
    samples = 0
    while child.poll() is None:
        now = tree_memory(os.getpid(), include_root=False)
        now["Private"] = now["Pss_Anon"] + now["Pss_Shmem"]
        samples += 1
        if now["VmRSS"] > peak["peak_rss_bytes"]:
            peak["at_s"] = round(time.monotonic() - started, 1)
        for name, field in PEAKS.items():
            peak[name] = max(peak[name], now[field])
        time.sleep(INTERVAL_S)
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    record = {**peak, "largest_process_rss_bytes": largest, "samples": samples,
              "seconds": round(time.monotonic() - started, 1), "exit": child.returncode,
              "orphans_counted": adopted, "command": command}  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
