"""The device side of nan-probe per engine step: its op calls replayed in a CUDA graph.

Why: with the probe's host side down to ~50 us a step (scripts/bench_probe_host.py),
the H200 serving benchmark still read 83-94 % of the default set's decode
throughput (docs/h200-2026-11-30h). Under CUDA graphs each probed point costs
one reduction kernel a step (two for a layer's hidden state and residual, plus
a maximum); this measures what that costs on the GPU for the points of the
serving benchmark's model (Qwen3.5-27B widths, 6 Gated DeltaNet + 2 attention
layers, LoRA on every linear module), so the step's share can be told from
the rest of the probe's cost (compile changes around the op, the host copy).

    python3 scripts/bench_probe_gpu.py [--tokens 1 64 256] [--replays 200]

Prints, per batch of tokens: the graph of all probed points of one step,
its microseconds per replay, per op, and the same graph without the probe
ops (the tensors only) as the baseline. Needs a CUDA GPU (exits 2 without).
"""

from __future__ import annotations

import argparse
import sys

from bench_probe_host import load_probe_module  # scripts/: the module from patches/

HIDDEN = 5120
# (module, output width) of one layer's LoRA projections at Qwen3.5-27B widths
# (vLLM's fused names; TP=1), and how many layers of each kind the benchmark has.
GDN = [("in_proj_qkvz", 16384), ("in_proj_ba", 96), ("out_proj", HIDDEN),
       ("gate_up_proj", 2 * 17408), ("down_proj", HIDDEN)]  # fmt: skip
ATTENTION = [("qkv_proj", 14336), ("o_proj", HIDDEN), ("gate_up_proj", 2 * 17408),
             ("down_proj", HIDDEN)]  # fmt: skip
LAYERS = [GDN] * 6 + [ATTENTION] * 2


def step_calls(tokens: int, device):
    """(tensors, slot) of every probe call of one step: input, projections, layer outputs."""
    import torch

    def t(width):
        return torch.randn(tokens, width, device=device, dtype=torch.bfloat16)

    calls = [([t(HIDDEN), t(HIDDEN)], 0)]
    for layer in LAYERS:
        for _, width in layer:
            calls.append(([t(width)], len(calls)))
        calls.append(([t(HIDDEN), t(HIDDEN)], len(calls)))
    return calls


def replay_us(graph, replays: int) -> float:
    import torch

    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def captured(fn):
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the graph (allocations, kernel selection)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_probe_gpu: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    load_probe_module()  # registers patchkit::probe_record
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("tokens  probed points  us/step with probe  us/op  (baseline: empty graph)")
    for tokens in args.tokens:
        calls = step_calls(tokens, device)
        rows = torch.zeros(len(calls), 8192, dtype=torch.float32, device=device)
        stats = torch.zeros(len(calls), 5, dtype=torch.float64, device=device)

        def probe_all(calls=calls, rows=rows, stats=stats):
            for tensors, slot in calls:
                torch.ops.patchkit.probe_record(tensors, rows, stats, slot, False)

        def nothing(calls=calls):
            calls[0][0][0].add_(0)  # one trivial kernel: a graph must hold something

        with_probe = replay_us(captured(probe_all), args.replays)
        baseline = replay_us(captured(nothing), args.replays)
        per_op = (with_probe - baseline) / len(calls)
        print(f"{tokens:6}  {len(calls):13}  {with_probe:18.1f}  {per_op:5.2f}  ({baseline:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
