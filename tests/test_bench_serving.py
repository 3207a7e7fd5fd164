"""scripts/bench_serving.py's tables, from results as its engines answer them (no GPU):
the per-round ratios and the GPU memory line that backs the memory claim in the ledger."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import sys
import time

import pytest

from tests.conftest import REPO
from tests.helpers import wait_for_exit


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


def test_the_start_memory_line_tells_the_engines_init_from_its_adapters_load():
    def told(allocated, peak):
        return {"gpu_allocated_bytes": allocated * 2**30, "gpu_peak_bytes": peak * 2**30}

    start = {"unpatched": {"engine": told(30, 33), "adapters": told(30.5, 33)},
             "default": {"engine": told(30, 33.25), "adapters": {}}}  # fmt: skip
    lines = bench().start_memory_lines(start, ["unpatched", "default", "twin"])
    assert lines[-1].endswith(
        "unpatched after init 30.00 (peak 33.00), after the adapters 30.50 (peak 33.00); "
        "default after init 30.00 (peak 33.25)."
    )
    assert bench().start_memory_lines({}, ["unpatched"]) == []


def test_no_memory_line_when_no_engine_told_its_peak():
    assert bench().memory_lines([row("unpatched", 1, 100)], ["unpatched"]) == []


def test_the_table_gives_the_median_of_per_round_ratios():
    rows = [row("unpatched", r, 100) for r in (1, 2, 3)]
    rows += [row("default", 1, 97), row("default", 2, 103), row("default", 3, 110)]
    meta = {"date": "d", "gpu": "g", "vllm": "v", "torch": "t", "rounds": 3}
    text = bench().table({"configs": {"unpatched": {}, "default": {}}, "rounds": rows}, meta)
    assert "| decode_b1_lora | 100 | 103 (103.0 %, q1 100.0 %, 97-110) | 3 |" in text


def test_table_reads_a_run_that_ended_before_its_report(tmp_path, capsys, monkeypatch):
    """A sitting packed while the rounds ran: results.json has the rounds but no meta.
    `table` prints them, the build from bench.json beside them, the rest said unknown."""
    rows = [{**row(c, r, t), "wall": 1796628364.7} for r in (0, 1, 2) for c, t in
            (("default", 100), ("default+nan-probe", 95))]  # fmt: skip
    results = {"configs": {"default": {}, "default+nan-probe": {}}, "rounds": rows,
               "base": "default"}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(results))
    (tmp_path / "bench.json").write_text(json.dumps({"model": "dense27b", "adapters": 4,
                                                     "rank": 64, "layers": 8}))  # fmt: skip
    module = bench()
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "table", str(tmp_path / "results.json")])
    assert module.main() == 0
    text = capsys.readouterr().out
    assert text.startswith("2026-12-07, GPU unknown (the run ended before its report), vLLM ")
    assert "dense27b, 4 adapters of rank 64, 8 layers" in text
    assert "| decode_b1_lora | 100 | 95 (95.0 %, q1 95.0 %, 95-95) | 2 |" in text


def test_the_table_names_the_reload_unit_only_where_it_measured_reloads():
    meta = {"date": "d", "gpu": "g", "vllm": "v", "torch": "t", "rounds": 3}
    rows = [row(c, r, 100) for r in (1, 2, 3) for c in ("unpatched", "default")]
    configs = {"unpatched": {}, "default": {}}
    plain = bench().table({"configs": configs, "rounds": rows}, meta)
    reloads = [r | {"workload": "reload_lora"} for r in rows]
    both = bench().table({"configs": configs, "rounds": rows + reloads}, meta)
    assert "adapters reloaded a minute" not in plain
    assert "prefill: prompt tokens; reload_lora: adapters reloaded a minute)" in both
    assert "| reload_lora | 100 | 100 (100.0 %" in both


class Engines:
    """Engines that answer at once, and remember what they were asked (no GPU)."""

    def __init__(self, names):
        self.asked = []
        self.engines = {name: self.Engine(self, name) for name in names}

    class Engine:
        def __init__(self, outer, name):
            self.outer, self.name = outer, name

        def ask(self, workload, round_, deadline, min_seconds=0.0):
            self.outer.asked.append((self.name, workload, round_))
            self.outer.leg_seconds = min_seconds
            return {"workload": workload, "round": round_, "seconds": 1.0, "tok_s": 100.0}


def test_a_round_that_cannot_fit_after_the_warm_up_is_not_begun(tmp_path, monkeypatch):
    """A new workload's warm-up round says how long its rounds take at least: the
    first counted round is not begun when it cannot end by the deadline (a round
    that times out leaves its legs running in the engines)."""
    module = bench()
    fake = Engines(["unpatched", "default"])
    clock = [0.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    asked = fake.Engine.ask

    def slow(self, workload, round_, deadline, min_seconds=0.0):
        clock[0] += 10.0  # each leg: 10 s
        return asked(self, workload, round_, deadline, min_seconds)

    monkeypatch.setattr(fake.Engine, "ask", slow)
    results = {"rounds": [row("default", 3, 100.0)], "errors": {},
               "workloads": ["reload_lora"]}  # fmt: skip
    module.measure(tmp_path, results, fake.engines, 99, deadline=80.0)
    assert {r for _, _, r in fake.asked} == {0}  # 40 s of warm-up; a round needs 48 more
    module.measure(tmp_path, results, fake.engines, 99, deadline=clock[0] + 200.0)
    assert {r for _, _, r in fake.asked} == {0, 4, 5, 6, 7}


def test_more_with_other_workloads_warms_them_up_first_uncounted(tmp_path):
    module = bench()
    fake = Engines(["unpatched", "default"])
    results = {"rounds": [], "errors": {}, "workloads": module.pick_workloads(["decode_b1"])}
    module.measure(tmp_path, results, fake.engines, 2, deadline=float("inf"))
    assert {r for _, _, r in fake.asked} == {0, 1, 2}
    fake.asked.clear()
    results["workloads"] = module.pick_workloads(["prefill"])
    module.measure(tmp_path, results, fake.engines, 4, deadline=float("inf"))
    warm = [(w, r) for _, w, r in fake.asked if r == 0]
    assert warm == [("prefill_lora", 0)] * 4 + [("prefill_base", 0)] * 4
    assert {(w, r) for _, w, r in fake.asked if r} == {
        (w, r) for w in ("prefill_lora", "prefill_base") for r in (3, 4)
    }
    meta = {"date": "d", "gpu": "g", "vllm": "v", "torch": "t"}
    text = module.table({"configs": {"unpatched": {}, "default": {}}, **results}, meta)
    assert "| decode_b1_lora | 100 | 100 (100.0 %, q1 100.0 %, 100-100) | 2 |" in text
    assert "| prefill_lora | 100 | 100 (100.0 %, q1 100.0 %, 100-100) | 2 |" in text


def test_a_round_that_failed_is_dropped_with_its_error(tmp_path):
    module = bench()
    fake = Engines(["unpatched", "default"])

    def broken(workload, round_, deadline, min_seconds=0.0):
        if round_ == 2:
            raise TimeoutError("no answer")
        return {"workload": workload, "round": round_, "seconds": 1.0, "tok_s": 100.0}

    fake.engines["default"].ask = broken
    results = {"rounds": [], "errors": {}, "workloads": ["decode_b1_lora"]}
    module.measure(tmp_path, results, fake.engines, 5, deadline=float("inf"))
    assert sorted({r["round"] for r in results["rounds"]}) == [0, 1]
    assert results["errors"]["run"] == "round 2: no answer"


def test_a_build_links_the_model_of_an_earlier_build_of_the_same_model(tmp_path):
    module = bench()
    earlier = tmp_path / "earlier"
    (earlier / "model").mkdir(parents=True)
    (earlier / "model" / "model.safetensors").write_bytes(b"weights")
    (earlier / "bench.json").write_text('{"model": "moe35b", "adapters": 8, "rank": 16}')
    module.link_model(earlier, tmp_path / "new", "moe35b")
    linked = tmp_path / "new" / "model" / "model.safetensors"
    assert linked.stat().st_ino == (earlier / "model" / "model.safetensors").stat().st_ino
    with pytest.raises(SystemExit, match="a build of moe35b with 8 layers, not dense27b with 8"):
        module.link_model(earlier, tmp_path / "other", "dense27b")
    with pytest.raises(SystemExit, match="moe35b with 8 layers, not moe35b with 32"):
        module.link_model(earlier, tmp_path / "deeper", "moe35b", layers=32)
    assert not (tmp_path / "other").exists() and not (tmp_path / "deeper").exists()


@pytest.mark.slow
def test_adapters_are_saved_in_the_models_dtype_not_peft_float32(tmp_path):
    """vLLM casts every adapter tensor to its bf16 LoRA dtype on the CPU as it loads;
    float32 files doubled the bytes and kept the host's CPUs busy for minutes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from safetensors import safe_open

    built = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(torch.bfloat16)
    adapter = bench().adapter_model(built, 8, ["0"])
    adapter.save_pretrained(tmp_path)
    with safe_open(tmp_path / "adapter_model.safetensors", "pt") as saved:
        dtypes = {saved.get_tensor(key).dtype for key in saved.keys()}
    assert dtypes == {torch.bfloat16}


