"""The host-side cost of nan-probe per engine step, on the CPU (no GPU, no vLLM).

Why: under CUDA graphs a decode step of a small model takes 3-6 ms on an H200,
so every millisecond the probe spends in Python after each step is a visible
share of decode throughput. This times ``Probe.after_forward``
plus the host reading of the step, the part that runs in vLLM's step loop, for
the shapes of scripts/bench_serving.py's model (8 decoder layers) and of a
64-layer model, at decode batch 1 and 64 and a 2,048-token prefill.

    .venv/bin/python scripts/bench_probe_host.py [--steps N]

Prints microseconds per step (median of 5 repeats).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODULE = (
    Path(__file__).resolve().parent.parent
    / "patches/nan-probe/files/vllm/v1/worker/patchkit_nan_probe.py"
)


def load_probe_module():
    spec = importlib.util.spec_from_file_location("patchkit_nan_probe", MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def time_steps(mod, layers: int, per_layer: int, requests: int, tokens: int, steps: int) -> float:
    """Microseconds per step of after_forward on a probe with the given slots."""
    import torch

    slots = [mod.Slot(0, 0, "input", "input")]
    for layer in range(layers):
        for order in range(per_layer):
            slots.append(mod.Slot(len(slots), layer, f"p{order}", "lora", order))
        slots.append(mod.Slot(len(slots), layer, "output", "output"))
    with tempfile.TemporaryDirectory() as tmp:
        probe = mod.Probe(str(Path(tmp) / "log"), False, 8192, torch.device("cpu"), slots)
        bounds = [round(i * tokens / requests) for i in range(requests + 1)]
        meta = {
            "req_ids": [f"r{i}" for i in range(requests)],
            "query_start_loc": bounds,
            "tokens": tokens,
            "adapters": {f"r{i}": "a" for i in range(0, requests, 2)},
            "time": 0.0,
        }
        probe.rows[:, :tokens] = torch.rand(len(slots), tokens)
        for _ in range(20):
            probe.after_forward(meta)
        start = time.perf_counter()
        for _ in range(steps):
            probe.rows[:, :tokens].fill_(1.0)  # the graph's writes, not timed apart
            probe.after_forward(meta)
        probe.flush()
        return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    mod = load_probe_module()
    print("layers  slots  requests  tokens  us/step")
    for layers, per_layer in ((8, 4), (64, 4)):
        for requests, tokens in ((1, 1), (64, 64), (1, 2048)):
            runs = [
                time_steps(mod, layers, per_layer, requests, tokens, args.steps) for _ in range(5)
            ]
            slots = 1 + layers * (per_layer + 1)
            median = statistics.median(runs)
            print(f"{layers:6}  {slots:5}  {requests:8}  {tokens:6}  {median:7.0f}")


if __name__ == "__main__":
    main()
