#!/usr/bin/env python3
"""Time `patchkit status` and `patchkit apply` on a real installed-layout vLLM tree.

Targets: status < 0.5 s, apply of all patches (bytecode clearing
included) < 2 s on the 2-core machine. For comparison the same change is made
with `git apply` followed by `find -name '*.pyc' -delete`.

    python scripts/bench_cli.py [--version 0.26.0] [--runs 10]

Every command runs as a fresh process (what a user or a Dockerfile RUN line
pays), timed by wall clock; the tree is byte-compiled first so there is
bytecode to clear. Prints a Markdown table of median / min / max seconds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from patchkit.catalogue.load import load_catalogue
from patchkit.releases.fetch import fetch
from patchkit.vllmtree.tree import locate


def timed(command: list[str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.26.0")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="patchkit-bench-"))
    tree = work / "site-packages"
    shutil.copytree(fetch(args.version), tree)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(tree / "vllm")])
    patchkit = [sys.executable, "-m", "patchkit"]
    target = ["--target", str(tree)]
    catalogue = load_catalogue()
    vllm_tree = locate(str(tree))
    diffs = []
    for patch in catalogue.patches:
        expected = patch.expected_for(vllm_tree.parsed_version)
        if hasattr(expected, "diff_path"):
            diffs.append(str(expected.diff_path))

    rows = {"patchkit status": [], "patchkit apply (all patches + pyc)": [],
            "git apply + find -name '*.pyc' -delete": [], "patchkit revert": []}  # fmt: skip
    for _ in range(args.runs):
        rows["patchkit status"].append(timed(patchkit + ["status"] + target))
        rows["patchkit apply (all patches + pyc)"].append(timed(patchkit + ["apply"] + target))
        rows["patchkit revert"].append(timed(patchkit + ["revert"] + target))
        start = time.perf_counter()
        subprocess.run(["git", "apply", *diffs], cwd=tree, check=True)
        subprocess.run(["find", str(tree), "-name", "*.pyc", "-delete"], check=True)
        rows["git apply + find -name '*.pyc' -delete"].append(time.perf_counter() - start)
        subprocess.run(["git", "apply", "-R", *diffs], cwd=tree, check=True)

    print(f"vLLM {args.version} tree, {args.runs} runs each, python {sys.version.split()[0]}")
    print("| command | median s | min s | max s |\n|---|---|---|---|")
    for name, times in rows.items():
        print(f"| {name} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} |")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
