"""The device side of nan-probe per engine step: its op calls replayed in a CUDA graph.

Why: with the probe's host side down to ~50 us a step (scripts/bench_probe_host.py),
the H200 serving benchmark still read 83-94 % of the default set's decode
throughput (docs/evidence.md). Under CUDA graphs each probed point cost
two to five ATen kernels a step (a cast of the rows to float32, a reduction,
for a layer's hidden state and residual twice and a maximum); the probe now
runs one Triton kernel per point. This measures both on the GPU for the points
of the serving benchmark's model (Qwen3.5-27B widths, 6 Gated DeltaNet + 2
attention layers, LoRA on every linear module), so the step's share can be
told from the rest of the probe's cost (compile changes around the op, the
host copy).

    python3 scripts/bench_probe_gpu.py [--tokens 1 64 256] [--replays 200]

First checks the probe's Triton row kernel against torch's reductions on the
GPU (NaN, Inf, -Inf rows; exit 1 if any value differs). Then prints, per batch
of tokens: the graph of all probed points of one step, its microseconds per
replay with the Triton kernel and with torch's reductions (the probe before
it had one), per op, and a graph of one trivial kernel as the baseline. Needs
a CUDA GPU (exits 2 without).
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


# (widths of one call's tensors, token rows) checked kernel against torch on the GPU
CHECKS = [((HIDDEN, HIDDEN), 64), ((HIDDEN, HIDDEN), 1), ((96,), 64), ((2 * 17408,), 64),
          ((16384,), 7), ((14336,), 300), ((1000, 33), 5), ((HIDDEN,), 8192)]  # fmt: skip


def check_kernel(mod, device) -> int:
    """The Triton row kernel against torch's reductions on this GPU, value by value
    (here tl.max's handling of NaN is the GPU's, not the interpreter's numpy)."""
    import torch

    wrong = 0
    for case, (widths, rows) in enumerate(CHECKS):
        g = torch.Generator(device=device).manual_seed(case)
        flats = [
            (torch.randn(rows, w, generator=g, device=device) * 30).to(torch.bfloat16)
            for w in widths
        ]
        if rows > 3:
            flats[0][1, 2] = float("nan")
            flats[-1][2, 0] = float("inf")
            flats[-1][0, -1] = float("-inf")
            flats[0][3, 0], flats[-1][3, 1] = float("inf"), float("nan")
        reference = torch.full((rows,), -7.0, device=device)
        kernel = torch.full((rows,), -7.0, device=device)
        mod._torch_row_absmax(flats, reference)
        mod._triton_row_absmax(flats, kernel)
        same = torch.equal(reference.isnan(), kernel.isnan()) and torch.equal(
            reference.nan_to_num(), kernel.nan_to_num()
        )
        marks = "" if rows <= 3 else f" rows 0-3 {kernel[:4].tolist()}"
        print(f"check {widths} x {rows}: {'same' if same else 'DIFFERENT'}{marks}")
        wrong += not same
    return wrong


def time_step(mod, kernel: str, tokens: int, replays: int, device):
    """us per replay of one step's probe calls with the given row kernel, the
    number of calls, and the rows the last replay wrote (NaN in the last token
    row of the third call's tensor, Inf in the first row of the layer outputs)."""
    import torch

    mod.ROW_KERNEL = kernel
    torch.manual_seed(tokens)
    calls = step_calls(tokens, device)
    calls[2][0][0][-1, 5] = float("nan")
    for tensors, _ in calls:
        if len(tensors) == 2:
            tensors[1][0, -1] = float("inf")
    rows = torch.zeros(len(calls), 8192, dtype=torch.float32, device=device)
    stats = torch.zeros(len(calls), 5, dtype=torch.float64, device=device)

    def probe_all():
        for tensors, slot in calls:
            torch.ops.patchkit.probe_record(tensors, rows, stats, slot, False)

    graph = captured(probe_all)
    rows.fill_(-7.0)
    us = replay_us(graph, replays)
    assert mod.ROW_KERNEL == kernel, "the Triton kernel failed and the probe fell back"
    return us, len(calls), rows[:, :tokens].clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_probe_gpu: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    mod = load_probe_module()  # registers patchkit::probe_record
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    wrong = check_kernel(mod, device)
    print(
        "tokens  probed points  us/step triton  us/step torch  us/op triton  torch  (empty graph)"
    )
    for tokens in args.tokens:
        first = step_calls(tokens, device)[0][0][0]
        baseline = replay_us(captured(lambda first=first: first.add_(0)), args.replays)
        triton_us, points, triton_rows = time_step(mod, "triton", tokens, args.replays, device)
        torch_us, _, torch_rows = time_step(mod, "torch", tokens, args.replays, device)
        same = torch.equal(triton_rows.isnan(), torch_rows.isnan()) and torch.equal(
            triton_rows.nan_to_num(), torch_rows.nan_to_num()
        )
        bad = int((~triton_rows.isfinite()).sum())
        print(f"graph rows, {tokens} tokens: {'same' if same else 'DIFFERENT'}, {bad} non-finite")
        wrong += not same
        print(
            f"{tokens:6}  {points:13}  {triton_us:14.1f}  {torch_us:13.1f}  "
            f"{(triton_us - baseline) / points:12.2f}  {(torch_us - baseline) / points:5.2f}  "
            f"({baseline:.1f})"
        )
    verdict = "all same" if not wrong else f"{wrong} DIFFERENT"
    print(f"kernel check: {verdict} ({len(CHECKS)} eager cases, {len(args.tokens)} graphs)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
