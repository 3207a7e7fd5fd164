"""GPU kernel checks for `patchkit verify`: vLLM's own LoRA ops against a float64 reference.

Two groups:
- the punica Triton ops (lora_shrink into the fp32 buffer, then single-slice
  lora_expand) at the trigger conditions of vLLM issue #48590, under the
  unpatched default expand config (block_n 128, num_stages 2) and the
  expand-block-n config (block_n 32);
- the installed PunicaWrapperGPU.add_lora_linear, through vLLM's own
  metadata path (LoRAMapping -> update_metadata), with several adapters of
  different ranks, an empty slot and rows without LoRA, once with the
  backend this install uses and once with the other one.

Inputs are fresh random numbers each run (never only zeros). torch and vllm
are imported inside functions only.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from contextlib import contextmanager
from dataclasses import dataclass

# bf16 keeps 8 significant bits (unit roundoff 2**-8 ~ 3.9e-3). The LoRA path
# rounds the shrink result, the expand result and the sum with y; allowing
# about five roundoffs of the largest reference value gives this bound on
# max |result - reference| / max |reference|.
BF16_REL_TOL = 2e-2

TRIGGER_RANKS = (64, 128)
TRIGGER_HIDDEN = (4096, 5120)
TRIGGER_TOKENS = (128, 1024, 4096, 16384)
EXPAND_CONFIGS = {
    "default": {"block_n": 128, "num_stages": 2},
    "patched": {"block_n": 32, "num_stages": 2},
}
PUNICA = "vllm.lora.punica_wrapper.punica_gpu"
TORCH_OPS = "vllm.lora.punica_wrapper.patchkit_lora_matmul"


@dataclass
class KernelResult:
    """One case: what ran, its error against the reference, and whether it counts."""

    name: str
    ok: bool
    rel_error: float
    nonfinite: int
    detail: str = ""
    counts: bool = True  # False: a config or backend this install does not use


def installed_backend() -> str:
    """'torch' when the installed punica_gpu.py runs the patched torch ops, else 'triton'."""
    punica = importlib.import_module(PUNICA)
    return "torch" if punica.lora_expand.__module__ == TORCH_OPS else "triton"


def installed_expand_config(tokens: int, hidden: int, rank: int) -> dict:
    """The single-slice expand config the installed vLLM picks on this GPU."""
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    return get_lora_op_configs(
        "expand",
        max_loras=2,
        batch=tokens,
        hidden_size=hidden,
        rank=rank,
        num_slices=1,
        add_inputs=True,
    )


@contextmanager
def forced_expand_config(forced: dict):
    """Make lora_expand use `forced` on top of the config it would pick."""
    module = importlib.import_module("vllm.lora.ops.triton_ops.lora_expand_op")
    original = module.get_lora_op_configs
    module.get_lora_op_configs = lambda *a, **k: {**original(*a, **k), **forced}
    try:
        yield
    finally:
        module.get_lora_op_configs = original


def relative_error(result, reference) -> tuple[float, int]:
    """max |result - reference| / max |reference| over finite values, and the non-finite count."""
    import torch

    nonfinite = int((~torch.isfinite(result)).sum())
    scale = reference.abs().max().item() or 1.0
    error = (result.double() - reference).abs().nan_to_num(nan=math.inf).max().item()
    return error / scale, nonfinite


def trigger_cases(seed: int) -> list[KernelResult]:
    """Shrink into the fp32 buffer, then single-slice expand: every size and config."""
    import torch
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

    gen = torch.Generator(device="cuda").manual_seed(seed)
    backend = installed_backend()
    results = []
    for hidden in TRIGGER_HIDDEN:
        for rank in TRIGGER_RANKS:
            for tokens in TRIGGER_TOKENS:
                installed = installed_expand_config(tokens, hidden, rank)
                meta = LoRAKernelMeta.make(1, tokens, "cuda")
                meta.prepare_tensors(torch.zeros(tokens, dtype=torch.long, device="cuda"))
                x, a, b, y = _random_lora(gen, tokens, hidden, rank, hidden)
                buffer = torch.empty(1, tokens, rank, dtype=torch.float32, device="cuda")
                lora_shrink(x, [a], buffer, *meta.meta_args(tokens, False), 1.0)
                reference = y.double() + (x.double() @ a[0, 0].double().T) @ b[0, 0].double().T
                for name, forced in EXPAND_CONFIGS.items():
                    out = y.clone()
                    with forced_expand_config(forced):
                        lora_expand(
                            buffer,
                            [b],
                            out,
                            *meta.meta_args(tokens, False),
                            offset_start=0,
                            add_inputs=True,
                        )
                    torch.cuda.synchronize()
                    error, nonfinite = relative_error(out, reference)
                    used = backend == "triton" and all(installed[k] == v for k, v in forced.items())
                    results.append(
                        KernelResult(
                            f"triton expand {name} (block_n {forced['block_n']}) "
                            f"T={tokens} H={hidden} r={rank}",
                            nonfinite == 0 and error <= BF16_REL_TOL,
                            error,
                            nonfinite,
                            counts=used,
                            detail="" if used else "not the config this install runs",
                        )
                    )
    return results


def _random_lora(gen, tokens: int, hidden: int, rank: int, width: int):
    """x, A (1,1,r,H), B (1,1,W,r), y: scaled so the delta is of order one."""
    import torch

    def randn(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)
        return (t * scale).to(torch.bfloat16)

    return (
        randn(tokens, hidden),
        randn(1, 1, rank, hidden, scale=hidden**-0.5),
        randn(1, 1, width, rank, scale=rank**-0.5),
        randn(tokens, width),
    )


def wrapper_cases(seed: int) -> list[KernelResult]:
    """PunicaWrapperGPU.add_lora_linear with several adapters, on both backends."""
    backend = installed_backend()
    results = []
    for name in ("torch", "triton"):
        if name == "torch" and backend != "torch":
            results.append(
                KernelResult(
                    f"add_lora_linear [{name}]",
                    True,
                    0.0,
                    0,
                    "the torch path is not installed (patch not applied)",
                    counts=False,
                )
            )
            continue
        for result in _wrapper_run(seed, name):
            result.counts = name == backend
            if not result.counts:
                result.detail = (result.detail + "; " if result.detail else "") + (
                    "not the backend this install runs"
                )
            results.append(result)
    return results


def lora_linear_call(wrapper, backend: str, a: list, b: list):
    """A function (y, x, scale, slices) running add_lora_linear on one backend.

    torch: the patched wrapper's own add_lora_linear, on copies of the weights
    laid out as the patch lays out a layer's (patchkit_adopt_layer). triton:
    what vLLM's unpatched add_lora_linear does, an fp32 buffer, lora_shrink
    and lora_expand, whatever the module names are bound to.
    """
    import torch

    if backend == "torch":
        import types

        layer = types.SimpleNamespace(
            lora_a_stacked=tuple(t.clone() for t in a),
            lora_b_stacked=tuple(t.clone() for t in b),
            set_lora=lambda *args: None,
            reset_lora=lambda *args: None,
        )
        wrapper.patchkit_adopt_layer(layer)

        def call(y, x, scale, slices):
            wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, scale, slices)

        return call
    triton_ops = importlib.import_module("vllm.lora.ops.triton_ops")
    config = wrapper.lora_config

    def call(y, x, scale, slices):
        meta = wrapper.token_mapping_meta.meta_args(
            x.size(0), getattr(config, "specialize_active_lora", False)
        )
        rank = b[0].size(-1)
        buffer = torch.empty((len(slices), x.size(0), rank), dtype=torch.float32, device=x.device)
        triton_ops.lora_shrink(x, tuple(a), buffer, *meta, scale)
        triton_ops.lora_expand(buffer, tuple(b), y, *meta, offset_start=0, add_inputs=True)

    return call


def _wrapper_run(seed: int, backend: str) -> list[KernelResult]:
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    tokens, hidden, max_rank, max_loras = 3000, 4096, 64, 4
    ranks = {0: 16, 1: 64, 2: 32}  # slot 3 stays empty (zeros), as an unloaded slot
    wrapper = PunicaWrapperGPU(
        tokens, 8, "cuda", lora_config=LoRAConfig(max_lora_rank=max_rank, max_loras=max_loras)
    )
    ids = torch.randint(0, 4, (tokens,), generator=gen, device="cuda").tolist()  # 0 = no LoRA
    ids[0] = 0
    results = []
    for widths in ((hidden,), (2048, 512, 512)):
        a = [
            torch.zeros(max_loras, 1, max_rank, hidden, dtype=torch.bfloat16, device="cuda")
            for _ in widths
        ]
        b = [
            torch.zeros(max_loras, 1, w, max_rank, dtype=torch.bfloat16, device="cuda")
            for w in widths
        ]
        for slot, rank in ranks.items():
            for a_s, b_s, w in zip(a, b, widths, strict=True):
                a_s[slot, 0, :rank] = (
                    torch.randn(rank, hidden, generator=gen, device="cuda")
                    .mul(hidden**-0.5)
                    .to(torch.bfloat16)
                )
                b_s[slot, 0, :, :rank] = (
                    torch.randn(w, rank, generator=gen, device="cuda")
                    .mul(rank**-0.5)
                    .to(torch.bfloat16)
                )
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        y = torch.randn(tokens, sum(widths), generator=gen, device="cuda").to(torch.bfloat16)
        label = f"add_lora_linear [{backend}] {len(widths)} slice(s), 3 adapters + empty slot"
        call = lora_linear_call(wrapper, backend, a, b)
        for mapping, case in ((ids, label), ([0] * tokens, f"{label}, no LoRA in the batch")):
            wrapper.update_metadata(
                LoRAMapping(tuple(mapping), tuple(mapping), is_prefill=True),
                [1, 2, 3, None],
                max_loras,
                4096,
            )
            out = y.clone()
            call(out, x, 1.0, widths)
            torch.cuda.synchronize()
            slots = torch.tensor([i - 1 for i in mapping], device="cuda")
            results.append(_judge(case, out, y, x, a, b, widths, slots))
    return results


def _judge(name, out, y, x, a, b, widths, slots) -> KernelResult:
    """LoRA rows against float64, rows without LoRA bit for bit, no NaN/Inf."""
    import torch

    reference = y.double().clone()
    offset = 0
    for a_s, b_s, w in zip(a, b, widths, strict=True):
        for slot in range(a_s.size(0)):
            rows = slots == slot
            shrunk = x[rows].double() @ a_s[slot, 0].double().T
            reference[rows, offset : offset + w] += shrunk @ b_s[slot, 0].double().T
        offset += w
    plain = slots < 0
    untouched = torch.equal(out[plain].view(torch.int16), y[plain].view(torch.int16))
    error, nonfinite = relative_error(out[~plain], reference[~plain]) if (~plain).any() else (0, 0)
    nonfinite += int((~torch.isfinite(out[plain])).sum())
    ok = untouched and nonfinite == 0 and error <= BF16_REL_TOL
    detail = f"{int(plain.sum())} rows without LoRA " + (
        "bit-identical" if untouched else "CHANGED"
    )
    return KernelResult(name, ok, error, nonfinite, detail)
