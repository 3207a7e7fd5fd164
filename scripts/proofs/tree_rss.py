"""Run a command and write the peak host memory of its whole process tree.

verify --model is a tree: the verify process, its vLLM engines and their workers,
the PEFT reference's child. Issue 53's requirement 4 bounds the tree's peak host
RSS (16 GB), which no one process's ru_maxrss says: this samples every process
under the command twice a second from /proc and keeps the peak of the sum.

    python3 scripts/proofs/tree_rss.py OUT.json -- COMMAND [ARG ...]

OUT.json: peak_rss_bytes (the sum of VmRSS over the tree at its highest sample;
pages shared between processes, as a model mmap-ed from /dev/shm, count once per
process, so this is an upper bound), peak_anon_bytes (the sum of RssAnon, memory
no other process shares, at its own highest sample), peak_processes, at_s (when
the RSS peak came), seconds, samples and the command's exit status, which is also
this script's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

INTERVAL_S = 0.5


def _status(pid: int) -> dict[str, int]:
    """PPid, VmRSS and RssAnon (bytes) of one process; {} once it has gone."""
    fields: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "PPid":
            fields["ppid"] = int(value)
        elif key in ("VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024  # kB in /proc: KiB
    return fields


def tree_memory(root: int) -> tuple[int, int, int]:
    """(VmRSS sum, RssAnon sum, processes) of ``root`` and every descendant."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _status(int(entry))
            if "ppid" in fields:
                table[int(entry)] = fields
    children: dict[int, list[int]] = {}
    for pid, fields in table.items():
        children.setdefault(fields["ppid"], []).append(pid)
    rss = anon = count = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            rss += table[pid].get("VmRSS", 0)
            anon += table[pid].get("RssAnon", 0)
            count += 1
        todo.extend(children.get(pid, ()))
    return rss, anon, count


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: tree_rss.py OUT.json -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    started = time.monotonic()
    child = subprocess.Popen(command)
    peak = {"peak_rss_bytes": 0, "peak_anon_bytes": 0, "peak_processes": 0, "at_s": 0.0}
    samples = 0
    while child.poll() is None:
        rss, anon, count = tree_memory(child.pid)
        samples += 1
        if rss > peak["peak_rss_bytes"]:
            peak.update(peak_rss_bytes=rss, at_s=round(time.monotonic() - started, 1))
        peak["peak_anon_bytes"] = max(peak["peak_anon_bytes"], anon)
        peak["peak_processes"] = max(peak["peak_processes"], count)
        time.sleep(INTERVAL_S)
    record = {**peak, "seconds": round(time.monotonic() - started, 1), "samples": samples,
              "exit": child.returncode, "command": command}  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
