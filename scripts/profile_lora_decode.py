"""Where a decode step's LoRA time goes at batch 1 and 4 with many adapter slots.

Unpatched vLLM's Triton kernels touch only each row's own adapter; the torch
path's GEMM route (matmul-add-lora-linear) multiplies every slot's A and B and
masks, so at batch 1 it reads max_loras times the LoRA weights. Decode-sized
calls (at most min(GEMV_MAX_TOKENS, max_loras) tokens) can take the path's GEMV
route instead: Triton GEMVs without tl.dot that read each row's own adapter.
This script measures, per add_lora_linear call and summed over the LoRA modules
of one decode step of the benchmark models:

  triton-default  unpatched vLLM's path: fp32 buffer, lora_shrink, lora_expand,
                  expand at block_n 128, 2 stages (what it picks on the H200)
  torch           the patched wrapper's add_lora_linear as installed, its GEMV
                  route on (PATCHKIT_LORA_GEMV=1, set here): the GEMV route where
                  it applies, else the GEMM route
  torch-gemm      the same with the GEMV route off (PATCHKIT_LORA_GEMV=0)

Each call is captured in a CUDA graph and replayed (triton.testing.
do_bench_cudagraph, median). The kernels each path launches, with their GPU
time, come from torch.profiler on the uncaptured call. Every variant is
checked against a float64 reference of the same call.

Models (the LoRA modules of one layer; routed experts run in vLLM's fused MoE
kernel on every path, so they are not here):
  dense27b  Qwen3.5-27B widths, 8 layers (6 GDN + 2 attention)
  moe35b    Qwen3.5-35B-A3B widths, 8 layers, shared expert
Adapter sets (slots = max_loras): 2 x rank 128, 8 x rank 16, 16 x rank 64.

  python scripts/profile_lora_decode.py [--json FILE] [--markdown FILE]
        [--models dense27b moe35b] [--tokens 1 4]

Needs a vLLM tree with matmul-add-lora-linear applied (the default set).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patchkit.verify import toolkit  # noqa: E402

# (module, input width, output slice widths, count per layer kind)
DENSE27B = {
    "layers": {"gdn": 6, "attn": 2},
    "modules": [
        ("qkv_proj", 5120, (12288, 1024, 1024), {"attn": 1}),
        ("o_proj", 6144, (5120,), {"attn": 1}),
        ("in_proj_qkv", 5120, (2048, 2048, 6144), {"gdn": 1}),
        ("in_proj_z", 5120, (6144,), {"gdn": 1}),
        ("out_proj", 6144, (5120,), {"gdn": 1}),
        ("gate_up_proj", 5120, (17408, 17408), {"gdn": 1, "attn": 1}),
        ("down_proj", 17408, (5120,), {"gdn": 1, "attn": 1}),
    ],
}
MOE35B = {
    "layers": {"gdn": 6, "attn": 2},
    "modules": [
        ("qkv_proj", 2048, (8192, 512, 512), {"attn": 1}),
        ("o_proj", 4096, (2048,), {"attn": 1}),
        ("in_proj_qkv", 2048, (2048, 2048, 4096), {"gdn": 1}),
        ("in_proj_z", 2048, (4096,), {"gdn": 1}),
        ("out_proj", 4096, (2048,), {"gdn": 1}),
        ("shared_expert.gate_up_proj", 2048, (512, 512), {"gdn": 1, "attn": 1}),
        ("shared_expert.down_proj", 512, (2048,), {"gdn": 1, "attn": 1}),
    ],
}
MODELS = {"dense27b": DENSE27B, "moe35b": MOE35B}
ADAPTER_SETS = ((2, 128), (8, 16), (16, 64))  # (slots, rank)
VARIANTS = ("triton-default", "torch", "torch-gemm")


def per_step(model: dict, module: tuple) -> int:
    """How many times one decode step calls this module."""
    return sum(model["layers"][kind] * n for kind, n in module[3].items())


# ----- the GEMM route, forced -----


def torch_path_module():
    """The torch path's module as punica_gpu imported it (its globals steer the route)."""
    import importlib

    return importlib.import_module("vllm.lora.punica_wrapper.patchkit_lora_matmul")


def route(call, gemv: bool):
    """call, with the GEMV route on or off while it runs (and while a graph captures it)."""
    module = torch_path_module()

    def forced(y, x, scale, widths):
        was, module.GEMV_ENABLED = module.GEMV_ENABLED, gemv
        try:
            call(y, x, scale, widths)
        finally:
            module.GEMV_ENABLED = was

    return forced


# ----- one case -----


