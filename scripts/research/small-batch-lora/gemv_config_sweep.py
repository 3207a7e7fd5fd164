"""The GEMV route's block sizes and warps, swept on the GPU (no vLLM needed).

Each variant sets the module's GEMV_* constants (the kernels' configs come from
them); "slot-from-mapping" instead reads each row's slot from vLLM's mapping
(one scalar load, not the 16 slot weights of the row) to price that lookup.
Cases: the widest and narrowest LoRA modules of gemv_route_gpucheck at 1 and 4
tokens for its three adapter sets; µs per call, CUDA-graph replay, summed.

    python3 scripts/research/small-batch-lora/gemv_config_sweep.py  # from the repo root

Prints one line per variant; the best's constants last (as JSON).
"""

import importlib.util
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemv_route_gpucheck as check  # noqa: E402
from graph_timer import graph_us  # noqa: E402

CASES = [("dense27b", *check.DENSE27B[0]), ("dense27b", *check.DENSE27B[1]),
         ("dense27b", *check.DENSE27B[5]), ("dense27b", *check.DENSE27B[6]),
         ("moe35b", *check.MOE35B[6])]  # fmt: skip
VARIANTS = {
    "shipped": {},
    "warps 2": {"GEMV_NUM_WARPS": 2},
    "warps 8": {"GEMV_NUM_WARPS": 8},
    "block_w 64": {"GEMV_BLOCK_W": 64},
    "block_w 256": {"GEMV_BLOCK_W": 256},
    "split_k 8": {"GEMV_SPLIT_K": 8},
    "split_k 32": {"GEMV_SPLIT_K": 32},
    "block_n 8": {"GEMV_BLOCK_N": 8},
    "block_n 32": {"GEMV_BLOCK_N": 32},
    "block_k 64": {"GEMV_BLOCK_K": 64},
    "block_k 256": {"GEMV_BLOCK_K": 256},
    "max_block_r 64": {"GEMV_MAX_BLOCK_R": 64},
}
OWN_SLOT = """        slot = tl.full((), -1, tl.int32)  # the row's slot: the one whose weight is not 0
        weight = tl.zeros((), tl.float32)  # its weight: 1, or NaN for a bad adapter
        for l0 in range(0, num_slots, BLOCK_L):
            lane = l0 + tl.arange(0, BLOCK_L)
            w = tl.load(w_ptr + t * stride_w + lane, mask=lane < num_slots, other=0.0)
            own = w.to(tl.float32) != 0.0  # unordered: NaN counts
            slot = tl.maximum(slot, tl.max(tl.where(own, lane, -1), axis=0))
            weight += tl.sum(tl.where(own, w.to(tl.float32), 0.0), axis=0)
"""
FROM_MAPPING = """        slot = tl.load(w_ptr + t * stride_w)
        weight = tl.full((), 1.0, tl.float32)
"""


def uncommented(text: str) -> str:
    return "\n".join(re.sub(r"\s+# .*$", "", line) for line in text.split("\n"))


def mapping_variant():
    """The module with each row's slot read from the mapping (timing only)."""
    text, own_slot = (uncommented(t) for t in (open(check.SOURCE).read(), OWN_SLOT))
    assert text.count(own_slot) == 2, "the slot lookup changed; update this sweep"
    text = text.replace(own_slot, FROM_MAPPING).replace("weights.size(1) == slots", "True")
    path = "/tmp/patchkit_lora_matmul_mapping.py"
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("patchkit_lora_matmul_mapping", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def time_case(module, case, slots, rank, tokens, use_mapping=False) -> float:
    _, _, hidden, widths, _ = case
    gen = torch.Generator(device="cuda").manual_seed(hidden + slots + rank)
    meta, masks, layer, _ = check.layer_with(hidden, widths, slots, rank, gen)
    check.map_batch(meta, masks, [t % slots for t in range(tokens)])
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    y = torch.randn(tokens, sum(widths), generator=gen, device="cuda").bfloat16()
    weights = masks.weights[torch.bfloat16]
    if use_mapping:
        weights = meta.token_lora_mapping.view(-1, 1)
    a, b = list(layer.lora_a_stacked), list(layer.lora_b_stacked)

    def call():
        assert module.gemv_linear(y, x, a, b, weights, 1.0, True)

    return graph_us(call)


def sweep() -> dict:
    base = {k: getattr(check.m, k) for k in dir(check.m) if k.startswith("GEMV_")}
    totals = {}
    for name, overrides in {**VARIANTS, "slot-from-mapping": {}}.items():
        module = mapping_variant() if name == "slot-from-mapping" else check.m
        for key, value in {**base, **overrides}.items():
            setattr(module, key, value)
        by_tokens = {}
        for case in CASES:
            for slots, rank in check.ADAPTER_SETS:
                for tokens in (1, 4):
                    us = time_case(module, case, slots, rank, tokens, module is not check.m)
                    by_tokens[tokens] = by_tokens.get(tokens, 0.0) + us
        totals[name] = {"overrides": overrides, "us_by_tokens": by_tokens}
        print(f"{name:>18}: " + ", ".join(f"T={t} {us:.1f} µs" for t, us in by_tokens.items()),
              flush=True)  # fmt: skip
    for key, value in base.items():
        setattr(check.m, key, value)
    return totals


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, check.m.triton.__version__)
    found = sweep()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gemv_sweep.json"), "w") as f:
        json.dump(found, f, indent=1)
    best = min(found, key=lambda n: sum(found[n]["us_by_tokens"].values()))
    print("best:", best, json.dumps(found[best]))
