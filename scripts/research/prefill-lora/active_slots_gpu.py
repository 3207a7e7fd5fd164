"""Prefill-sized add_lora_linear: the GEMM route over every slot against the GEMMs of
the batch's own slots (ActiveSlots), per call, alone on the GPU (no vLLM).

Why: the GEMM route computes every slot's rank for every token; a prefill step
holds few requests, so most slots are idle (the serving benchmark's 8,192-token
steps: 2 of 16). This loads `patchkit_lora_matmul.py` from patches/ and calls
its `_linear` with and without the batch's ActiveSlots (built outside the
timing, as update_metadata builds it once a batch), at the dense 27B's and the
35B-A3B's LoRA shapes, 256-8,192 tokens, 1 to half of the slots in use, to say
from how many tokens narrowing pays (ACTIVE_MIN_TOKENS).

  python3 scripts/research/prefill-lora/active_slots_gpu.py [--json FILE] [--cpu]

Each case: one call, CUDA events, median of 20 after 3 warm-ups; each route's
error is max |y - reference| over max |reference delta| with y0 = 0 (so that
the bf16 rounding of y does not hide the delta's), the reference in float64.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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
TOKENS = (256, 512, 1024, 8192)
BLOCK = 4096  # tokens a prompt: a prefill step's requests, each on its own slot
DEVICE = "cuda"


def load_module():
    """The module as the patch creates it, its work rule off (ACTIVE_MIN_WORK, set
    from this script's first run at 31286fc, before the rule existed): every case
    narrowed, so that the table says where narrowing pays."""
    spec = importlib.util.spec_from_file_location("patchkit_lora_matmul", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ACTIVE_MIN_WORK = 0
    return module


def used_counts(slots: int) -> list[int]:
    """1, 2, 4, ... up to half of the slots (beyond, the path keeps every slot)."""
    counts, n = [], 1
    while 2 * n <= slots:
        counts.append(n)
        n *= 2
    return counts


def mapping_for(tokens: int, used: int) -> torch.Tensor:
    """Prompts of BLOCK tokens (fewer when the call is short: `used` equal parts), on
    slots 0, 2, 4, ... (not a contiguous range), one slot a prompt."""
    block = min(BLOCK, -(-tokens // used))
    return ((torch.arange(tokens, device=DEVICE) // block) % used) * 2 % 16


def reference(x, a, b, mapping) -> torch.Tensor:
    out = torch.zeros(x.size(0), sum(t.size(2) for t in b), dtype=torch.float64, device=x.device)
    for slot in mapping.unique().tolist():
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
    if DEVICE == "cpu":
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


def case(m, name, slots, rank, tokens, used) -> dict:
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
    mapping = mapping_for(tokens, used) % slots
    lora_ids = torch.arange(slots + 1, device=DEVICE) - 1
    weights, no_lora = m._batch_weights(mapping, lora_ids, slots, dtype)
    reduce_weights = torch.zeros(1, 1, 8, device=DEVICE, dtype=dtype)
    flag = torch.tensor(False)
    # what update_metadata builds once a batch: vLLM's active_lora_ids, then ActiveSlots
    distinct = mapping.unique()
    active_ids = torch.full((slots + 1,), -1, dtype=torch.int32, device=DEVICE)
    active_ids[: distinct.numel()] = distinct.to(torch.int32)
    active = m.ActiveSlots(slots, DEVICE)
    active.build(active_ids, tokens)
    assert active.state_cpu.tolist() == [distinct.numel(), tokens], active.state_cpu
    y_all = torch.zeros(tokens, sum(widths), device=DEVICE, dtype=dtype)
    y_own = torch.zeros_like(y_all)

    def every_slot():
        m._linear(y_all, x, a, b, weights, reduce_weights, no_lora, flag, 1.0, True)

    def own_slots():
        m._linear(y_own, x, a, b, weights, reduce_weights, no_lora, flag, 1.0, True,
                  (active.index, active.state_cpu))  # fmt: skip

    every_slot()
    own_slots()
    ref = reference(x, a, b, mapping)
    scale_ = ref.abs().max().item()
    err = {k: (v.double() - ref).abs().max().item() / scale_
           for k, v in (("every_err", y_all), ("own_err", y_own))}  # fmt: skip
    row = dict(layer=name, slots=slots, rank=rank, tokens=tokens, used=distinct.numel(), **err)
    row["every_ms"], row["own_ms"] = timed(every_slot), timed(own_slots)
    row["ratio"] = row["own_ms"] / row["every_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cpu", action="store_true", help="a smoke test: small shapes on the CPU")
    args = parser.parse_args()
    global DEVICE, LAYERS, TOKENS
    if args.cpu:
        DEVICE, TOKENS = "cpu", (64,)
        LAYERS = {"small": (256, (128, 64, 64))}
    m = load_module()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    info = dict(device=name, torch=torch.__version__, min_tokens=m.ACTIVE_MIN_TOKENS)
    print(json.dumps(info), flush=True)
    rows = []
    for layer in LAYERS:
        for slots, rank in SETS:
            for tokens in TOKENS:
                for used in used_counts(slots):
                    try:
                        row = case(m, layer, slots, rank, tokens, used)
                    except Exception as exc:  # report and go on: one shape must not end the run
                        row = dict(layer=layer, slots=slots, rank=rank, tokens=tokens, used=used,
                                   error=f"{type(exc).__name__}: {str(exc)[:300]}")  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
