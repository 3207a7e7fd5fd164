"""GPU kernel checks for `patchkit verify`: vLLM's own LoRA ops against a float64 reference.

Two groups:
- the punica Triton ops (lora_shrink into the fp32 buffer, then single-slice
  lora_expand) at the trigger conditions of vLLM issue #48590, under the
  unpatched default expand config (block_n 128, num_stages 2) and the
  expand-block-n config (block_n 32);
- the installed PunicaWrapperGPU.add_lora_linear, through vLLM's own
  metadata path (LoRAMapping -> update_metadata), with several adapters of
  different ranks, an empty slot and rows without LoRA, once with the
  backend this install uses and once with the other one; and on the torch
  path, its GEMV route for decode-sized calls (1, 2, 4 and 8 tokens, 1-4
  slices) and its GEMMs narrowed to the batch's own slots for prefill-sized
  ones (1,024 and 4,096 tokens on 3 of 8 slots, 1-4 slices, adding and
  writing), each with a quarantined non-finite adapter among the others.

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


NOT_INSTALLED = "the torch path is not installed (patch not applied)"


def not_counted(name: str, why: str) -> KernelResult:
    """A case that does not apply to this install: said, with why, not counted."""
    return KernelResult(name, True, 0.0, 0, why, counts=False)


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
    """PunicaWrapperGPU.add_lora_linear with several adapters, on both backends, and
    the torch path's own routes: the GEMV, and the GEMMs of the batch's slots only."""
    backend = installed_backend()
    results = gemv_cases(seed) + active_slot_cases(seed)
    for name in ("torch", "triton"):
        if name == "torch" and backend != "torch":
            results.append(not_counted(f"add_lora_linear [{name}]", NOT_INSTALLED))
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
        layer = _adopted(wrapper, a, b)

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


def _reference(reference, x, a, b, widths, slots):
    """``reference`` (float64, the output before the call) plus each row's own adapter's
    x A^T B^T per slice, in float64: what add_lora_linear should give."""
    offset = 0
    for a_s, b_s, w in zip(a, b, widths, strict=True):
        for slot in range(a_s.size(0)):
            rows = slots == slot
            shrunk = x[rows].double() @ a_s[slot, 0].double().T
            reference[rows, offset : offset + w] += shrunk @ b_s[slot, 0].double().T
        offset += w
    return reference


def _judge(name, out, y, x, a, b, widths, slots) -> KernelResult:
    """LoRA rows against float64, rows without LoRA bit for bit, no NaN/Inf."""
    import torch

    reference = _reference(y.double().clone(), x, a, b, widths, slots)
    plain = slots < 0
    untouched = torch.equal(out[plain].view(torch.int16), y[plain].view(torch.int16))
    error, nonfinite = relative_error(out[~plain], reference[~plain]) if (~plain).any() else (0, 0)
    nonfinite += int((~torch.isfinite(out[plain])).sum())
    ok = untouched and nonfinite == 0 and error <= BF16_REL_TOL
    detail = f"{int(plain.sum())} rows without LoRA " + (
        "bit-identical" if untouched else "CHANGED"
    )
    return KernelResult(name, ok, error, nonfinite, detail)


# ----- the torch path's GEMV route: decode-sized calls -----

GEMV_TOKENS = (1, 2, 4, 8)  # the route takes at most min(8, max_loras) tokens
# 1-4 slices (Qwen3.5: o_proj, gate_up_proj, qkv_proj, in_proj_qkvz), input 4096
GEMV_WIDTHS = ((4096,), (2048, 2048), (2048, 512, 512), (1024, 1024, 2048, 2048))
GEMV_RANKS = {0: 16, 1: 64, 2: 32, 4: 64}  # adapters of mixed ranks (max rank 64)
GEMV_BAD_SLOT = 3  # a non-finite adapter, quarantined when set
GEMV_EMPTY_SLOT = 6  # an adapter id whose slot holds zeros; slots 5 and 7 are unused
# vLLM's adapter id per row (0 = no LoRA), slot = id - 1: every kind of row in 8 tokens.
# Slice count n takes its rows from position n on, so its one-token call is in turn a
# bad adapter's, a good one's, the empty slot's and a good one's row, and every call
# has a LoRA row (without one vLLM's flag skips the LoRA ops altogether).
GEMV_ROWS = (4, 1, 7, 3, 0, 5, 2, 4)


def gemv_cases(seed: int) -> list[KernelResult]:
    """The torch path's GEMV route through the installed wrapper's add_lora_linear,
    against the float64 reference: 1, 2, 4 and 8 tokens, every slice count, adapters
    of mixed ranks, an empty slot, rows without LoRA and a non-finite adapter, adding
    and writing (vLLM's dual stream). A case passes only if the route ran, rows without
    LoRA are bit-identical, the bad adapter's rows are NaN and the others are close."""
    if installed_backend() != "torch":
        return [not_counted("add_lora_linear [torch] GEMV route", NOT_INSTALLED)]
    module = importlib.import_module(TORCH_OPS)
    off = "" if module.GEMV_ENABLED else f"the GEMV route is off here ({module.GEMV_ENV}=0)"
    return _route_run(seed, module, GEMV, off)


def _gemv_adapters(gen, widths, hidden, max_rank, max_loras):
    """Stacked A and B (vLLM's layout) with GEMV_RANKS' adapters; other slots zero."""
    import torch

    a = [torch.zeros(max_loras, 1, max_rank, hidden, dtype=torch.bfloat16, device="cuda")
         for _ in widths]  # fmt: skip
    b = [torch.zeros(max_loras, 1, w, max_rank, dtype=torch.bfloat16, device="cuda")
         for w in widths]  # fmt: skip
    for slot, rank in (*GEMV_RANKS.items(), (GEMV_BAD_SLOT, 16)):
        for a_s, b_s, w in zip(a, b, widths, strict=True):
            a_s[slot, 0, :rank] = (
                torch.randn(rank, hidden, generator=gen, device="cuda") * hidden**-0.5
            ).to(torch.bfloat16)
            b_s[slot, 0, :, :rank] = (
                torch.randn(w, rank, generator=gen, device="cuda") * rank**-0.5
            ).to(torch.bfloat16)
    return a, b


def _adopted(wrapper, a: list, b: list):
    """A layer holding copies of a and b, laid out and checked by the torch path."""
    import types

    layer = types.SimpleNamespace(
        lora_a_stacked=tuple(t.clone() for t in a),
        lora_b_stacked=tuple(t.clone() for t in b),
        set_lora=lambda *args: None,
        reset_lora=lambda *args: None,
    )
    wrapper.patchkit_adopt_layer(layer)
    return layer


def _poison(layer, n: int) -> None:
    """A NaN or inf in the bad slot's A or B (a different slice each layer), then the
    path's own check after set_lora: the slot is quarantined, its value zeroed."""
    values = (float("nan"), float("inf"), float("-inf"), float("nan"))
    stacked = layer.lora_a_stacked if n % 2 == 0 else layer.lora_b_stacked
    stacked[n % len(stacked)][GEMV_BAD_SLOT, 0, 1, 2] = values[n % len(values)]
    layer.set_lora(GEMV_BAD_SLOT)


def judge_route(name, out, y, x, a, b, widths, slots, add_inputs, taken,
                route="GEMV route") -> KernelResult:  # fmt: skip
    """A case of one of the torch path's own routes: the route ran (``taken``, what its
    function returned), rows without LoRA bit-identical, every value of the bad
    adapter's rows NaN, the others finite and within BF16_REL_TOL of float64 (an empty
    slot's rows: y, or 0 written)."""
    import torch

    start = y.double() if add_inputs else torch.zeros_like(y, dtype=torch.float64)
    reference = _reference(start.clone(), x, a, b, widths, slots)
    plain, bad = slots < 0, slots == GEMV_BAD_SLOT
    good = ~plain & ~bad
    untouched = torch.equal(out[plain].view(torch.int16), y[plain].view(torch.int16))
    contained = bool(torch.isnan(out[bad]).all())
    error, nonfinite = relative_error(out[good], reference[good]) if good.any() else (0.0, 0)
    nonfinite += int((~torch.isfinite(out[plain])).sum())
    ran = taken == [True]
    ok = ran and untouched and contained and nonfinite == 0 and error <= BF16_REL_TOL
    notes = [
        f"{route} taken" if ran else f"{route} NOT taken ({taken})",
        f"{int(plain.sum())} rows without LoRA " + ("bit-identical" if untouched else "CHANGED"),
        f"{int(bad.sum())} rows of the bad adapter " + ("NaN" if contained else "NOT all NaN"),
    ]
    return KernelResult(name, ok, error, nonfinite, "; ".join(notes))


# ----- the torch path's GEMMs narrowed to the batch's own slots: prefill-sized calls -----

ACTIVE_TOKENS = (1024, 4096)  # two ACTIVE_MIN_TOKENS and a chunk of a long prompt
# Adapter ids as GEMV_ROWS: the bad adapter's, no LoRA, the empty slot's, a good one's
# (slots 3, none, 6, 1: three of the eight, so the batch is narrowed)
ACTIVE_ROWS = (4, 0, 7, 2)


def active_slot_cases(seed: int) -> list[KernelResult]:
    """The torch path's GEMMs narrowed to the batch's slots, through the installed
    wrapper's add_lora_linear, against the float64 reference: 1,024 and 4,096 tokens on
    three of eight slots (a good adapter, the empty slot, the non-finite one) and rows
    without LoRA, every slice count, adding and writing. A case passes only if the
    call was narrowed, rows without LoRA are bit-identical, the bad adapter's rows are
    NaN and the others are close."""
    name = "add_lora_linear [torch] active-slot GEMMs"
    if installed_backend() != "torch":
        return [not_counted(name, NOT_INSTALLED)]
    module = importlib.import_module(TORCH_OPS)
    if not hasattr(module, "ACTIVE_MIN_WORK"):  # a tree patched by an earlier patchkit
        return [not_counted(name, "this tree's torch path predates it (`patchkit apply` again)")]
    off = "" if module.ACTIVE_ONLY else f"narrowing is off here ({module.ACTIVE_ENV}=0)"
    return _route_run(seed, module, ACTIVE, off)


@dataclass(frozen=True)
class Route:
    """One of the torch path's own routes, as its cases run it."""

    label: str  # in the case names: "GEMV route"
    function: str  # the module's function that takes the call or answers False
    switch: str  # the module's flag that turns it on (read at import)
    tokens: tuple[int, ...]  # the calls' token counts
    add_inputs: tuple[bool, ...]  # adding, and writing (vLLM's dual stream) where it runs
    prefill: bool  # the batch's LoRAMapping
    seed: int  # added to verify's seed: each route its own numbers
    rows: tuple[int, ...]  # the adapter ids the batch's tokens take in turn
    # module values set for the run besides the switch: the cases check what the route
    # computes, not whether this shape's call would pick it
    settings: tuple[tuple[str, object], ...] = ()


GEMV = Route("GEMV route", "gemv_linear", "GEMV_ENABLED", GEMV_TOKENS, (True, False), False, 2,
             GEMV_ROWS)  # fmt: skip
ACTIVE = Route("active-slot GEMMs", "active_slots", "ACTIVE_ONLY", ACTIVE_TOKENS, (True, False),
               True, 3, ACTIVE_ROWS, (("ACTIVE_MIN_WORK", 0),))  # fmt: skip


def _route_run(seed: int, module, route: Route, off: str) -> list[KernelResult]:
    """The route's cases through a new wrapper: every slice count (GEMV_WIDTHS), the
    GEMV cases' adapters with a poisoned one, each token count; the route switched on
    for the run (before the wrapper exists: its slot masks are built for it then)
    and the route's function spied on, so a case knows whether the route ran; the
    route's other settings held for the run too. `off`:
    why this install does not run the route ("" when it does); its cases then run
    and are said, but do not count."""
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    gen = torch.Generator(device="cuda").manual_seed(seed + route.seed)
    hidden, max_rank, max_loras = 4096, 64, 8
    function = getattr(module, route.function)
    held = {name: getattr(module, name) for name in (route.switch, *dict(route.settings))}
    taken: list[bool] = []

    def spy(*args):  # what the function returned: True, or a value that is not None
        answer = function(*args)
        taken.append(answer is not None and answer is not False)
        return answer

    results = []
    for name, value in ((route.switch, True), *route.settings):
        setattr(module, name, value)
    setattr(module, route.function, spy)
    try:
        config = LoRAConfig(max_lora_rank=max_rank, max_loras=max_loras)
        wrapper = PunicaWrapperGPU(max(256, *route.tokens), 8, "cuda", lora_config=config)
        ids = list(range(1, max_loras + 1))  # slot i holds adapter id i + 1
        for n, widths in enumerate(GEMV_WIDTHS):
            a, b = _gemv_adapters(gen, widths, hidden, max_rank, max_loras)
            layer = _adopted(wrapper, a, b)
            _poison(layer, n)
            for tokens in route.tokens:
                mapping = [route.rows[(n + i) % len(route.rows)] for i in range(tokens)]
                wrapper.update_metadata(
                    LoRAMapping(tuple(mapping), tuple(mapping), is_prefill=route.prefill), ids,
                    max_loras, 4096,
                )  # fmt: skip
                x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
                y = torch.randn(tokens, sum(widths), generator=gen, device="cuda")
                y = y.to(torch.bfloat16)
                slots = torch.tensor([i - 1 for i in mapping], device="cuda")
                for add_inputs in route.add_inputs:
                    taken.clear()
                    out = y.clone()
                    wrapper.add_lora_linear(out, x, layer.lora_a_stacked, layer.lora_b_stacked,
                                            1.0, widths, add_inputs=add_inputs)  # fmt: skip
                    torch.cuda.synchronize()
                    how = "adding" if add_inputs else "writing"
                    name = (f"add_lora_linear [torch] {route.label} T={tokens} "
                            f"{len(widths)} slice(s), {how}")  # fmt: skip
                    results.append(judge_route(name, out, y, x, a, b, widths, slots, add_inputs,
                                               taken, route=route.label))  # fmt: skip
            layer.reset_lora(GEMV_BAD_SLOT)  # the next layer's masks start clean
    finally:
        for name, value in held.items():
            setattr(module, name, value)
        setattr(module, route.function, function)
    for result in results:
        result.counts = not off
        result.detail = "; ".join(d for d in (result.detail, off) if d)
    return results
