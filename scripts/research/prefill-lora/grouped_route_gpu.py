"""Prefill-sized add_lora_linear: the GEMM route against a grouped GEMM per slot.

Why: the GEMM route computes every slot's rank for every token (FLOPs L times
the Triton kernels'). At 16 slots of rank 64 on the MoE's narrow layers (hidden
2048) that is as much work as the base layer itself, and the 2026-12-02g sitting
read MoE 16 x r64 prefill with LoRA at 94.2 % of unpatched (median of per-round
ratios; geometric mean 100.4 %, legs spread 9-17 %). This measures, with no
vLLM, the GEMM route as patched (`_linear` of patchkit_lora_matmul.py, taken
from patches/) against its grouped route (PATCHKIT_LORA_GROUPED=1: the tokens
sorted by slot once a batch, torch._grouped_mm per slot and slice, the shrink,
then the expand into y through index_add_): FLOPs of one slot per token. The
batch's order is built here as update_metadata builds it (GroupedRows), outside
the timing, as it runs once a batch, not once a layer.

  python3 scripts/research/prefill-lora/grouped_route_gpu.py [--json FILE]

It ran at 68558e7 (docs/evidence.md, 2026-12-02: slower than the GEMM route at every
shape); the grouped route was removed after, so it runs in a checkout of 68558e7.

Each case: one call, CUDA events, median of 20 after 3 warm-ups; each route's error is
max |y - reference| over max |reference delta|, the reference in float64.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
MODULE = ROOT / "patches/matmul-add-lora-linear/files/vllm/lora/punica_wrapper"
MODULE = MODULE / "patchkit_lora_matmul.py"

LAYERS = {  # name: (hidden, output slice widths)
    "moe.in_proj_qkvz": (2048, (2048, 2048, 4096, 4096)),
    "moe.out_proj": (4096, (2048,)),
    "moe.qkv_proj": (2048, (8192, 512, 512)),
    "moe.shared_gate_up": (2048, (512, 512)),
    "dense.in_proj_qkvz": (5120, (2048, 2048, 6144, 6144)),
    "dense.gate_up": (5120, (17408, 17408)),
    "dense.down": (17408, (5120,)),
}
SETS = ((16, 64), (8, 16), (2, 128))  # (slots, rank)
TOKENS = (512, 2048, 8192)
MIXES = ("spread", "blocks")  # round-robin over every slot / prompts of 4096 tokens a slot
DEVICE = "cuda"
BLOCK = 4096  # tokens a prompt, "blocks"


def load_module():
    """The module as the patch creates it, its grouped route on (read at import)."""
    os.environ["PATCHKIT_LORA_GROUPED"] = "1"
    spec = importlib.util.spec_from_file_location("patchkit_lora_matmul", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mapping_for(mix: str, tokens: int, slots: int) -> torch.Tensor:
    t = torch.arange(tokens, device=DEVICE)
    return (t % slots) if mix == "spread" else ((t // BLOCK) % slots)


def reference(x, a, b, mapping) -> torch.Tensor:
    """float64, slot by slot: (x @ A_s[slot].T) @ B_s[slot].T for every slice, side by side."""
    out = torch.zeros(x.size(0), sum(t.size(2) for t in b), dtype=torch.float64, device=x.device)
    for slot in range(a[0].size(0)):
        rows = (mapping == slot).nonzero().squeeze(1)
        xd, offset = x[rows].double(), 0
        for a_s, b_s in zip(a, b, strict=True):
            width = b_s.size(2)
            out[rows, offset : offset + width] = (xd @ a_s[slot, 0].double().t()) @ b_s[
                slot, 0
            ].double().t()
            offset += width
    return out


def timed(fn, reps=20, warm=3) -> float:
    for _ in range(warm):
        fn()
    if DEVICE == "cpu":  # the smoke test's
        return statistics.median(_wall(fn) for _ in range(3))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def case(m, name, slots, rank, tokens, mix) -> dict:
    hidden, widths = LAYERS[name]
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    a = [torch.randn(slots, 1, rank, hidden, device=DEVICE, dtype=dtype, generator=gen) * 0.02
         for _ in widths]  # fmt: skip
    b = [torch.randn(slots, 1, w, rank, device=DEVICE, dtype=dtype, generator=gen) * 0.02
         for w in widths]  # fmt: skip
    for t in b:
        m._make_b_rank_major(t)
    if len(a) > 1:
        m._share_a_storage(a)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype, generator=gen)
    y0 = torch.randn(tokens, sum(widths), device=DEVICE, dtype=dtype, generator=gen)
    mapping = mapping_for(mix, tokens, slots)
    lora_ids = torch.arange(slots + 1, device=DEVICE) - (0 if slots else 1)
    weights, no_lora = m._batch_weights(mapping, lora_ids, slots, dtype)
    reduce_weights = torch.zeros(1, 1, 8, device=DEVICE, dtype=dtype)
    flag = torch.tensor(False)
    slot_ids = torch.arange(slots, device=DEVICE)
    rows = m.GroupedRows(tokens, slots, DEVICE)  # what update_metadata builds once a batch
    rows.use_dtype(dtype)
    rows.build(mapping, mapping.unsqueeze(1) == slot_ids, no_lora, weights.float())
    grouped_args = rows.op_args(dtype)
    y_gemm, y_grouped = y0.clone(), y0.clone()

    def gemm():
        m._linear(y_gemm, x, a, b, weights, reduce_weights, no_lora, flag, 1.0, True)

    def grouped():
        m._linear(y_grouped, x, a, b, weights, reduce_weights, no_lora, flag, 1.0, True,
                  grouped_args)  # fmt: skip

    assert m._grouped_fits(y_grouped, x, a, b, tokens, True), "the grouped route does not fit"

    y_gemm.copy_(y0), gemm()
    y_grouped.copy_(y0), grouped()
    ref = reference(x, a, b, mapping) + y0.double()
    scale_ = (ref - y0.double()).abs().max().item()
    err = {k: (v.double() - ref).abs().max().item() / scale_
           for k, v in (("gemm_err", y_gemm), ("grouped_err", y_grouped))}  # fmt: skip
    row = dict(layer=name, slots=slots, rank=rank, tokens=tokens, mix=mix, **err)
    row["gemm_ms"], row["grouped_ms"] = timed(gemm), timed(grouped)
    row["ratio"] = row["grouped_ms"] / row["gemm_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cpu", action="store_true", help="a smoke test: small shapes on the CPU")
    args = parser.parse_args()
    global DEVICE, LAYERS, TOKENS
    if args.cpu:
        global BLOCK
        DEVICE, TOKENS, BLOCK = "cpu", (64,), 16
        LAYERS = {"small": (256, (128, 64, 64))}
    m = load_module()
    rows = []
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    info = dict(device=name, torch=torch.__version__,
                grouped_mm=hasattr(torch, "_grouped_mm"))  # fmt: skip
    print(json.dumps(info), flush=True)
    for name in LAYERS:
        for slots, rank in SETS:
            for tokens in TOKENS:
                for mix in MIXES:
                    try:
                        row = case(m, name, slots, rank, tokens, mix)
                    except Exception as exc:  # report and go on: one shape must not end the run
                        row = dict(layer=name, slots=slots, rank=rank, tokens=tokens, mix=mix,
                                   error=f"{type(exc).__name__}: {str(exc)[:300]}")  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
