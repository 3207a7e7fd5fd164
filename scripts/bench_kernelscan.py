#!/usr/bin/env python3
"""Time `patchkit doctor --kernels` cold, warm and remembered on real vLLM trees.

Targets: cold <= 3 min on a 2-core machine, warm <= 5 s.

    python scripts/bench_kernelscan.py [--version 0.26.0 ...] [--target TREE ...]
        [--cpus 0,1] [--python PYTHON]

Each scan is a fresh process, as a user or a Dockerfile RUN line pays:

- cold: empty Triton and patchkit caches (every kernel compiled and disassembled);
- warm: Triton's and patchkit's caches kept, the remembered scan removed, so
  vLLM's host code runs again and every reading comes from the cache (what a
  run pays after ``apply`` changed the tree);
- remembered: nothing changed since the last scan.

``--cpus 0,1`` pins each scan to those cores (``taskset``), to measure a
2-core machine on a bigger one. The Triton and torch used are those of
``--python`` (default: this one). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def scan(python: str, tree: Path, caches: Path, cpus: str | None) -> tuple[str, dict]:
    """One `doctor --kernels --json` run: 'wall s (CPU s)' and the scan's JSON.

    CPU time (user + system of the child and its compilers) says what an
    idle machine would take where this one is shared: about CPU / cores.
    """
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(caches / "triton")
    env["PATCHKIT_CACHE_DIR"] = str(caches / "patchkit")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [python, "-m", "patchkit", "doctor", "--kernels", "--json", "--target", str(tree)]
    if cpus:
        command = ["taskset", "-c", cpus, *command]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"doctor failed on {tree}: {done.stderr.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return f"{seconds:.1f} s ({cpu:.0f} s CPU)", json.loads(done.stdout)["kernels"]


def bench(python: str, tree: Path, cpus: str | None) -> dict:
    caches = Path(tempfile.mkdtemp(prefix="patchkit-bench-scan-"))
    try:
        cold, report = scan(python, tree, caches, cpus)
        if report.get("error"):
            sys.exit(f"the scan did not run: {report['error']}")
        shutil.rmtree(caches / "patchkit" / "kernel-scan" / "scans")
        warm, _ = scan(python, tree, caches, cpus)
        remembered, again = scan(python, tree, caches, cpus)
        assert again["remembered"] and len(again["cases"]) == len(report["cases"])
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    kernels = {c["kernel"] for c in report["cases"]}
    return {
        "tree": tree.name,
        "triton": report["toolchain"]["triton"],
        "scanned": f"{len(kernels)} kernels x {len(report['cases'])} configs, "
        f"{report['calls']} calls on {len(report['gpus'])} GPU(s)",
        "cold": cold,
        "warm": warm,
        "remembered": remembered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="append", default=[], help="fetch this release")
    parser.add_argument("--target", action="append", default=[], help="a vLLM tree to scan")
    parser.add_argument("--cpus", help="taskset CPU list, e.g. 0,1 for a 2-core machine")
    parser.add_argument("--python", default=sys.executable, help="the Python with torch+Triton")
    args = parser.parse_args()
    trees = [Path(t) for t in args.target]
    if args.version:
        from patchkit.releases.fetch import fetch

        trees += [fetch(v) for v in args.version]
    if not trees:
        parser.error("name a tree: --version or --target")
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| tree | Triton | scanned | cold | warm | remembered |")
    print("|---|---|---|---|---|---|")
    for tree in trees:
        row = bench(args.python, tree, args.cpus)
        print(
            f"| {row['tree']} | {row['triton']} | {row['scanned']} | {row['cold']} "
            f"| {row['warm']} | {row['remembered']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