def test_start_records_the_engine_apart_from_the_adapters_first_load(tmp_path, monkeypatch):
    """start_s is the whole wait for an engine; engine_s the part before its adapters load,
    so a slow start says whether the engine or the adapters took the time."""
    module = bench()
    memory = {"engine": {"gpu_allocated_bytes": 1}, "adapters": {"gpu_allocated_bytes": 2}}
    answers = {"unpatched": {"ready": True, "start_s": 471.0, "engine_s": 266.0,
                             "memory": memory},
               "default": TimeoutError("engine default: not ready in time")}  # fmt: skip

    class Standin:
        def __init__(self, name):
            self.name, self.pid = name, 1

        def wait_for(self, match, deadline):
            found = answers[self.name]
            if isinstance(found, Exception):
                raise found
            assert match(found)
            return found

    monkeypatch.setattr(module, "make_sites", lambda *a: {n: {} for n in answers})
    monkeypatch.setattr(module.Engine, "start", staticmethod(lambda name, *a: Standin(name)))
    monkeypatch.setattr(module, "save_partial", lambda *a: None)
    results = module.start(tmp_path, tmp_path, ["default"], deadline=1.0)
    assert results["start_s"] == {"unpatched": 471.0}
    assert results["engine_s"] == {"unpatched": 266.0}
    assert results["start_memory"] == {"unpatched": memory}
    assert results["errors"] == {"default": "engine default: not ready in time"}