def case(torch, triton, hidden, widths, slots, rank, tokens) -> dict:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    config = LoRAConfig(max_lora_rank=rank, max_loras=slots)
    wrapper = PunicaWrapperGPU(64, 64, "cuda", lora_config=config)
    ids = tuple(1 + t % slots for t in range(tokens))
    wrapper.update_metadata(
        LoRAMapping(ids, ids, is_prefill=False), list(range(1, slots + 1)), slots, 4096
    )
    mapping = wrapper.token_mapping_meta.token_lora_mapping
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    a = [randn(slots, 1, rank, hidden, scale=hidden**-0.5) for _ in widths]
    b = [randn(slots, 1, w, rank, scale=rank**-0.5) for w in widths]
    x = randn(tokens, hidden, scale=1.0)
    y0 = randn(tokens, sum(widths), scale=1.0)
    reference = y0.double().clone()
    offset = 0
    for s, w in enumerate(widths):
        for t in range(tokens):
            slot = int(mapping[t])
            h = a[s][slot, 0].double() @ x[t].double()
            reference[t, offset : offset + w] += b[s][slot, 0].double() @ h
        offset += w
    torch_call = toolkit.lora_linear_call(wrapper, "torch", a, b)
    calls = {
        "triton-default": toolkit.lora_linear_call(wrapper, "triton", a, b),
        "torch": route(torch_call, gemv=True),
        "torch-gemm": route(torch_call, gemv=False),
    }
    gemv = tokens <= min(torch_path_module().GEMV_MAX_TOKENS, slots)
    row = {"hidden": hidden, "widths": list(widths), "slots": slots, "rank": rank,
           "tokens": tokens, "route": "gemv" if gemv else "gemm", "us": {}, "error": {},
           "kernels": {}}  # fmt: skip
    for name, call in calls.items():
        y = y0.clone()
        forced = {"block_n": 128, "num_stages": 2} if name == "triton-default" else None

        def run(call=call, y=y):
            call(y, x, 1.0, widths)

        with toolkit.forced_expand_config(forced) if forced else nullcontext():
            run()
            torch.cuda.synchronize()
            got = y0.clone()
            call(got, x, 1.0, widths)
            row["error"][name] = toolkit.relative_error(got, reference)[0]
            row["us"][name] = 1e3 * triton.testing.do_bench_cudagraph(
                run, rep=40, return_mode="median"
            )
            if tokens == 1:
                row["kernels"][name] = kernel_table(torch, run)
    return row


def kernel_table(torch, run) -> list[list]:
    """[name, calls, GPU µs per call] of every kernel one call launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    repeats = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = event.cuda_time_total
        if device_us <= 0:
            continue
        rows.append([event.key[:90], event.count / repeats, device_us / repeats])
    return sorted(rows, key=lambda r: -r[2])


# ----- report -----


def step_totals(rows: list[dict], model_name: str) -> list[dict]:
    """Per model, adapter set and token count: µs per decode step, summed over modules."""
    model = MODELS[model_name]
    totals = []
    for slots, rank in ADAPTER_SETS:
        for tokens in sorted({r["tokens"] for r in rows}):
            picked = [r for r in rows if (r["slots"], r["rank"], r["tokens"]) ==
                      (slots, rank, tokens)]  # fmt: skip
            if not picked:
                continue
            total = {v: 0.0 for v in VARIANTS}
            for module in model["modules"]:
                row = next(r for r in picked if tuple(r["widths"]) == module[2]
                           and r["hidden"] == module[1])  # fmt: skip
                for v in VARIANTS:
                    total[v] += row["us"][v] * per_step(model, module)
            totals.append({"model": model_name, "slots": slots, "rank": rank,
                           "tokens": tokens, "us": total})  # fmt: skip
    return totals


def render(meta: dict, results: dict) -> str:
    lines = [f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, "
             f"vLLM {meta['vllm']}; µs, CUDA-graph replay, median", ""]  # fmt: skip
    head = "| model | slots x rank | tokens | " + " | ".join(VARIANTS)
    rule = "|---" * (5 + len(VARIANTS)) + "|"
    lines += ["## One decode step's LoRA modules (sum of calls)", ""]
    lines += [head + " | torch / triton | torch-gemm / triton |", rule]
    for t in results["steps"]:
        us = t["us"]
        lines.append(
            f"| {t['model']} | {t['slots']} x {t['rank']} | {t['tokens']} | "
            + " | ".join(f"{us[v]:.0f}" for v in VARIANTS)
            + f" | {us['torch'] / us['triton-default']:.2f}"
            + f" | {us['torch-gemm'] / us['triton-default']:.2f} |"
        )
    head = head.replace("| model |", "| model | module |")
    lines += [
        "",
        "## Per call",
        "",
        head + " | torch's route | max rel. error (triton, torch, torch-gemm) |",
        rule + "---|",
    ]
    for r in results["rows"]:
        err = ", ".join(f"{r['error'][v]:.1e}" for v in VARIANTS)
        lines.append(
            f"| {r['model']} | {r['module']} | {r['slots']} x {r['rank']} | {r['tokens']} | "
            + " | ".join(f"{r['us'][v]:.1f}" for v in VARIANTS)
            + f" | {r['route']} | {err} |"
        )
    lines += ["", "## Kernels of one call at batch 1 (GPU µs per call)", ""]
    for r in results["rows"]:
        if r["tokens"] != 1 or not r["kernels"]:
            continue
        lines.append(f"### {r['model']} {r['module']}, {r['slots']} x {r['rank']}")
        for v in VARIANTS:
            parts = "; ".join(f"{k} x{c:g} {us:.1f}" for k, c, us in r["kernels"].get(v, []))
            lines.append(f"- {v}: {parts}")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=(1, 4))
    args = parser.parse_args()

    import torch
    import triton
    import vllm

    if toolkit.installed_backend() != "torch":
        raise SystemExit("apply matmul-add-lora-linear first (PATCHKIT_LORA_BACKEND unset)")
    rows, steps = [], []
    for model_name in args.models:
        model_rows = []
        for name, hidden, widths, _ in MODELS[model_name]["modules"]:
            for slots, rank in ADAPTER_SETS:
                for tokens in args.tokens:
                    row = case(torch, triton, hidden, widths, slots, rank, tokens)
                    row.update(model=model_name, module=name)
                    model_rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}),
                          file=sys.stderr, flush=True)  # fmt: skip
                    torch.cuda.empty_cache()
        rows += model_rows
        steps += step_totals(model_rows, model_name)
    meta = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "vllm": vllm.__version__}  # fmt: skip
    results = {"meta": meta, "rows": rows, "steps": steps}
    text = render(meta, results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
