"""Where a served workload's GPU time went: a summary of one torch profiler trace.

vLLM's torch profiler (`LLM(profiler_config={"profiler": "torch", ...})`,
`llm.start_profile()` / `llm.stop_profile()`) writes the engine worker's
trace as Chrome trace JSON (`*.pt.trace.json.gz`). Every GPU kernel is an
event of category "kernel", those replayed from CUDA graphs too. This module
turns one trace into numbers per engine step: how long the GPU was busy
(the union of kernel intervals, so two streams at once count once), how
many kernels ran, how much of it LoRA's named kernels took, and the kernels
that took the most. bench_serving.py's `profile` step prints them side by
side for each configuration, so a throughput ratio comes with where the
time went: a step the GPU spends less time on that is not faster is a step
whose time the host sets.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

# Kernels of the LoRA paths, by name: vLLM's punica Triton kernels
# (_lora_shrink_kernel, _lora_expand_kernel, the fused MoE LoRA kernels) and the
# torch path's GEMV route (_gemv_shrink_kernel, _gemv_expand_kernel). The torch
# path's GEMM route runs as cuBLAS GEMMs, which no name tells from the base
# model's: the LoRA workload's GPU time against the base workload's says it.
LORA_KERNEL = re.compile(r"lora|gemv", re.IGNORECASE)
TOP = 12
# Host-side events the profiler records in the worker (outside the CUDA graphs):
# aten ops run eagerly (a per-batch metadata update shows here), CUDA runtime calls
# (kernel launches, graph launches, copies) and vLLM's own annotated ranges.
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "user_annotation")
HOST_TOP = 20


def read_events(path: Path) -> list[dict]:
    """The trace's events (gzip or plain JSON, as the profiler wrote it)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as trace:
        return json.load(trace)["traceEvents"]


# What the GPU runs, as the torch profiler names it: kernels, memsets, copies.
GPU_WORK = ("kernel", "gpu_memset", "gpu_memcpy")


def kernels(events: list[dict]) -> list[dict]:
    """The GPU's work: complete events of a GPU_WORK category (a memset or a copy
    occupies the step's GPU time as a kernel does)."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_WORK]


def busy_us(found: list[dict]) -> float:
    """Microseconds in which at least one kernel ran (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in found):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def per_name(found: list[dict], steps: int) -> list[list]:
    """[name, count per step, microseconds per step] for each name, most time first."""
    by_name: dict[str, list[float]] = {}
    for event in found:
        cell = by_name.setdefault(event["name"], [0, 0.0])
        cell[0] += 1
        cell[1] += event["dur"]
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    return [[name, count / steps, us / steps] for name, (count, us) in ranked]


def host_summary(events: list[dict], steps: int) -> dict:
    """Per step, each HOST_CATEGORIES category's event count and its HOST_TOP names:
    what the host did outside the graphs (two configurations' difference here is host
    work one of them adds per step)."""
    found = {}
    for category in HOST_CATEGORIES:
        chosen = [e for e in events if e.get("ph") == "X" and e.get("cat") == category]
        found[category] = {"events": len(chosen) / steps,
                           "top": per_name(chosen, steps)[:HOST_TOP]}  # fmt: skip
    return found


def summary(paths: list[Path], steps: int) -> dict:
    """Per engine step, over every trace of one profiled workload: GPU busy time,
    the kernels' window, kernel count, LoRA-named kernels' time, the TOP kernels
    by time (name, launches and microseconds per step), every kernel by name (to
    set two configurations side by side), and the host's events (host_summary)."""
    events = [e for path in paths for e in read_events(path)]
    found = kernels(events)
    if not found:
        return {"steps": steps, "kernels": 0, "host": host_summary(events, steps)}
    window = max(k["ts"] + k["dur"] for k in found) - min(k["ts"] for k in found)
    every = per_name(found, steps)
    lora = [k for k in found if LORA_KERNEL.search(k["name"])]
    return {
        "steps": steps,
        "kernels": len(found) / steps,
        "gpu_busy_us": busy_us(found) / steps,
        "window_us": window / steps,
        "lora_us": sum(k["dur"] for k in lora) / steps,
        "lora_kernels": len(lora) / steps,
        "top": every[:TOP],
        "by_name": every,
        "host": host_summary(events, steps),
    }
