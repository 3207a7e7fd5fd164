"""GPU benchmark of one add_lora_linear call: the torch path against vLLM's Triton kernels.

Needs a vLLM tree with matmul-add-lora-linear applied (PATCHKIT_LORA_BACKEND
unset or torch). Each case is one add_lora_linear call of a layer with hidden
5120, captured in a CUDA graph and replayed (triton.testing.do_bench_cudagraph,
median): the GPU work decode sees, host work excluded.

  triton-default  what unpatched vLLM runs: fp32 buffer, lora_shrink, lora_expand
  triton-bn32     the same with expand block_n 32 (the expand-block-n patch)
  torch           the patched wrapper's add_lora_linear, weights laid out by
                  patchkit_adopt_layer as set_mapping does in vLLM

Layers: 1 slice of 5120 (o_proj), 2 slices of 17408 (gate_up_proj), 3 slices
12288/1024/1024 (Qwen3.5's gated q, k, v); ranks 64 and 128; 1 and 4
adapters (tokens spread round-robin); 1 to 16384 tokens. Targets (torch over
triton-default): <= 1.25 at 1-256 tokens with one slice, <= 1.5 with 2-3
slices, <= 0.75 at >= 4096 tokens.

  python scripts/bench_lora_gpu.py [--json FILE] [--markdown FILE] [--slices 1 2 3]
        [--tokens 1 16 256 4096 16384]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patchkit.verify import toolkit  # noqa: E402

HIDDEN = 5120
LAYERS = ((5120,), (17408, 17408), (12288, 1024, 1024))  # output slice widths
RANKS = (64, 128)
ADAPTERS = (1, 4)
TOKENS = (1, 16, 256, 4096, 16384)
MAX_LORAS = 4


def target(slices: int, tokens: int) -> float | None:
    if tokens >= 4096:
        return 0.75
    if tokens <= 256:
        return 1.25 if slices == 1 else 1.5
    return None


def case(torch, triton, widths, rank, adapters, tokens) -> dict:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    config = LoRAConfig(max_lora_rank=rank, max_loras=MAX_LORAS)
    wrapper = PunicaWrapperGPU(max(tokens, 16), 64, "cuda", lora_config=config)
    ids = tuple(1 + t % adapters for t in range(tokens))
    wrapper.update_metadata(
        LoRAMapping(ids, ids, is_prefill=tokens > 1), [1, 2, 3, 4], MAX_LORAS, 4096
    )
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    a = [randn(MAX_LORAS, 1, rank, HIDDEN, scale=HIDDEN**-0.5) for _ in widths]
    b = [randn(MAX_LORAS, 1, w, rank, scale=rank**-0.5) for w in widths]
    x = randn(tokens, HIDDEN, scale=1.0)
    y = randn(tokens, sum(widths), scale=1.0)
    row = {"widths": list(widths), "rank": rank, "adapters": adapters, "tokens": tokens}
    variants = {
        "triton-default": ("triton", {"block_n": 128, "num_stages": 2}),
        "triton-bn32": ("triton", {"block_n": 32}),
        "torch": ("torch", None),
    }
    for name, (backend, forced) in variants.items():
        call = toolkit.lora_linear_call(wrapper, backend, a, b)

        def run(call=call):
            call(y, x, 1.0, widths)

        if forced:
            with toolkit.forced_expand_config(forced):
                row[name] = graph_us(torch, triton, run)
        else:
            row[name] = graph_us(torch, triton, run)
    row["ratio"] = row["torch"] / row["triton-default"]
    row["target"] = target(len(widths), tokens)
    row["ok"] = row["target"] is None or row["ratio"] <= row["target"]
    return row


def graph_us(torch, triton, fn) -> float:
    """Replay time of fn captured in a CUDA graph, µs (no host work: what decode sees)."""
    fn()  # Triton compiles outside the capture
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, "
        f"vLLM {meta['vllm']} with matmul-add-lora-linear; hidden {HIDDEN}, max_loras "
        f"{MAX_LORAS}; µs per add_lora_linear call, CUDA-graph replay, median",
        "",
        "| layer | rank | adapters | tokens | triton-default | triton-bn32 | torch "
        "| torch / triton-default | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "" if r["target"] is None else (" ok" if r["ok"] else " **MISSED**")
        goal = "-" if r["target"] is None else f"<= {r['target']}"
        lines.append(
            f"| {'/'.join(map(str, r['widths']))} | {r['rank']} | {r['adapters']} | {r['tokens']} "
            f"| {r['triton-default']:.1f} | {r['triton-bn32']:.1f} | {r['torch']:.1f} "
            f"| {r['ratio']:.2f}{mark} | {goal} |"
        )
    missed = sum(1 for r in rows if not r["ok"])
    lines += ["", f"{len(rows) - missed} of {len(rows)} cases within target."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--slices", type=int, nargs="+", choices=(1, 2, 3), default=(1, 2, 3),
                        help="only the layers with these slice counts")  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="token counts")
    args = parser.parse_args()

    import torch
    import triton
    import vllm

    if toolkit.installed_backend() != "torch":
        raise SystemExit(
            "apply matmul-add-lora-linear first (and leave PATCHKIT_LORA_BACKEND unset)"
        )
    rows = []
    for widths in (w for w in LAYERS if len(w) in args.slices):
        for rank in RANKS:
            for adapters in ADAPTERS:
                for tokens in args.tokens:
                    row = case(torch, triton, widths, rank, adapters, tokens)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    torch.cuda.empty_cache()
    meta = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "vllm": vllm.__version__}  # fmt: skip
    text = render(meta, rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
