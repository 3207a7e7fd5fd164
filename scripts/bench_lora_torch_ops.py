"""CUDA-graph replay time of the torch LoRA ops alone (no vLLM needed), eager and compiled.

Loads patchkit_lora_matmul.py from the catalogue's matmul-add-lora-linear diff
and times shrink + expand (what add_lora_linear runs) at hidden 5120 for a few
(tokens, adapters, rank) cases: the ops' kernels replayed as a CUDA graph,
and the same under torch.compile (dynamic and static shapes).

  python scripts/bench_lora_torch_ops.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = [(1, 4, 64), (16, 4, 64), (4096, 4, 64), (16384, 4, 64), (16384, 1, 64)]
HIDDEN = 5120


def make_inputs(torch, tokens: int, adapters: int, rank: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    mapping = torch.randint(0, adapters, (tokens,), device="cuda", generator=gen)
    lora_ids = torch.full((adapters + 1,), -1, device="cuda")
    lora_ids[:adapters] = torch.arange(adapters, device="cuda")
    a = randn(adapters, 1, rank, HIDDEN, scale=HIDDEN**-0.5)
    b = randn(adapters, 1, HIDDEN, rank, scale=rank**-0.5)
    return randn(tokens, HIDDEN), a, b, mapping, lora_ids, randn(tokens, HIDDEN)


def graph_us(torch, triton, fn, args) -> float:
    fn(*args)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    return round(1e3 * triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=50), 1)


def main() -> int:
    import torch
    import triton
    from catalogue_ops import torch_ops_from_catalogue

    shrink, expand = torch_ops_from_catalogue("0.26.0")

    def lora_linear(x, a, b, mapping, lora_ids, y):
        buffer = torch.empty(1, x.size(0), a.size(-2), dtype=torch.float32, device=x.device)
        meta = (None, None, None, lora_ids, None, None)
        shrink(x, [a], buffer, mapping, *meta, 1.0)
        expand(buffer, [b], y, mapping, *meta, offset_start=0, add_inputs=True)

    variants = {
        "eager kernels": lora_linear,
        "compiled dynamic": torch.compile(lora_linear, fullgraph=True, dynamic=True),
        "compiled static": torch.compile(lora_linear, fullgraph=True, dynamic=False),
    }
    torch._dynamo.config.recompile_limit = 64
    for tokens, adapters, rank in CASES:
        args = make_inputs(torch, tokens, adapters, rank)
        row = {name: graph_us(torch, triton, fn, args) for name, fn in variants.items()}
        print(f"tokens {tokens} adapters {adapters} rank {rank}: {row} µs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
