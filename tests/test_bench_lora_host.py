"""scripts/bench_lora_host.py, the host time of one add_lora_linear call, on the CPU.

The ledger compares two modules' rows run by run; a row is only as good as what
it keeps. Each row must hold every counted run (`runs_us`), its `us` their
median, and the routes the docstring names, with the GEMV route's kernels
launching nothing on the CPU.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("torch", reason="the torch LoRA path needs torch (the test extra)")


def test_each_row_keeps_every_run_and_their_median(tmp_path):
    out = tmp_path / "host.json"
    bench = [sys.executable, "scripts/bench_lora_host.py", "--calls", "3", "--repeats", "4"]
    bench += ["--gemv-without-launches", "--json", str(out)]
    subprocess.run(bench, cwd=REPO, check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["info"]["device"] == "cpu" and report["info"]["gemv_without_launches"]
    routes = [(row["route"], row["slices"]) for row in report["rows"]]
    assert routes == [
        *((route, s) for route in ("gemm", "narrow") for s in (1, 2, 3, 4)),
        ("split", 1),
        *(("gemv", s) for s in (1, 2, 3, 4)),
    ]
    for row in report["rows"]:
        assert len(row["runs_us"]) == 4, row
        assert abs(row["us"] - statistics.median(row["runs_us"])) <= 0.1, row  # both rounded
        assert row["aten_ops"] > 0, row
