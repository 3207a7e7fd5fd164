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


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_plan_key_is_timed_alone_and_issues_no_aten_op(tmp_path):
    """--plan-key times what each call compares with its layer's plan, and that key is
    host work only: a key that ran an aten op would be device work on every call."""
    out = tmp_path / "key.json"
    bench = [sys.executable, "scripts/bench_lora_host.py", "--calls", "3", "--repeats", "2"]
    subprocess.run([*bench, "--plan-key", "--json", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(row["route"], row["slices"]) for row in rows] == [
        ("plan-key", s) for s in (1, 2, 3, 4)
    ]
    for row in rows:
        assert len(row["runs_us"]) == 2 and row["aten_ops"] == 0, row


PLANS_MADE = """
import sys, torch
sys.path.insert(0, "scripts")
import bench_lora_host as bench
module = bench.load_module()
module.ACTIVE_MIN_WORK = 0
module.SPLIT_K_MAX_TOKENS = bench.SPLIT_K_MAX_TOKENS
made = []
init = module.LayerPlan.__init__
module.LayerPlan.__init__ = lambda plan, *a: made.append(1) or init(plan, *a)
op = torch.ops.patchkit_lora.add_lora_linear.default
for route, (tokens, used) in bench.ROUTES.items():
    for slices in (bench.SLICES if route in ("gemm", "narrow") else (1,) * (route == "split")):
        arguments = bench.op_arguments(module, "cpu", slices, tokens, used)
        made.clear()
        with torch.no_grad():
            for _ in range(20):
                op(*arguments)
        print(route, slices, len(made))
"""


@pytest.mark.slow
def test_each_route_makes_its_layer_plan_once():
    """What the bench times is a call with the layer's plan made: a plan made again on
    every call (a key that never matches) would be host work the rows hide. Through the
    op, as vLLM's graph calls it, 20 calls of each CPU route make one plan."""
    done = subprocess.run(
        [sys.executable, "-c", PLANS_MADE], cwd=REPO, check=True, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    counts = [line.split() for line in done.stdout.splitlines()]
    assert len(counts) == 9, done.stdout  # gemm and narrow 1-4 slices, split
    assert all(made == "1" for _, _, made in counts), done.stdout
