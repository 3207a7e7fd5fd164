"""GPU benchmark of PunicaWrapperGPU.add_lora_linear: Triton configs against the torch path.

Runs the installed vLLM's own add_lora_linear (vLLM's metadata path, one
output slice of width = hidden) with its module-level ops swapped:
  triton-default  Triton kernels, expand block_n 128, num_stages 2 (unpatched)
  triton-bn32     Triton kernels, expand block_n 32 (expand-block-n)
  triton-st1      Triton kernels, expand num_stages 1 (vLLM 0.33's fix)
  torch           the matmul-add-lora-linear torch path (needs the patch applied)
Median of triton.testing.do_bench (eager calls, host work included), the
CUDA-graph replay time (triton.testing.do_bench_cudagraph: GPU work only, as
vLLM runs decode), the torch path compiled with torch.compile (as vLLM
compiles the model; replayed as a graph), and the memory-traffic floor of
the ideal kernel at the bandwidth measured here: x read, active adapters'
A and B read, fp32 buffer written and read, y read and written.

  python scripts/bench_lora_gpu.py [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalogue_ops import torch_ops_from_catalogue  # noqa: E402

from patchkit import kernelcheck  # noqa: E402

HIDDEN = 5120
RANKS = (64, 128)
TOKENS = (1, 16, 256, 4096, 16384)
ADAPTERS = (1, 4)
CONFIGS = {
    "triton-default": {"block_n": 128, "num_stages": 2},
    "triton-bn32": {"block_n": 32, "num_stages": 2},
    "triton-st1": {"block_n": 128, "num_stages": 1},
}


def bandwidth(torch, triton) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    return 2 * src.numel() / (ms / 1e3)


def floor_bytes(tokens: int, rank: int, adapters: int) -> int:
    x = tokens * HIDDEN * 2
    weights = adapters * 2 * rank * HIDDEN * 2
    buffer = 2 * tokens * rank * 4
    y = 2 * tokens * HIDDEN * 2
    return x + weights + buffer + y


def setup(torch, tokens: int, rank: int, adapters: int):
    """A wrapper with `adapters` loaded slots and tokens spread over them."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    config = LoRAConfig(max_lora_rank=rank, max_loras=adapters)
    wrapper = PunicaWrapperGPU(max(tokens, 16), 8, "cuda", lora_config=config)
    ids = tuple(1 + t % adapters for t in range(tokens))
    wrapper.update_metadata(
        LoRAMapping(ids, ids, is_prefill=tokens > 1), list(range(1, adapters + 1)), adapters, 4096
    )

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)

    a = (randn(adapters, 1, rank, HIDDEN, scale=HIDDEN**-0.5),)
    b = (randn(adapters, 1, HIDDEN, rank, scale=rank**-0.5),)
    return wrapper, randn(tokens, HIDDEN), randn(tokens, HIDDEN), a, b


def measure(torch, triton, punica, ops, tokens: int, rank: int, adapters: int) -> dict:
    """Median µs of one add_lora_linear call per variant, eager and as a CUDA graph replay."""
    triton_ops, torch_ops = ops
    wrapper, x, y, a, b = setup(torch, tokens, rank, adapters)

    def call():
        wrapper.add_lora_linear(y, x, a, b, 1.0, (HIDDEN,))

    times = {}
    punica.lora_shrink, punica.lora_expand = triton_ops
    for name, forced in CONFIGS.items():
        with kernelcheck.forced_expand_config(forced):
            times[name] = eager_us(triton, call)
    with kernelcheck.forced_expand_config(CONFIGS["triton-default"]):
        times["triton-default graph"] = graph_us(torch, triton, call)
    if torch_ops is not None:
        punica.lora_shrink, punica.lora_expand = torch_ops
        times["torch"] = eager_us(triton, call)
        kernel_meta = wrapper.token_mapping_meta.meta_args(tokens, False)
        compiled = compiled_torch_path(torch, torch_ops)
        times["torch compiled graph"] = graph_us(
            torch, triton, lambda: compiled(x, a[0], b[0], kernel_meta[0], kernel_meta[4], y)
        )
    return times


def eager_us(triton, fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_us(torch, triton, fn) -> float:
    """Replay time of fn captured in a CUDA graph (no host work: what decode sees)."""
    fn()  # warm up (Triton compiles, torch.compile traces) outside the capture
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


_COMPILED = {}


def compiled_torch_path(torch, torch_ops):
    """add_lora_linear's work on the torch ops, compiled as vLLM compiles the model."""
    if "fn" not in _COMPILED:
        shrink, expand = torch_ops

        def lora_linear(x, a, b, mapping, lora_ids, y):
            buffer = torch.empty(1, x.size(0), a.size(-2), dtype=torch.float32, device=x.device)
            kernel_meta = (None, None, None, lora_ids, None, None)
            shrink(x, [a], buffer, mapping, *kernel_meta, 1.0)
            expand(buffer, [b], y, mapping, *kernel_meta, offset_start=0, add_inputs=True)

        _COMPILED["fn"] = torch.compile(lora_linear, fullgraph=True, dynamic=True)
    return _COMPILED["fn"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()

    import torch
    import triton
    import vllm

    punica = importlib.import_module(kernelcheck.PUNICA)
    triton_ops = kernelcheck.lora_ops("triton")
    torch_ops = kernelcheck.lora_ops("torch") or torch_ops_from_catalogue(vllm.__version__)
    bw = bandwidth(torch, triton)
    rows = []
    for rank in RANKS:
        for adapters in ADAPTERS:
            for tokens in TOKENS:
                row = {"rank": rank, "adapters": adapters, "tokens": tokens}
                row.update(
                    measure(torch, triton, punica, (triton_ops, torch_ops), tokens, rank, adapters)
                )
                row["floor"] = 1e6 * floor_bytes(tokens, rank, adapters) / bw
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    meta = {
        "date": date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vllm": vllm.__version__,
        "bandwidth_GBps": round(bw / 1e9),
        "hidden": HIDDEN,
    }
    print(render(meta, rows))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


COLUMNS = (
    "triton-default",
    "triton-bn32",
    "triton-st1",
    "torch",
    "triton-default graph",
    "torch compiled graph",
)


def render(meta: dict, rows: list[dict]) -> str:
    """A Markdown table; times in microseconds."""
    lines = [
        f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, "
        f"vLLM {meta['vllm']}; copy bandwidth {meta['bandwidth_GBps']} GB/s; hidden "
        f"{meta['hidden']}; median µs per add_lora_linear call",
        "",
        "| rank | adapters | tokens | " + " | ".join(COLUMNS) + " | torch/triton eager "
        "| torch/triton graph | floor |",
        "|" + "---|" * (len(COLUMNS) + 6),
    ]
    for r in rows:
        times = [f"{r[n]:.1f}" if n in r else "n/a" for n in COLUMNS]
        lines.append(
            f"| {r['rank']} | {r['adapters']} | {r['tokens']} | "
            + " | ".join(times)
            + f" | {ratio(r, 'torch', 'triton-default')} "
            + f"| {ratio(r, 'torch compiled graph', 'triton-default graph')} "
            + f"| {r['floor']:.1f} |"
        )
    return "\n".join(lines)


def ratio(row: dict, top: str, bottom: str) -> str:
    return f"{row[top] / row[bottom]:.2f}" if top in row and bottom in row else "n/a"


if __name__ == "__main__":
    sys.exit(main())