def test_a_deeper_cut_repeats_three_gdn_layers_and_one_attention_layer():
    module = bench()
    text = module.widths("dense27b", 32)
    assert text["num_hidden_layers"] == 32 == len(text["layer_types"])
    assert text["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["layer_types"].count("full_attention") == 8
    assert text["hidden_size"] == module.WIDTHS["hidden_size"]
    moe = module.widths("moe35b", 16)
    assert moe["num_experts"] == 256 and moe["num_hidden_layers"] == 16
    assert module.widths("moe35b") == dict(module.MOE_WIDTHS)
    for bad in (0, 6, -4):
        with pytest.raises(SystemExit, match=f"--layers {bad}: a positive multiple of 4"):
            module.widths("dense27b", bad)


@pytest.mark.slow
def test_a_same_tree_configuration_can_be_the_base(slim_tree_0260, tmp_path):
    """--configs default --base default-gemv: the route on against the route off, both
    served from one patched tree, the base with its variable set."""
    sites = bench().make_sites(slim_tree_0260, tmp_path / "work", ["default"], "default-gemv")
    assert set(sites) == {"default", "default-gemv"}
    assert sites["default-gemv"]["env"] == {"PATCHKIT_LORA_GEMV": "0"}
    assert sites["default-gemv"]["site"] == sites["default"]["site"]
    assert "matmul-add-lora-linear" in sites["default"]["patches"]
    sites = bench().make_sites(slim_tree_0260, tmp_path / "work2", ["default"], "default-active")
    assert sites["default-active"]["env"] == {"PATCHKIT_LORA_ACTIVE_ONLY": "0"}
    assert sites["default-active"]["site"] == sites["default"]["site"]


def test_an_unpatched_twin_is_a_second_engine_on_the_unpatched_tree(slim_tree_0260, tmp_path):
    """--configs default unpatched-twin: the twin serves the unpatched tree, as its own
    configuration (its own engine and compile cache), so identical code is measured
    in the same rounds."""
    sites = bench().make_sites(slim_tree_0260, tmp_path / "work", ["default", "unpatched-twin"])
    assert set(sites) == {"unpatched", "default", "unpatched-twin"}
    assert sites["unpatched-twin"] == sites["unpatched"]
    assert sites["unpatched-twin"]["patches"] == [] and sites["unpatched-twin"]["env"] == {}


def trace(path, events):
    """A trace as vLLM's torch profiler writes it (Chrome trace JSON, gzip)."""
    with gzip.open(path, "wt") as out:
        json.dump({"traceEvents": events}, out)
    return path


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_a_trace_summary_counts_overlapping_kernels_once_per_step(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import kernel_trace

    events = [
        kernel("nvjet_gemm", 0, 10),
        kernel("_gemv_shrink_kernel", 5, 10),  # overlaps the GEMM: busy 0-15
        kernel("_fused_moe_lora_kernel", 20, 4),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
        kernel("nvjet_gemm", 30, 10),
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 50, "dur": 2},
    ]
    found = kernel_trace.summary([trace(tmp_path / "w.pt.trace.json.gz", events)], steps=2)
    assert found["gpu_busy_us"] == (15 + 4 + 10 + 2) / 2
    assert found["window_us"] == 52 / 2
    assert found["kernels"] == 5 / 2
    assert (found["lora_us"], found["lora_kernels"]) == ((10 + 4) / 2, 1.0)
    assert found["top"][0] == ["nvjet_gemm", 1.0, 10.0]


def test_profile_asks_each_engine_under_the_profiler_and_tables_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    module = bench()
    fake = Engines(["unpatched", "default"])
    durations = {"unpatched": 30, "default": 20}

    def profiled(name):
        def ask(workload, round_, deadline, profile=False, min_seconds=0.0):
            assert profile and round_ == 1 and min_seconds == 0.0
            path = tmp_path / f"{name}-{workload}.pt.trace.json.gz"
            trace(path, [kernel(f"_lora_{name}", 0, durations[name] * 256)])
            return {"workload": workload, "round": 1, "seconds": 0.512, "traces": [str(path)]}

        return ask

    for name, engine in fake.engines.items():
        engine.ask = profiled(name)
    results = {"configs": {"unpatched": {}, "default": {}}, "rounds": [], "errors": {},
               "workloads": ["prefill_lora", "prefill_base"]}  # fmt: skip
    args = argparse.Namespace(dir=tmp_path, workloads=["decode_b1"], keep=True, markdown=None)
    module.profile_step(args, results, fake.engines, deadline=float("inf"))
    assert results["workloads"] == ["prefill_lora", "prefill_base"]  # the rounds' own, kept
    assert set(results["profiles"]["default"]) == {"decode_b1_lora", "decode_b1_base"}
    assert results["profiles"]["default"]["decode_b1_lora"]["lora_us"] == 20
    text = module.profile_table(results)
    assert "| decode_b1_lora | unpatched | 2000 | 30 | 0 | 30 (0) |" in text
    assert "| decode_b1_lora | default | 2000 | 20 | 0 | 20 (0) |" in text
    assert "Top kernels, decode_b1_lora, default" in text


def test_a_reload_is_profiled_over_several_reloads_and_tabled_per_reload(tmp_path, monkeypatch):
    """reload_lora under the profiler reloads for PROFILED_RELOAD_S, and its numbers are
    per reload (calls), not per decode step: where an adapter load's time goes."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    module = bench()
    fake = Engines(["unpatched", "default"])
    asked = []

    def profiled(name):
        def ask(workload, round_, deadline, profile=False, min_seconds=0.0):
            asked.append((name, workload, min_seconds))
            path = tmp_path / f"{name}.pt.trace.json.gz"
            events = [kernel("isfinite", 0, 8)]
            events += [{"ph": "X", "cat": "cpu_op", "name": "aten::isfinite", "ts": 10 + n,
                        "dur": 1} for n in range(8 if name == "default" else 0)]  # fmt: skip
            trace(path, events)
            return {"workload": workload, "round": 1, "seconds": 2.0, "calls": 4,
                    "traces": [str(path)]}  # fmt: skip

        return ask

    for name, engine in fake.engines.items():
        engine.ask = profiled(name)
    results = {"configs": {"unpatched": {}, "default": {}}, "base": "unpatched", "rounds": [],
               "errors": {}, "workloads": ["reload_lora"]}  # fmt: skip
    args = argparse.Namespace(dir=tmp_path, workloads=["reload"], keep=True, markdown=None)
    module.profile_step(args, results, fake.engines, deadline=float("inf"))
    assert asked == [("unpatched", "reload_lora", module.PROFILED_RELOAD_S),
                     ("default", "reload_lora", module.PROFILED_RELOAD_S)]  # fmt: skip
    row = results["profiles"]["default"]["reload_lora"]
    assert row["steps"] == 4 and row["gpu_busy_us"] == 2.0
    text = module.profile_table(results)
    assert "| reload_lora | default | 500000 | 2 | 0 | 0 (0) | 2.0 | 0.0 |" in text
    # 2.0 is 8 aten ops over 4 reloads, a count: the header must not call it microseconds
    # (the 2026-12-02f entry was first written reading it as time)
    assert "kernels, host aten ops and host CUDA calls counted" in text
    assert "| `aten::isfinite` | 0.0 | 2.0 | 0.0 | 2.0 | +2.0 |" in text


def test_a_profile_table_names_what_differs_from_the_base_kernels_and_host_ops(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    module = bench()
    import kernel_trace

    def profiled(extra_kernel_us, host_ops):
        events = [kernel("nvjet_gemm", 0, 20), kernel("_gemv_shrink_kernel", 30, extra_kernel_us)]
        events += [{"ph": "X", "cat": "cpu_op", "name": "aten::eq", "ts": 100 + n, "dur": 1}
                   for n in range(host_ops)]  # fmt: skip
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0,
                       "dur": 5})  # fmt: skip
        path = tmp_path / f"t{extra_kernel_us}-{host_ops}.pt.trace.json.gz"
        return {"seconds": 0.002, **kernel_trace.summary([trace(path, events)], steps=2)}

    results = {"configs": {"unpatched": {}, "default": {}}, "base": "unpatched",
               "profiles": {"unpatched": {"decode_b4_lora": profiled(2, 0)},
                            "default": {"decode_b4_lora": profiled(10, 6)}}}  # fmt: skip
    host = results["profiles"]["default"]["decode_b4_lora"]["host"]
    assert host["cpu_op"]["events"] == 3 and host["cuda_runtime"]["events"] == 0.5
    text = module.profile_table(results)
    assert "| decode_b4_lora | default | 1000 | 15 | 1 | 5 (0) | 3.0 | 0.5 |" in text
    assert "Kernels, decode_b4_lora, default against unpatched" in text
    assert "| `_gemv_shrink_kernel` | 0.5 | 0.5 | 1.0 | 5.0 | +4.0 |" in text
    assert "| `aten::eq` | 0.0 | 3.0 | 0.0 | 3.0 | +3.0 |" in text


def test_the_spread_table_gives_geometric_mean_rounds_below_and_an_interval():
    module = bench()
    ratios = {1: 0.9, 2: 1.1, 3: 1.0, 4: 1.2}
    counted = [row("unpatched", n, 100.0) for n in ratios]
    counted += [row("default", n, 100.0 * r) for n, r in ratios.items()]
    lines = module.spread_table(counted, ["unpatched", "default"], "unpatched",
                                ["decode_b1_lora"])  # fmt: skip
    geometric = 100 * (0.9 * 1.1 * 1.0 * 1.2) ** 0.25
    low, high = module.bootstrap_median(list(ratios.values()))
    assert 0.9 <= low <= 1.05 <= high <= 1.2
    assert lines[-1] == (f"| decode_b1_lora | {geometric:.1f} %; 1 of 4; "
                         f"{100 * low:.1f}-{100 * high:.1f} % |")  # fmt: skip
    assert module.bootstrap_median([1.0, 2.0, 3.0]) == module.bootstrap_median([1.0, 2.0, 3.0])


class Clock:
    """perf_counter for run_workload: each generate call takes `per_call` seconds."""

    def __init__(self, per_call):
        self.now, self.per_call = 0.0, per_call

    def perf_counter(self):
        return self.now


class LLM:
    def __init__(self, clock):
        self.clock, self.calls = clock, 0

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        self.calls += 1
        self.clock.now += self.clock.per_call
        tokens = type("Out", (), {"token_ids": [0] * params["max_tokens"]})
        return [type("Result", (), {"outputs": [tokens]}) for _ in prompts]


def test_a_leg_repeats_its_requests_until_it_has_lasted_its_seconds(monkeypatch):
    module = bench()
    clock = Clock(per_call=0.7)
    monkeypatch.setattr(module.time, "perf_counter", clock.perf_counter)
    llm = LLM(clock)
    leg = module.run_workload(llm, dict, ["a0", "a1"], "decode_b4_lora", 3, min_seconds=2.0)
    assert (llm.calls, leg["calls"], leg["generated"]) == (3, 3, 3 * 4 * 256)
    assert leg["tok_s"] == pytest.approx(3 * 4 * 256 / (3 * 0.7))
    warm = module.run_workload(llm, dict, ["a0"], "decode_b4_lora", 0, min_seconds=2.0)
    assert warm["calls"] == 1  # the warm-up runs once
    prefill = module.run_workload(llm, dict, ["a0"], "prefill_lora", 1, min_seconds=1.0)
    assert prefill["tok_s"] == pytest.approx(2 * 16 * 4096 / (2 * 0.7))


def test_the_leg_seconds_reach_every_engine_in_every_round(tmp_path):
    module = bench()
    fake = Engines(["unpatched", "default"])
    results = {"rounds": [], "errors": {}, "workloads": ["decode_b1_lora"], "leg_seconds": 2.5}
    module.measure(tmp_path, results, fake.engines, 1, deadline=float("inf"))
    assert fake.leg_seconds == 2.5


def test_bench_cpus_split_into_equal_runs_one_an_engine():
    module = bench()
    assert module.cpu_shares("0-8", 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert module.cpu_shares("0,2,4-7", 2) == [[0, 2, 4], [5, 6, 7]]
    assert module.cpu_shares(" ", 3) == []
    for spec, message in (("0-a", "not a CPU list"), ("0-1", "2 CPUs for 3 engines")):
        with pytest.raises(SystemExit, match=message):
            module.cpu_shares(spec, 3)


def test_an_engine_with_cpus_runs_on_those_alone(tmp_path, monkeypatch):
    """The worker starts on its CPUs (vLLM's engine core, its child, inherits them):
    here a stand-in interpreter writes the CPUs it was given."""
    module = bench()
    seen = tmp_path / "seen.txt"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ngrep Cpus_allowed_list /proc/self/status > {seen}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(module.sys, "executable", str(fake))
    config = {"site": str(tmp_path), "env": {}, "cpus": [0]}
    engine = module.Engine.start("default", config, tmp_path / "work", "")
    wait_for_exit(engine.pid)  # the stand-in writes, then ends
    assert seen.read_text().split() == ["Cpus_allowed_list:", "0"]


def timed(config, workload, round_, wall, tok_s, seconds=2.0):
    return {**row(config, round_, tok_s), "workload": workload, "wall": wall,
            "seconds": seconds}  # fmt: skip


def test_leg_noise_is_robust_and_splits_off_what_the_next_leg_shares():
    module = bench()
    # each round on a level of its own, which both its legs share, and one outlier leg
    speeds = {(1, 0): 100, (1, 1): 101, (2, 0): 80, (2, 1): 81, (3, 0): 120, (3, 1): 119,
              (4, 0): 20, (4, 1): 90, (5, 0): 110, (5, 1): 111, (6, 0): 95, (6, 1): 96}  # fmt: skip
    legs = [timed("default", "decode_b1_base", r, 10 * r + leg, v)
            for (r, leg), v in speeds.items()]  # fmt: skip
    spread, apart = module.leg_noise(legs, "decode_b1_base", "default")
    assert 0.08 < spread < 0.2  # the levels; the outlier moves a robust spread little
    assert apart < 0.02
    assert module.leg_noise(legs[:2], "decode_b1_base", "default") is None
    lines = module.noise_table(legs, ["default"], ["decode_b1_base", "prefill_base"])
    assert lines[-2] == f"| decode_b1_base | {100 * spread:.1f} / {100 * apart:.1f} |"
    assert lines[-1] == "| prefill_base | n/a |"


def test_the_clock_table_reads_the_gpu_clock_inside_each_workloads_legs(tmp_path):
    module = bench()
    log = tmp_path / "clocks.log"
    log.write_text(
        "# timestamp,clocks.sm,clocks.mem,power.draw,pstate,temperature.gpu,"
        "utilization.gpu,clocks_event_reasons.active\n"
        "2026/12/02 00:00:00.000, 1980 MHz, 3201 MHz, 300.00 W, P0, 40, 90 %, 0x0000000000000000\n"
        "2026/12/02 00:00:01.000, 1980 MHz, 3201 MHz, 310.00 W, P0, 40, 90 %, 0x0000000000000000\n"
        "2026/12/02 00:00:05.000, 1545 MHz, 3201 MHz, 700.00 W, P0, 50, 100 %, 0x0000000000000004\n"
        "2026/12/02 00:00:09.000, 345 MHz, 3201 MHz, 100.00 W, P0, 40, 0 %, 0x0000000000000001\n"
    )
    samples = module.clock_samples(log)
    start = samples[0][0]
    assert [s[1:] for s in samples] == [(1980, 0), (1980, 0), (1545, 4), (345, 1)]
    legs = [timed("default", "decode_b1_base", 1, start - 0.5, 400),
            timed("default", "prefill_base", 1, start + 4.5, 9e4, seconds=1.0)]  # fmt: skip
    lines = module.clock_table(legs, samples, ["decode_b1_base", "prefill_base", "decode_b4_base"])
    assert lines[-3:] == ["| decode_b1_base | 2 | 1980 (1980) | 0 |",
                          "| prefill_base | 1 | 1545 (1545) | 1 (0x4) |",
                          "| decode_b4_base | 0 | n/a | n/a |"]  # fmt: skip


def test_linked_adapters_are_folders_of_hard_links_to_the_first(tmp_path):
    module = bench()
    first = tmp_path / "adapter-0"
    first.mkdir()
    (first / "adapter_config.json").write_text("{}")
    (first / "adapter_model.safetensors").write_bytes(b"factors")
    module.link_files(first, tmp_path / "adapter-1")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        linked = tmp_path / "adapter-1" / name
        assert linked.stat().st_ino == (first / name).stat().st_ino
    with pytest.raises(FileExistsError):  # never over an adapter already there
        module.link_files(first, tmp_path / "adapter-1")


def test_stop_tells_every_kept_engine_to_exit_and_leaves_the_results_alone(tmp_path, monkeypatch):
    """`stop DIR` (the sets a sitting does not profile): each live engine's mailbox gets
    {"stop": true}; results.json keeps its bytes (no report with this command's meta)."""
    import subprocess
    import threading

    module = bench()
    standin = subprocess.Popen(["sleep", "30"])  # alive, as an engine is
    try:
        mailbox = module.Mailbox(tmp_path, "default")
        mailbox.create()
        got = []
        reader = threading.Thread(target=lambda: got.append(next(mailbox.commands())))
        reader.start()
        results = tmp_path / "results.json"
        results.write_text(json.dumps({"pids": {"default": standin.pid}, "errors": {}}))
        before = results.read_bytes()
        monkeypatch.setattr(sys, "argv", ["bench_serving.py", "stop", str(tmp_path)])
        assert module.main() == 0
        reader.join(timeout=10)
        assert got == [{"stop": True}]
        assert results.read_bytes() == before
    finally:
        standin.kill()
        standin.wait()


def test_the_verdict_holds_lora_workloads_to_median_and_q1_and_base_to_three_percent():
    module = bench()
    assert module.verdict_cell([1.05] * 5, "lora").startswith("met (105.0 %, q1 105.0 %")
    assert module.verdict_cell([0.99, 1.0, 1.0, 1.01, 1.02], "lora").startswith("met")
    assert module.verdict_cell([0.9, 0.95, 1.02, 1.05, 1.1], "lora").startswith("missed: q1 ")
    low = module.verdict_cell([0.9, 0.95, 0.98, 0.99, 1.2], "lora")
    assert low.startswith("missed: median, q1")
    assert module.verdict_cell([1.04] * 5, "base").startswith("missed: +-3 %")
    assert module.verdict_cell([0.8, 1.0, 1.0, 1.01, 1.2], "base").startswith("met")
    assert module.verdict_cell([2.0] * 4, "lora") == "undecided (4 rounds)"
    assert module.verdict_cell([2.0], "base") == "undecided (1 round)"


def test_the_control_holds_identical_code_to_three_percent_and_q1():
    """The twin's median may fall either side of 100 %; what it must show is that the
    rounds resolve the bounds: within +-3 % and a lower quartile >= 97 %."""
    module = bench()
    assert module.verdict_cell([0.99, 0.99, 0.995, 1.0, 1.01], "control").startswith("met")
    wide = module.verdict_cell([0.9, 0.95, 1.0, 1.05, 1.1], "control")
    assert wide.startswith("missed: q1 (100.0 %, q1 95.0 %")
    assert module.verdict_cell([1.05] * 5, "control").startswith("missed: +-3 % (")
    assert module.verdict_cell([0.9] * 5, "control").startswith("missed: +-3 %, q1")
    assert module.verdict_rule("unpatched-twin", "decode_b1_lora") == "control"
    assert module.verdict_rule("default", "decode_b1_lora") == "lora"
    assert module.verdict_rule("default", "prefill_base") == "base"


def test_the_verdict_table_judges_every_configuration_but_the_base():
    module = bench()
    rounds = [row(c, n, v) for n in range(1, 6) for c, v in
              (("unpatched", 100.0), ("default", 104.0), ("unpatched-twin", 99.0))]  # fmt: skip
    results = {"rounds": rounds, "configs": ["unpatched", "default", "unpatched-twin"],
               "meta": {"model": "moe35b", "adapters": 2, "rank": 128, "layers": 32}}  # fmt: skip
    lines = module.verdict_table([results])
    name = "| moe35b 2 x r128, 32 layers | decode_b1_lora"
    assert lines[2:5] == [
        f"{name} | default | met (104.0 %, q1 104.0 %, 5 rounds) |",
        f"{name} | unpatched-twin | met (99.0 %, q1 99.0 %, 5 rounds) |",
        "",
    ]


def test_the_verdict_counts_met_cells_by_set_configuration_and_kind():
    """What a write-up says ("meets 9 of its 14 decided LoRA cells") comes from here."""
    module = bench()

    def rows(workload, rounds, default):
        return [row(c, n, v) | {"workload": workload} for n in range(1, rounds + 1)
                for c, v in (("unpatched", 100.0), ("default", default))]  # fmt: skip

    results = {"configs": ["unpatched", "default"], "meta": {"layers": 32},
               "rounds": rows("decode_b1_lora", 5, 104.0) + rows("decode_b4_lora", 5, 96.0)
               + rows("decode_b1_base", 5, 110.0) + rows("prefill_lora", 2, 120.0)}  # fmt: skip
    results["rounds"] += rows("reload_lora", 5, 50.0)  # not the criterion's: not judged
    lines = module.verdict_table([results])
    assert lines[-1] == "| dense27b 4 x r64, 32 layers | default | 1 of 2 | 0 of 1 | 1 |"
    assert not [line for line in lines if "reload_lora" in line]
    assert lines[-3].startswith("| set | configuration | LoRA workloads met |")


def test_a_built_model_is_saved_in_files_no_larger_than_the_shard(tmp_path):
    """A GPU-built model passes through the host's RAM one safetensors file at a time,
    so the files are bounded; vLLM finds every tensor through the index."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors import safe_open
    from transformers import Qwen3_5ForConditionalGeneration

    from patchkit.verify import e2e

    built = Qwen3_5ForConditionalGeneration(e2e.qwen35_config()).to(torch.bfloat16)
    bench().save_model(built, tmp_path / "model", shard="20MB")
    files = sorted((tmp_path / "model").glob("*.safetensors"))
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    assert len(files) > 1 and all(f.stat().st_size <= 20 * 10**6 for f in files)
    where, saved_numel = {}, 0
    for path in files:
        with safe_open(path, "pt") as saved:
            for key in saved.keys():
                where[key] = path.name
                saved_numel += math.prod(saved.get_slice(key).get_shape())
    assert where == index["weight_map"]
    assert saved_numel == sum(p.numel() for p in built.parameters())


class ReloadingEngine:
    """vLLM's LLMEngine as reload_lora uses it: remove_lora, then add_lora."""

    def __init__(self, fails: set[int] = frozenset()):
        self.calls, self.fails = [], fails

    def remove_lora(self, lora_id):
        self.calls.append(("remove", lora_id))
        return True

    def add_lora(self, request):
        self.calls.append(("add", request.lora_int_id))
        return request.lora_int_id not in self.fails


def lora_requests(count):
    return [argparse.Namespace(lora_name=f"a{n}", lora_int_id=n + 1) for n in range(count)]


def test_a_reload_leg_removes_and_adds_the_adapters_in_turn_and_counts_a_minute():
    module = bench()
    llm = argparse.Namespace(llm_engine=ReloadingEngine())
    leg = module.reload_leg(llm, lora_requests(3), "reload_lora", 2, min_seconds=0.05)
    ids = [lora_id for _, lora_id in llm.llm_engine.calls]
    assert ids[:8] == [3, 3, 1, 1, 2, 2, 3, 3]  # round 2 starts at its own adapter
    assert [what for what, _ in llm.llm_engine.calls[:2]] == ["remove", "add"]
    assert leg["calls"] == len(ids) // 2 and leg["seconds"] >= 0.05
    assert leg["tok_s"] == pytest.approx(60 * leg["calls"] / leg["seconds"])
    warm = module.reload_leg(argparse.Namespace(llm_engine=ReloadingEngine()),
                             lora_requests(3), "reload_lora", 0, min_seconds=9.0)  # fmt: skip
    assert warm["calls"] == 1


def test_a_profiled_reload_reloads_for_the_seconds_it_is_asked_and_returns_the_new_traces(
    tmp_path,
):
    """The engine's side of profile's reload: the leg's min_seconds reach reload_leg (one
    reload alone would be a sample of one), between start_profile and stop_profile."""
    module = bench()
    folder = module.profile_dir(tmp_path, "default")  # where this engine's traces go
    folder.mkdir(parents=True)
    (folder / "old.pt.trace.json.gz").write_text("")
    said = []

    class Profiling(argparse.Namespace):
        def start_profile(self):
            said.append("start")

        def stop_profile(self):
            said.append("stop")
            (folder / "new.pt.trace.json.gz").write_text("")

    llm = Profiling(llm_engine=ReloadingEngine())
    command = {"workload": "reload_lora", "round": 1, "min_seconds": 0.05, "profile": True}
    answer = module.run_command(llm, None, lora_requests(2), command, tmp_path, "default")
    assert said == ["start", "stop"]
    assert answer["calls"] > 1 and answer["seconds"] >= 0.05
    assert answer["traces"] == [str(folder / "new.pt.trace.json.gz")]


class TimedManager:
    """vLLM's LRUCacheWorkerLoRAManager as time_adapter_loads sees it: add_adapter reads
    the files (_load_adapter) only for an adapter it does not hold."""

    def __init__(self):
        self.held = set()

    def _load_adapter(self, request):
        time.sleep(0.002)
        return request

    def add_adapter(self, request):
        if request.lora_int_id in self.held:
            return False
        self._load_adapter(request)
        time.sleep(0.003)  # the activation
        self.held.add(request.lora_int_id)
        return True


def test_the_worker_times_each_load_and_the_files_within_it_once_installed():
    module = bench()
    worker = argparse.Namespace(model_runner=argparse.Namespace(lora_manager=TimedManager()))
    assert module.time_adapter_loads(worker) and module.time_adapter_loads(worker)  # once
    manager = worker.model_runner.lora_manager
    [first] = lora_requests(1)
    manager.add_adapter(first)
    manager.add_adapter(first)  # held: a touch, no load
    [(add_s, files_s)] = module.adapter_load_times(worker)
    assert 0.002 <= files_s < add_s and add_s >= 0.005
    assert module.adapter_load_times(worker) == []  # forgotten once collected
    manager.held.clear()
    manager.add_adapter(first)  # a leg that failed before it collected its loads
    assert module.time_adapter_loads(worker)  # the next leg's start forgets them
    assert module.adapter_load_times(worker) == []
    assert not module.time_adapter_loads(argparse.Namespace(model_runner=None))


def test_a_reload_leg_carries_the_workers_load_times_and_the_table_their_medians():
    module = bench()
    worker = argparse.Namespace(model_runner=argparse.Namespace(lora_manager=TimedManager()))

    class Engine(ReloadingEngine):
        def add_lora(self, request):
            worker.model_runner.lora_manager.held.discard(request.lora_int_id)
            worker.model_runner.lora_manager.add_adapter(request)
            return super().add_lora(request)

    llm = argparse.Namespace(llm_engine=Engine(),
                             collective_rpc=lambda function: [function(worker)])  # fmt: skip
    # 0.2 s of 5-ms reloads: more than one, unless a single reload takes 40 times as long
    # (0.02 s failed once under a loaded -n 4 run: one reload outlasted it)
    leg = module.reload_leg(llm, lora_requests(2), "reload_lora", 1, min_seconds=0.2)
    assert len(leg["adapter_loads"]) == leg["calls"] > 1
    rows = [{**leg, "config": "default"}]
    rows.append({**leg, "config": "unpatched", "adapter_loads": [[0.010, 0.004]]})
    [_, line] = module.adapter_load_lines(rows, ["unpatched", "default"])
    assert "median ms: unpatched 10 (the files 4, the rest 6; 1 loads); default " in line
    broken = argparse.Namespace(llm_engine=ReloadingEngine(), collective_rpc=None)
    assert "adapter_loads" not in module.reload_leg(broken, lora_requests(1), "reload_lora", 0)


def test_a_reload_that_does_not_load_fails_the_leg():
    module = bench()
    llm = argparse.Namespace(llm_engine=ReloadingEngine(fails={2}))
    with pytest.raises(RuntimeError, match="reload_lora: adapter a1 did not load again"):
        module.reload_leg(llm, lora_requests(2), "reload_lora", 1, min_seconds=9.0)


def test_a_reload_of_an_adapter_that_was_not_loaded_fails_the_leg():
    """add_lora of a loaded adapter only touches it: that is no reload to time."""
    module = bench()
    engine = ReloadingEngine()
    engine.remove_lora = lambda lora_id: False
    with pytest.raises(RuntimeError, match="reload_lora: adapter a0 was not loaded to remove"):
        module.reload_leg(argparse.Namespace(llm_engine=engine), lora_requests(2), "reload_lora",
                          0)  # fmt: skip


def test_the_reload_kind_picks_its_one_workload():
    module = bench()
    assert module.pick_workloads(["decode_b1", "reload"]) == [
        "decode_b1_lora", "decode_b1_base", "reload_lora"]  # fmt: skip
    spec = module.WORKLOADS["reload_lora"]
    assert spec["lora"] and spec["reload"]
    assert module.pick_workloads(None) == [w for w in module.WORKLOADS if w != "reload_lora"]


def test_a_workload_named_alone_is_picked_alone():
    """Rounds of the cells still open: a base cell by its own name, without its LoRA twin."""
    module = bench()
    assert module.pick_workloads(["prefill_base", "decode_b1_base"]) == [
        "decode_b1_base", "prefill_base"]  # fmt: skip
    assert module.pick_workloads(["decode_b1", "prefill_base"]) == [
        "decode_b1_lora", "decode_b1_base", "prefill_base"]  # fmt: skip
    with pytest.raises(SystemExit, match="prefill_bas: known are"):
        module.pick_workloads(["prefill_bas"])


def test_a_leg_the_engine_could_not_run_fails_its_round_not_the_engine(tmp_path):
    """An engine answers a failed leg with its error and serves on; the run drops the
    round and keeps the error, as for an engine that did not answer."""
    module = bench()
    engine = module.Engine("default", tmp_path, 1)
    sent = []
    engine.send = lambda command, deadline: sent.append(command)
    engine.wait_for = lambda match, deadline: {
        "id": sent[-1]["id"],
        "error": "reload_lora: RuntimeError: adapter a1 did not load",
    }
    with pytest.raises(RuntimeError, match="engine default: reload_lora: RuntimeError: adapter"):
        engine.ask("reload_lora", 3, deadline=1.0)
    results = {"rounds": [], "errors": {}, "workloads": ["reload_lora"]}
    assert not module.ask_round(results, {"default": engine}, ["reload_lora"], 3, 1.0)
    assert results["errors"]["run"].startswith("round 3: engine default: reload_lora")
    assert results["rounds"] == []


class GeneratingLLM:
    """vllm.LLM as run_workload uses it: generate(prompts, params, ...) -> outputs."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        self.calls.append((len(prompts), params["max_tokens"], lora_request))
        out = argparse.Namespace(token_ids=[0] * params["max_tokens"])
        return [argparse.Namespace(outputs=[out]) for _ in prompts]


def test_a_leg_counts_output_tokens_for_decode_and_prompt_tokens_for_prefill():
    module = bench()
    params = lambda **kw: kw  # noqa: E731 - SamplingParams as a dict
    llm = GeneratingLLM()
    warm = module.run_workload(llm, params, lora_requests(4), "decode_b4_lora", 0, 9.0)
    assert llm.calls == [(4, module.WARMUP_OUT, lora_requests(4))]  # once, 32 tokens out
    assert warm["calls"] == 1 and warm["generated"] == 4 * module.WARMUP_OUT
    assert warm["tok_s"] == pytest.approx(warm["generated"] / warm["seconds"])
    llm = GeneratingLLM()
    leg = module.run_workload(llm, params, lora_requests(4), "prefill_base", 2, 0.02)
    assert leg["calls"] == len(llm.calls) >= 1 and leg["seconds"] >= 0.02
    assert llm.calls[0][2] is None  # a base workload asks for no adapter
    assert leg["tok_s"] == pytest.approx(leg["calls"] * 16 * 4096 / leg["seconds"])
    assert {"wall", "cpu_s", "steal_s", "guest_busy_s"} <= set(leg)
