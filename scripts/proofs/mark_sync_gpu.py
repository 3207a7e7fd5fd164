"""Whether marking a slot's health waits for the GPU (one CUDA device, torch only).

The torch LoRA path marks a slot's health (1, or NaN for a bad adapter) once per
set_lora and reset_lora. Written as `health[slot] = value`, torch copies a host scalar
into a one-element CUDA tensor, a blocking copy that waits for everything queued
before it; `health[slot].fill_(value)` launches a fill and returns. This measures
both: the host's time to mark behind GPU work already queued, and an activation's
shape (per module: a non_blocking copy from pinned memory into the slot, then the
mark) as the host sees it and until the GPU is done.

Usage: python3 scripts/proofs/mark_sync_gpu.py [--modules 92] [--mb 8] [--rounds 5]
Prints one JSON object: medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def by_setitem(health: torch.Tensor, slot: int) -> None:
    health[slot] = 1.0


def by_fill(health: torch.Tensor, slot: int) -> None:
    health[slot].fill_(1.0)


MARKS = {"setitem": by_setitem, "fill": by_fill}


def behind_queued_work(mark, health: torch.Tensor, sleep_ms: float) -> float:
    """Host ms of one mark with `sleep_ms` of GPU work queued before it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_ms * 1e-3 * cycles_per_second()))
    start = time.perf_counter()
    mark(health, 1)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host * 1e3


def activation(mark, health, sources, slots) -> tuple[float, float]:
    """(host ms to queue every module's copy and mark, ms until the GPU is done)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for source, slot in zip(sources, slots, strict=True):
        slot.copy_(source, non_blocking=True)
        mark(health, 1)
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    return queued * 1e3, (time.perf_counter() - start) * 1e3


def cycles_per_second() -> float:
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0)  # kHz, if reported
    return (rate or 1_980_000) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=92)
    parser.add_argument("--mb", type=float, default=8.0, help="each module's copy, MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sleep-ms", type=float, default=50.0)
    args = parser.parse_args()
    health = torch.ones(16, device="cuda")
    numel = int(args.mb * 1e6 / 2)
    sources = [torch.randn(numel).to(torch.bfloat16).pin_memory() for _ in range(args.modules)]
    slots = [torch.empty(numel, dtype=torch.bfloat16, device="cuda") for _ in range(args.modules)]
    found: dict = {name: {"behind": [], "queued": [], "done": []} for name in MARKS}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, mark in MARKS.items():
            found[name]["behind"].append(behind_queued_work(mark, health, args.sleep_ms))
            queued, done = activation(mark, health, sources, slots)
            found[name]["queued"].append(queued)
            found[name]["done"].append(done)
    medians = {
        name: {key: round(statistics.median(values[1:]), 3) for key, values in runs.items()}
        for name, runs in found.items()
    }
    print(json.dumps({
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "modules": args.modules, "mb": args.mb, "rounds": args.rounds,
        "sleep_ms": args.sleep_ms, "median_ms": medians,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
