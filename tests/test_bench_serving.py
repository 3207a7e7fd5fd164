"""scripts/bench_serving.py's tables, from results as its engines answer them (no GPU):
the per-round ratios and the GPU memory line that backs the memory claim in the ledger."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO


def bench():
    path = REPO / "scripts" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module
    spec.loader.exec_module(module)
    return module


def row(config, round_, tok_s, peak=None):
    found = {"config": config, "leg": 0, "workload": "decode_b1_lora", "round": round_,
             "seconds": 1.0, "tok_s": tok_s, "generated": 256}  # fmt: skip
    if peak is not None:
        found |= {"gpu_peak_bytes": peak, "gpu_reserved_bytes": peak + 2**30}
    return found


def test_the_memory_line_names_each_engines_largest_peak():
    lines = bench().memory_lines(
        [row("unpatched", 0, 100, 10 * 2**30), row("unpatched", 1, 100, 11 * 2**30),
         row("default", 1, 103, 12 * 2**30)],
        ["unpatched", "default"],
    )  # fmt: skip
    assert lines[-1].endswith("unpatched 11.00 (reserved 12.00); default 12.00 (reserved 13.00).")


def test_no_memory_line_when_no_engine_told_its_peak():
    assert bench().memory_lines([row("unpatched", 1, 100)], ["unpatched"]) == []


def test_the_table_gives_the_median_of_per_round_ratios():
    rows = [row("unpatched", r, 100) for r in (1, 2, 3)]
    rows += [row("default", 1, 97), row("default", 2, 103), row("default", 3, 110)]
    meta = {"date": "d", "gpu": "g", "vllm": "v", "torch": "t", "rounds": 3}
    text = bench().table({"configs": {"unpatched": {}, "default": {}}, "rounds": rows}, meta)
    assert "| decode_b1_lora | 100 | 103 (103.0 %, q1 100.0 %, 97-110) |" in text
