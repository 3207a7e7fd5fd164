#!/usr/bin/env python3
"""Time `patchkit fetch` (the whole wheel, its sha256 checked: the default) and
`patchkit fetch --trust-ranges` (range requests) against `pip download` of the same
wheel, and the test cache's cold start: every tested release fetched into an empty cache.

Targets: `patchkit fetch 0.26.0` no slower than `pip download vllm==0.26.0
--no-deps --only-binary :all:` (at most 1.0x) on an idle 2-core machine;
`--trust-ranges`, which skips the sha256 of the whole file, at most 0.35x; the
fresh-clone test command (most of it the release trees, by ranges) within 8 minutes.

    python scripts/bench_fetch.py [--version 0.26.0] [--runs 5] [--all] [--compare DIR]

Each run is a fresh process into an empty cache, timed by wall clock, the
commands interleaved so a change in the machine's load hits both: patchkit
with PATCHKIT_CACHE_DIR empty; pip with an empty PIP_CACHE_DIR (it downloads,
as on a fresh machine) and with --no-cache-dir (its fastest way). With
--all, one process fetches every release the tests use (the 25 tested ones
and 0.10.0) into an empty test cache as their fixtures do (tests/conftest.py,
release_tree), and with --compare each tree is compared file by file with
the one in DIR (a cache the tests filled before, by the whole-wheel path).
Prints a Markdown table and one JSON line with the numbers, the commit, the
host and the load average. On an ext4 without a journal, files created in
the minutes after many were deleted (this script's own cleanup, other test
runs) cost far more: leave five minutes after a large deletion.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from patchkit.catalogue.load import load_catalogue  # noqa: E402
from patchkit.releases.fetch import fetch  # noqa: E402


def timed(command: list[str], env: dict[str, str]) -> float:
    """Wall clock of one command, started with no dirty data of the runs before it:
    pip's 300 MB written back while the next command creates files throttles that one."""
    os.sync()
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr}")
    return elapsed


def fetch_runs(version: str, runs: int, work: Path) -> dict[str, list[float]]:
    patchkit = [sys.executable, "-m", "patchkit", "fetch", version]
    ranges = [*patchkit, "--trust-ranges"]
    pip = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
           "--only-binary", ":all:", "--quiet"]  # fmt: skip
    names = ("patchkit fetch", "patchkit fetch --trust-ranges", "pip download",
             "pip download --no-cache-dir")  # fmt: skip
    rows: dict[str, list[float]] = {name: [] for name in names}
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    for n in range(runs):
        run = work / f"run{n}"
        rows["patchkit fetch"].append(
            timed(patchkit, {"PATCHKIT_CACHE_DIR": str(run / "patchkit"), "PYTHONPATH": path})
        )
        rows["patchkit fetch --trust-ranges"].append(
            timed(ranges, {"PATCHKIT_CACHE_DIR": str(run / "ranges"), "PYTHONPATH": path})
        )
        rows["pip download"].append(
            timed([*pip, "-d", str(run / "pip")], {"PIP_CACHE_DIR": str(run / "pip-cache")})
        )
        rows["pip download --no-cache-dir"].append(
            timed([*pip, "--no-cache-dir", "-d", str(run / "pip-nc")], {})
        )
    # Nothing is deleted between runs: on an ext4 without a journal, creating a file
    # skips the inodes deleted in the last seconds, one block lookup each, so removing
    # the last run's 2,240 files would slow the next run's creation (perf: most of its
    # time in recently_deleted under ext4_create).
    return rows


def test_releases() -> list[str]:
    """The tested releases, and any other the tests ask release_tree() for (0.10.0)."""
    named = set()
    for path in (REPO / "tests").glob("*.py"):
        named |= set(re.findall(r"release_tree\(\"(\d+\.\d+\.\d+)\"\)", path.read_text()))
    tested = list(load_catalogue().tested_releases)
    return sorted(named - set(tested), key=lambda v: tuple(map(int, v.split(".")))) + tested


def fetch_all(cache: Path, compare: Path | None) -> dict:
    """Every release the tests use into ``cache`` (as their fixtures fetch them: by
    ranges), timed."""
    releases = test_releases()
    os.sync()
    start = time.perf_counter()
    for version in releases:
        fetch(version, cache / f"vllm-{version}", trust_ranges=True)
    elapsed = time.perf_counter() - start
    result = {"releases": len(releases), "seconds": round(elapsed, 1)}
    result["kept_bytes"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    if compare is not None:
        result["identical"] = [v for v in releases if same_tree(cache / f"vllm-{v}",
                                                                compare / f"vllm-{v}")]  # fmt: skip
    return result


def same_tree(a: Path, b: Path) -> bool:
    """The same file names with the same bytes (the marker names the same wheel too)."""

    def files(root: Path) -> dict[str, bytes]:
        return {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    return b.is_dir() and files(a) == files(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.26.0")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--all", action="store_true", help="also every tested release, cold")
    parser.add_argument("--compare", type=Path, help="a test cache to compare the trees with")
    parser.add_argument(
        "--work",
        type=Path,
        help="where caches and downloads go (default: the temporary directory; "
        "/dev/shm takes the shared disk out)",
    )
    args = parser.parse_args()

    load = [round(x, 2) for x in os.getloadavg()]
    work = Path(tempfile.mkdtemp(prefix="patchkit-bench-fetch-", dir=args.work))
    try:
        rows = fetch_runs(args.version, args.runs, work)
        every = fetch_all(work / "test-cache", args.compare) if args.all else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(times) for name, times in rows.items()}
    print("| command | median s | min s | max s |\n|---|---|---|---|")
    for name, times in rows.items():
        print(f"| {name} | {medians[name]:.2f} | {min(times):.2f} | {max(times):.2f} |")
    fastest_pip = min(medians["pip download"], medians["pip download --no-cache-dir"])
    ratio = medians["patchkit fetch"] / fastest_pip
    ranges_ratio = medians["patchkit fetch --trust-ranges"] / fastest_pip
    print(f"\npatchkit fetch / fastest pip download: {ratio:.2f}x (target <= 1.0x)")
    print(f"patchkit fetch --trust-ranges / fastest pip: {ranges_ratio:.2f}x (target <= 0.35x)")
    if every:
        print(f"every tested release into an empty test cache: {every}")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "host": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "load_before": load,
        "work": str(work.parent),
        "load_after": [round(x, 2) for x in os.getloadavg()], "runs": rows,
        "ratio": round(ratio, 3), "ranges_ratio": round(ranges_ratio, 3),
        "every_release": every,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
