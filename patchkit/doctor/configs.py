"""Which kernel configs vLLM's host code picks: the calls the scan makes, and their results.

A *call* is one use of a vLLM LoRA op as a model layer makes it: the op
(``lora_shrink`` + ``lora_expand`` as ``add_lora_linear`` pairs them, the
MoE ``add_lora_w13`` / ``add_lora_w2`` of the punica wrapper, the fp8 ops),
tensors of the model's shapes, a batch size, an adapter rank and the
settings it runs under. The call runs vLLM's own Python (see
:mod:`patchkit.doctor.standins`) for each Hopper GPU, and every kernel
launch it makes is captured (:mod:`patchkit.doctor.signatures`). So the
block sizes, stages, warps, fast paths and specialisations are the ones
vLLM picks, tuned-config files included, for this tree.

The shapes: by default the two models this project serves, Qwen3.5-27B
(dense layers) and Qwen3.5-35B-A3B (MoE layers), at adapter ranks 16 and
64; ``doctor --kernels --model DIR`` reads a model's config.json instead
(and ``--adapter DIR`` its adapters' ranks).
"""

from __future__ import annotations

import inspect
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.adapters.adapterconfig import read_ranks
from patchkit.adapters.modelshapes import ModelConfigInvalid
from patchkit.doctor.signatures import Launch, capturing
from patchkit.doctor.standins import Gpu, Sandbox
from patchkit.errors import FileProblem
from patchkit.fs.files import read_json_file

# A decode step of 1 and of 16 sequences (1 is a constant to Triton, 16 divisible by
# 16; the MoE layer takes its small-batch and naive paths there), a prefill of 1000
# tokens (not 16-divisible) and a 4096-token prefill chunk.
BATCHES = (1, 16, 1000, 4096)
MAX_LORAS = 4  # vLLM's --max-loras default is 1; 4 serves several adapters at once
MAX_TOKENS = 8192  # max_num_batched_tokens: sizes the metadata buffers only
OPS = "vllm.lora.ops.triton_ops"
PUNICA = "vllm.lora.punica_wrapper.punica_gpu"
# The module matmul-add-lora-linear creates beside the punica wrapper: its decode
# route launches Triton GEMV kernels of its own (gemv_linear).
TORCH_PATH = "vllm.lora.punica_wrapper.patchkit_lora_matmul"
DUAL_STREAM = "VLLM_LORA_ENABLE_DUAL_STREAM"
NO_PDL = "VLLM_LORA_DISABLE_PDL"
INVARIANT = "VLLM_BATCH_INVARIANT"
# name: (environment overlay, expand writes instead of adding). The dual-stream LoRA
# path runs LoRA on a second CUDA stream and writes its delta, with PDL unless
# disabled; batch-invariant mode (read when vLLM imports its ops) splits the shrink
# without atomics (0.32+: a separate reduce kernel).
SETTINGS = {
    "default": ({DUAL_STREAM: "0", INVARIANT: "0"}, False),
    "batch-invariant": ({DUAL_STREAM: "0", INVARIANT: "1"}, False),
    "dual-stream": ({DUAL_STREAM: "1", NO_PDL: "0", INVARIANT: "0"}, True),
    "dual-stream-no-pdl": ({DUAL_STREAM: "1", NO_PDL: "1", INVARIANT: "0"}, True),
}


class Absent(Exception):
    """The op this call uses is not in this release: the call does not apply."""


DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class ScanGap(Exception):
    """vLLM's code asks for something the scan does not provide (a new parameter, say)."""


@dataclass(frozen=True)
class Model:
    """The shapes the LoRA ops are called with (0 where a model has no such layer)."""

    name: str
    hidden: int
    dtype: str = "bfloat16"
    ranks: tuple[int, ...] = (16, 64)
    intermediate: int = 0  # dense MLP
    q: int = 0  # attention projection widths
    kv: int = 0
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    key_dim: int = 0  # linear attention (Qwen3.5's GDN layers): heads x head size
    value_dim: int = 0
    v_heads: int = 0


DEFAULT_MODELS = (
    Model(
        "Qwen3.5-27B (dense layers)",
        hidden=5120,
        intermediate=17408,
        q=6144,
        kv=1024,
        key_dim=16 * 128,
        value_dim=48 * 128,
        v_heads=48,
    ),  # fmt: skip
    Model("Qwen3.5-35B-A3B (MoE layers)", hidden=2048, experts=256, top_k=8, moe_intermediate=512),
)


def model_from_dir(directory: Path, adapters: Iterable[Path] = ()) -> Model:
    """A model's shapes from its config.json (``text_config`` of a multimodal one).

    Ranks come from the adapters' adapter_config.json (``r`` and any
    ``rank_pattern``), else the default 16 and 64.
    """
    path = Path(directory) / "config.json"
    config = _json_object(path)
    try:
        return _model_of(config, directory, adapters)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        what = f"not the config of a model doctor can scan ({exc!r})"
        raise ModelConfigInvalid(path, what) from None


def _model_of(config: dict, directory: Path, adapters: Iterable[Path]) -> Model:
    text = config.get("text_config") or config
    hidden = int(text["hidden_size"])
    heads = int(text.get("num_attention_heads") or 0)
    head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
    experts = (
        text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts")
    )
    dtype = text.get("torch_dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16"
    ranks = sorted({r for a in adapters for r in adapter_ranks(Path(a))}) or Model.ranks
    v_heads = int(text.get("linear_num_value_heads") or 0)
    return Model(
        name=str(config.get("_name_or_path") or Path(directory).name),
        hidden=hidden,
        dtype=str(dtype).replace("torch.", ""),
        ranks=tuple(ranks),
        intermediate=int(
            (text.get("shared_expert_intermediate_size") if experts else None)
            or (text.get("intermediate_size") if not experts else 0)
            or 0
        ),
        q=heads * head_dim,
        kv=int(text.get("num_key_value_heads") or heads) * head_dim,
        experts=int(experts or 0),
        top_k=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate=int(text.get("moe_intermediate_size") or 0),
        key_dim=int(text.get("linear_num_key_heads") or 0)
        * int(text.get("linear_key_head_dim") or 0),
        value_dim=v_heads * int(text.get("linear_value_head_dim") or 0),
        v_heads=v_heads,
    )


def adapter_ranks(directory: Path) -> set[int]:
    """r and the rank_pattern ranks, read by `adapter check`'s and `verify`'s reader and rule
    (patchkit.adapters.adapterconfig): "8" and 4.7 are refused there, not read as 8 and 4."""
    return read_ranks(Path(directory))


def _json_object(path: Path) -> dict:
    """A model's or adapter's JSON object, or one line naming the file.

    A missing key or a string where a number belongs raised KeyError or
    ValueError (exit 3), and a FIFO named config.json hung doctor.
    """
    try:
        data = read_json_file(path, user=True)
    except OSError as exc:
        raise FileProblem(path, f"cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise FileProblem(path, f"unusable ({exc})") from None
    if not isinstance(data, dict):
        raise FileProblem(path, "not a JSON object")
    return data


@dataclass(frozen=True)
class Call:
    """One use of a vLLM LoRA op, as a model layer makes it."""

    family: str  # dense | moe | fp8
    entry: str  # the vLLM function the scan calls
    layer: str  # "qkv_proj (3 slices)"
    tokens: int
    rank: int
    dtype: str  # the model's: bf16 | fp16
    setting: str = ""  # a key of SETTINGS, "fully-sharded", or "" (any)
    run: Callable[[Sandbox], None] = field(compare=False, repr=False, default=None)

    @property
    def environment(self) -> dict[str, str]:
        return SETTINGS.get(self.setting, ({}, False))[0]

    def label(self) -> str:
        setting = f", {self.setting}" if self.setting not in ("", "default") else ""
        return (
            f"{self.entry} {self.layer}, {self.tokens} tokens, rank {self.rank}, "
            f"{self.dtype}{setting}"
        )


@dataclass
class Evaluation:
    """What one call did on one GPU: the launches it made, or why it stopped."""

    call: Call
    gpu: Gpu
    launches: list[Launch] = field(default_factory=list)
    approximate: list[str] = field(default_factory=list)  # stand-ins it leaned on
    leaned: dict[str, list[str]] = field(default_factory=dict)  # per launch: those used before it
    read: dict[str, list[str]] = field(default_factory=dict)  # per launch: files read before it
    files: list[str] = field(default_factory=list)  # files vLLM's code read (tuned configs)
    error: str = ""
    vllm_raises: bool = False  # the error is vLLM's own: it would fail the same way
    absent: bool = False  # the op is not in this release


# ----- the calls -----


def calls(models: Iterable[Model], settings: Iterable[str]) -> list[Call]:
    """Every call of the scan: dense and MoE layers of each model, and the fp8 ops."""
    found = []
    for model in models:
        found += dense_calls(model, tuple(settings))
        found += gemv_calls(model, tuple(settings))
        found += moe_calls(model)
        found += fp8_calls(model)
    return found


def dense_layers(model: Model) -> list[tuple[str, int, tuple[int, ...]]]:
    """(name, input width, output slices) of the linear layers a LoRA adapter targets."""
    layers = []
    if model.q:
        layers.append(("qkv_proj", model.hidden, (model.q, model.kv, model.kv)))
        layers.append(("o_proj", model.q, (model.hidden,)))
    if model.intermediate:
        layers.append(("gate_up_proj", model.hidden, (model.intermediate, model.intermediate)))
        layers.append(("down_proj", model.intermediate, (model.hidden,)))
    return layers


def _grid(model: Model, settings) -> Iterator[tuple[str, bool, int, int]]:
    """(setting, add_inputs, rank, tokens) in the order the scan reports its calls."""
    for setting in settings:
        writes = SETTINGS[setting][1]
        for rank in model.ranks:
            for tokens in BATCHES:
                yield setting, not writes, rank, tokens


def _layer_label(name: str, slices: tuple[int, ...]) -> str:
    return f"{name} ({len(slices)} slice{'s' if len(slices) > 1 else ''})"


def dense_calls(model: Model, settings: tuple[str, ...]) -> list[Call]:
    """``add_lora_linear`` (shrink into an fp32 buffer, expand from it) and
    ``add_lora_embedding`` (expand from the model dtype), per layer, batch, rank, setting."""
    dtype = DTYPES[model.dtype]
    found = []
    for setting, add_inputs, rank, tokens in _grid(model, settings):
        for name, width, slices in dense_layers(model):
            run = _linear(model, width, slices, tokens, rank, add_inputs)
            label = _layer_label(name, slices)
            found.append(
                Call("dense", "lora_shrink+lora_expand", label, tokens, rank, dtype, setting, run)
            )
        if dense_layers(model):  # embeddings always add (the setting decides PDL)
            run = _embedding(model, tokens, rank, True)
            label = "embed_tokens (model-dtype input)"
            found.append(Call("dense", "lora_expand", label, tokens, rank, dtype, setting, run))
    return found


def _linear(model, width, slices, tokens, rank, add_inputs):
    def run(box: Sandbox) -> None:
        torch, ops, meta = box.torch, box.module(OPS), _meta(box, tokens)
        dtype = getattr(torch, model.dtype)
        x = box.tensor((tokens, width), dtype)
        y = box.tensor((tokens, sum(slices)), dtype)
        a = tuple(box.tensor((MAX_LORAS, 1, rank, width), dtype) for _ in slices)
        b = tuple(box.tensor((MAX_LORAS, 1, n, rank), dtype) for n in slices)
        buffer = box.tensor((len(slices), tokens, rank), torch.float32)  # as add_lora_linear
        ops.lora_shrink(x, a, buffer, *meta, 1.0)
        ops.lora_expand(buffer, b, y, *meta, offset_start=0, add_inputs=add_inputs)

    return run


# The GEMV route (matmul-add-lora-linear's gemv_linear) takes a call of at most
# min(GEMV_MAX_TOKENS, max_loras) tokens: every row count 1..8 is scanned, on 8 and 16
# slots (and the 1 token one slot admits). The slot count is the slot weights' row
# stride, which Triton specialises (1 becomes a constant, a multiple of 16 is marked
# divisible), so these three reach every specialisation a slot count can give.
GEMV_MAX_TOKENS = 8  # the module's GEMV_MAX_TOKENS (a test compares them)
GEMV_SLOTS = (1, 8, 16)
# Every max_lora_rank vLLM admits (vllm/config/lora.py MaxLoRARanks, the same in every
# tested release; a test reads each tree's): the stacked weights have this rank, and
# gemv_block_r maps them to every BLOCK_R (16, 32, 64, 128); rank 1 is a constant to
# Triton, 8 is not divisible by 16.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The settings the route can run under: adding into y, and writing it (vLLM's dual
# stream; with or without PDL is the same call to gemv_linear, which reads neither).
GEMV_SETTINGS = ("default", "dual-stream")


def gemv_calls(model: Model, settings: tuple[str, ...]) -> list[Call]:
    """The torch path's ``add_lora_linear`` (matmul-add-lora-linear) per layer, rank,
    row count and slot count, adding and writing: its own host code (``gemv_linear``)
    decides whether the GEMV kernels run and with which configs. Every row count the
    route takes, every rank vLLM admits and every slice count of the model's layers
    (1-4 with Qwen3.5's in_proj_qkvz). Absent where the patch is not applied; not under
    batch invariance, where the torch path is off."""
    dtype = DTYPES[model.dtype]
    found = []
    ranks = sorted(set(VLLM_RANKS) | set(model.ranks))
    for setting in (s for s in GEMV_SETTINGS if s in settings):
        add_inputs = not SETTINGS[setting][1]
        for rank in ranks:
            for slots, tokens in gemv_batches():
                for name, width, slices in gemv_layers(model):
                    run = _gemv(model, width, slices, tokens, rank, add_inputs, slots)
                    label = f"{_layer_label(name, slices)}, {slots} slots"
                    found.append(
                        Call("gemv", "patchkit gemv_linear", label, tokens, rank, dtype, setting,
                             run)
                    )  # fmt: skip
    return found


def gemv_batches() -> list[tuple[int, int]]:
    """(slots, tokens): every row count the GEMV route takes on each slot count."""
    return [(s, t) for s in GEMV_SLOTS for t in range(1, min(GEMV_MAX_TOKENS, s) + 1)]


def gemv_layers(model: Model) -> list[tuple[str, int, tuple[int, ...]]]:
    """The dense layers, and Qwen3.5's linear-attention projections where the model has
    them: in_proj_qkvz (four slices: q, k, v, z) and in_proj_ba (two)."""
    layers = dense_layers(model)
    if model.key_dim and model.value_dim:
        qkvz = (model.key_dim, model.key_dim, model.value_dim, model.value_dim)
        layers.append(("in_proj_qkvz", model.hidden, qkvz))
        layers.append(("in_proj_ba", model.hidden, (model.v_heads, model.v_heads)))
    return layers


def _gemv(model, width, slices, tokens, rank, add_inputs, slots):
    """The tensors the torch path hands gemv_linear: A of the slices in one storage, B
    rank-major (as adopt_layer lays them out), the batch's slot weights."""

    def run(box: Sandbox) -> None:
        if not (box.root / (TORCH_PATH.replace(".", "/") + ".py")).is_file():
            raise Absent(TORCH_PATH)
        torch, module = box.torch, box.module(TORCH_PATH)
        dtype = getattr(torch, model.dtype)
        x = box.tensor((tokens, width), dtype)
        y = box.tensor((tokens, sum(slices)), dtype)
        a_all = box.tensor((len(slices), slots, 1, rank, width), dtype)
        a = [a_all[s] for s in range(len(slices))]
        b = [box.tensor((slots, 1, rank, n), dtype).transpose(2, 3) for n in slices]
        weights = box.tensor((MAX_TOKENS, slots), dtype)
        module.GEMV_ENABLED = True  # as installed unless PATCHKIT_LORA_GEMV=0
        if not module.gemv_linear(y, x, a, b, weights, 1.0, add_inputs):
            raise ScanGap(f"gemv_linear declined {tokens} tokens on {slots} slots")

    return run


def _embedding(model, tokens, rank, add_inputs):
    def run(box: Sandbox) -> None:
        torch, ops = box.torch, box.module(OPS)
        dtype = getattr(torch, model.dtype)
        x = box.tensor((1, tokens, rank), dtype)  # the looked-up A rows, as add_lora_embedding
        b = (box.tensor((MAX_LORAS, 1, model.hidden, rank), dtype),)
        y = box.tensor((tokens, model.hidden), dtype)
        ops.lora_expand(x, b, y, *_meta(box, tokens), offset_start=0, add_inputs=add_inputs)

    return run


def _meta(box: Sandbox, tokens: int) -> tuple:
    """vLLM's own LoRAKernelMeta buffers for ``tokens`` tokens (meta_args, as punica passes)."""
    metadata = box.module(f"{OPS}.lora_kernel_metadata").LoRAKernelMeta
    meta = metadata.make(MAX_LORAS, MAX_TOKENS, device="meta")
    accepted = inspect.signature(meta.meta_args).parameters
    return meta.meta_args(tokens, *([False] if len(accepted) > 1 else []))


def moe_calls(model: Model) -> list[Call]:
    """The MoE layer's two LoRA steps (gate_up then down), per batch and rank; and the
    same with fully-sharded LoRA (``--fully-sharded-loras``), where vLLM takes its
    two-kernel path."""
    if not model.experts:
        return []
    dtype = DTYPES[model.dtype]
    found = []
    for sharded in (False, True):
        setting = "fully-sharded" if sharded else ""
        for rank in model.ranks:
            for tokens in BATCHES:
                run = _moe(model, tokens, rank, sharded)
                layer = f"experts ({model.experts} experts, top-{model.top_k})"
                found.append(
                    Call(
                        "moe", "add_lora_w13+add_lora_w2", layer, tokens, rank, dtype, setting, run
                    )
                )
    return found


def _moe(model: Model, tokens: int, rank: int, sharded: bool):
    def run(box: Sandbox) -> None:
        punica = box.module(PUNICA).PunicaWrapperGPU
        wrapper = _Wrapper(punica, box, tokens)
        torch, dtype = box.torch, getattr(box.torch, model.dtype)
        e, k, inter, hidden = model.experts, model.top_k, model.moe_intermediate, model.hidden
        shared = dict(
            topk_weights=box.tensor((tokens, k), torch.float32),
            w1=box.tensor((e, 2 * inter, hidden), dtype), w2=box.tensor((e, hidden, inter), dtype),
            num_tokens=tokens, top_k_num=k, top_k=k, max_loras=MAX_LORAS,
            adapter_enabled=box.tensor((MAX_LORAS + 1,), torch.int32),
            fully_sharded=sharded, add_inputs=True,
            use_tuned_config=bool(box.settings.get("VLLM_TUNED_CONFIG_FOLDER")),
            expert_map=None, tp_rank=0, local_num_experts=e,
        )  # fmt: skip
        w13 = dict(
            shared,
            y=box.tensor((tokens, k, 2 * inter), dtype), x=box.tensor((tokens, hidden), dtype),
            lora_a_stacked=tuple(box.tensor((MAX_LORAS, e, rank, hidden), dtype) for _ in "gu"),
            lora_b_stacked=tuple(box.tensor((MAX_LORAS, e, inter, rank), dtype) for _ in "gu"),
            topk_ids=box.tensor((tokens, k), torch.int32), num_slices=2, token_lora_mapping=None,
        )  # fmt: skip
        if not hasattr(punica, "add_lora_w13"):  # before 0.20: the layer picks the configs
            return _moe_by_op(box, wrapper, model, rank, w13, sharded)
        sorted_ids, expert_ids, padded, mapping = _bound(punica.add_lora_w13, wrapper, w13)
        w2 = dict(
            shared,
            y=box.tensor((tokens, k, hidden), dtype), x=box.tensor((tokens * k, inter), dtype),
            lora_a_stacked=(box.tensor((MAX_LORAS, e, rank, inter), dtype),),
            lora_b_stacked=(box.tensor((MAX_LORAS, e, hidden, rank), dtype),),
            sorted_token_ids_lora=sorted_ids, expert_ids_lora=expert_ids,
            num_tokens_post_padded_lora=padded, token_lora_mapping=mapping,
        )  # fmt: skip
        _bound(punica.add_lora_w2, wrapper, w2)

    return run


def _moe_by_op(box: Sandbox, wrapper, model: Model, rank: int, w13: dict, sharded: bool) -> None:
    """Releases whose MoE LoRA layer picks its own configs (vllm/lora/layers/fused_moe.py,
    not run by the scan): vLLM's get_lora_op_configs, alignment and add_lora_fused_moe,
    with the naive-assignment rule of later releases. Approximate, and labelled so."""
    box.used("the configs vllm/lora/layers/fused_moe.py picks (the scan uses get_lora_op_configs)")
    dtype = getattr(box.torch, model.dtype)
    e, k, inter, hidden, tokens = (
        model.experts,
        model.top_k,
        model.moe_intermediate,
        model.hidden,
        w13["num_tokens"],
    )
    punica = box.module(PUNICA).PunicaWrapperGPU
    w2 = dict(
        y=box.tensor((tokens, k, hidden), dtype), x=box.tensor((tokens * k, inter), dtype),
        lora_a_stacked=(box.tensor((MAX_LORAS, e, rank, inter), dtype),),
        lora_b_stacked=(box.tensor((MAX_LORAS, e, hidden, rank), dtype),),
    )  # fmt: skip
    naive = not sharded and tokens * k * 8 <= e * MAX_LORAS
    aligned = None
    for step, values, slices in (("w13", w13, 2), ("w2", w2, 1)):
        shrink = _moe_config(box, f"{step}_shrink", tokens, model, rank, slices)
        expand = _moe_config(box, f"{step}_expand", tokens, model, rank, slices)
        if aligned is None:
            aligned = wrapper.moe_lora_align_block_size(
                w13["topk_ids"], tokens, shrink["BLOCK_SIZE_M"], e, MAX_LORAS,
                w13["adapter_enabled"], None, naive_block_assignment=naive,
            )  # fmt: skip
        mapping, sorted_ids, expert_ids, padded = aligned
        if sorted_ids is not None:
            sorted_ids, expert_ids = sorted_ids.view(MAX_LORAS, -1), expert_ids.view(MAX_LORAS, -1)
        call = dict(
            values, y=values["y"].view(-1, k, values["y"].shape[-1]),
            topk_weights=w13["topk_weights"],
            sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=padded,
            max_lora_rank=rank, top_k_num=k, shrink_config=shrink, expand_config=expand,
            adapter_enabled=w13["adapter_enabled"], mul_routed_weight=step == "w2",
            fully_sharded=sharded, offset=0, token_lora_mapping=mapping,
        )  # fmt: skip
        _bound(punica.add_lora_fused_moe, wrapper, call)


class _Wrapper:
    """A PunicaWrapperGPU whose state is the scan's and whose methods are vLLM's."""

    def __init__(self, cls: type, box: Sandbox, tokens: int):
        metadata = box.module(f"{OPS}.lora_kernel_metadata").LoRAKernelMeta
        self._cls, self._box = cls, box
        self.max_loras = MAX_LORAS
        self.device = box.torch.device("meta")
        self.lora_config = types.SimpleNamespace(
            max_loras=MAX_LORAS, specialize_active_lora=False, fully_sharded_loras=False
        )
        self.token_mapping_meta = metadata.make(MAX_LORAS, MAX_TOKENS, device="meta")

    def __getattr__(self, name: str):
        method = getattr(self._cls, name, None)
        if callable(method):
            return types.MethodType(method, self)
        self._box.used(f"PunicaWrapperGPU.{name}")
        raise ScanGap(f"vLLM's PunicaWrapperGPU reads self.{name}, which the scan does not set")


def _bound(function, wrapper, values: dict):
    """Call a vLLM method of ``wrapper`` with the arguments its signature names."""
    return _call_by_name(types.MethodType(function, wrapper), values)


def fp8_calls(model: Model) -> list[Call]:
    """The fp8 LoRA ops (w8a8, tensor-wise scales), single-slice, per batch and rank."""
    if not (model.intermediate or model.experts):
        return []
    dtype = DTYPES[model.dtype]
    found = []
    for rank in model.ranks:
        for tokens in BATCHES:
            if model.intermediate:
                found.append(
                    Call(
                        "fp8",
                        "lora_shrink_fp8+lora_expand_fp8",
                        "down_proj (1 slice)",
                        tokens,
                        rank,
                        dtype,
                        "",
                        _fp8_linear(model, tokens, rank),
                    )
                )
            if model.experts:
                found.append(
                    Call(
                        "fp8",
                        "fused_moe_lora_fp8",
                        "experts, down (sorted tokens)",
                        tokens,
                        rank,
                        dtype,
                        "",
                        _fp8_moe(model, tokens, rank),
                    )
                )
    return found


def _fp8_linear(model: Model, tokens: int, rank: int):
    def run(box: Sandbox) -> None:
        torch, ops, meta = box.torch, box.module(OPS), _meta(box, tokens)
        if not hasattr(ops, "lora_shrink_fp8"):
            raise Absent("lora_shrink_fp8")
        fp8, dtype = torch.float8_e4m3fn, getattr(torch, model.dtype)
        width, n = model.intermediate, model.hidden
        x = box.tensor((tokens, width), fp8)
        a = (box.tensor((MAX_LORAS, 1, rank, width), fp8),)
        b = (box.tensor((MAX_LORAS, 1, n, rank), fp8),)
        scale = box.tensor((1,), torch.float32)
        lora_scales = [box.tensor((MAX_LORAS,), torch.float32)]
        buffer = box.tensor((1, tokens, rank), torch.float32)
        ops.lora_shrink_fp8(x, a, buffer, *meta, 1.0, lora_scales, a_scale=scale, use_fp8_w8a8=True)
        shrunk = box.tensor((1, tokens, rank), fp8)
        y = box.tensor((tokens, n), dtype)
        ops.lora_expand_fp8(
            shrunk, b, y, *meta, lora_scales, a_scale=scale, offset_start=0, add_inputs=True,
            use_fp8_w8a8=True,
        )  # fmt: skip

    return run


def import_settings(settings: dict[str, str]) -> tuple:
    """The settings vLLM reads when it imports its LoRA ops (they need a sandbox each)."""
    return ((INVARIANT, settings.get(INVARIANT, "0")),)


def runs_here(call: Call, environ: dict[str, str]) -> tuple[bool, str]:
    """Whether vLLM makes this call in this environment, as far as settings tell; why not."""
    if call.setting not in SETTINGS:
        return True, ""  # no setting decides it (a serve flag like --fully-sharded-loras counts)
    dual, no_pdl, invariant = (_flag(environ.get(n)) for n in (DUAL_STREAM, NO_PDL, INVARIANT))
    active = "default" if not dual else "dual-stream-no-pdl" if no_pdl else "dual-stream"
    if active == "default" and invariant:
        active = "batch-invariant"
    if call.setting == active:
        return True, ""
    if call.family == "gemv" and (call.setting, active) == ("dual-stream", "dual-stream-no-pdl"):
        return True, ""  # the same gemv_linear call: the route reads neither flag
    if call.setting == "default":
        return False, f"{DUAL_STREAM} or {INVARIANT} is set here"
    if call.setting == "batch-invariant":
        return False, f"batch-invariant mode is off ({INVARIANT})"
    if call.setting == "dual-stream":
        return False, f"dual-stream LoRA with PDL is off ({DUAL_STREAM}, {NO_PDL})"
    return False, f"dual-stream LoRA without PDL is off ({DUAL_STREAM}, {NO_PDL})"


def _flag(value: str | None) -> bool:
    """As vLLM's envs.py reads these flags: an integer, true unless 0."""
    try:
        return bool(int(value or "0"))
    except ValueError:
        return False


def _fp8_moe(model: Model, tokens: int, rank: int):
    """The MoE down projection through the fp8 op, with the configs vLLM's
    get_lora_op_configs gives it and tokens sorted by vLLM's own alignment code."""

    def run(box: Sandbox) -> None:
        torch, fp8 = box.torch, box.torch.float8_e4m3fn
        e, k, inter, hidden = model.experts, model.top_k, model.moe_intermediate, model.hidden
        wrapper = _Wrapper(box.module(PUNICA).PunicaWrapperGPU, box, tokens)
        config = {
            op: _moe_config(box, f"w2_{op}", tokens, model, rank, 1) for op in ("shrink", "expand")
        }
        adapter_enabled = box.tensor((MAX_LORAS + 1,), torch.int32)
        mapping, sorted_ids, expert_ids, padded = wrapper.moe_lora_align_block_size(
            box.tensor((tokens, k), torch.int32), tokens, config["shrink"]["BLOCK_SIZE_M"], e,
            MAX_LORAS, adapter_enabled,
        )  # fmt: skip
        meta = wrapper.token_mapping_meta.meta_args(tokens, False)
        values = dict(
            output=box.tensor((tokens, k, hidden), getattr(torch, model.dtype)),
            qcurr_hidden_states=box.tensor((tokens * k, inter), fp8),
            lora_a_stacked=[box.tensor((MAX_LORAS, e, rank, inter), fp8)],
            lora_b_stacked=[box.tensor((MAX_LORAS, e, hidden, rank), fp8)],
            topk_weights=box.tensor((tokens, k), torch.float32),
            sorted_token_ids=sorted_ids.view(MAX_LORAS, -1),
            expert_ids=expert_ids.view(MAX_LORAS, -1), num_tokens_post_padded=padded,
            token_lora_mapping=mapping, max_lora_rank=rank, top_k_num=k, lora_ids=meta[4],
            num_active_loras=MAX_LORAS + 1, adapter_enabled=adapter_enabled,
            lora_a_scale_stacked=[box.tensor((MAX_LORAS, e), torch.float32)],
            lora_b_scale_stacked=[box.tensor((MAX_LORAS, e), torch.float32)],
            shrink_act_scale=box.tensor((1,), torch.float32),
            expand_act_scale=box.tensor((1,), torch.float32),
            mul_routed_weight=True, use_fp8_w8a8=True,
        )  # fmt: skip
        for op in ("shrink", "expand"):
            for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                         "NUM_WARPS", "NUM_STAGES", "SPLIT_K"):  # fmt: skip
                values[f"{op}_{name.lower()}"] = config[op][name]
        _call_by_name(box.module(f"{OPS}.fused_moe_lora_fp8_op")._fused_moe_lora_fp8, values)

    return run


def _moe_config(box: Sandbox, op: str, tokens: int, model: Model, rank: int, slices: int) -> dict:
    """vLLM's get_lora_op_configs for one MoE LoRA step ("w2_shrink"), keys as launched."""
    utils = box.module(f"{OPS}.utils")
    wanted = dict(
        op_type=f"fused_moe_lora_{op}", max_loras=MAX_LORAS, batch=tokens,
        hidden_size=model.hidden, rank=rank, num_slices=slices,
        moe_intermediate_size=model.moe_intermediate,
    )  # fmt: skip
    accepted = inspect.signature(utils.get_lora_op_configs).parameters
    found = dict(utils.get_lora_op_configs(**{k: v for k, v in wanted.items() if k in accepted}))
    config = {k.upper().replace("BLOCK_", "BLOCK_SIZE_"): v for k, v in found.items()}
    defaults = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8,
                    NUM_WARPS=4, NUM_STAGES=3, SPLIT_K=1)  # as add_lora_fused_moe  # fmt: skip
    return defaults | config


def _call_by_name(function, values: dict):
    """Call a vLLM function with the arguments its signature names, from ``values``."""
    kwargs = {}
    for p in inspect.signature(function).parameters.values():
        if p.name in values:
            kwargs[p.name] = values[p.name]
        elif p.default is inspect.Parameter.empty:
            raise ScanGap(f"{function.__qualname__} takes {p.name!r}, unknown to the scan")
    return function(**kwargs)


# ----- evaluating them -----


def evaluate(box: Sandbox, call: Call, gpu: Gpu, base: dict[str, str]) -> Evaluation:
    """Run one call's vLLM host code on ``gpu``; its launches, or the reason it stopped."""
    box.switch(gpu, {**base, **call.environment})
    result = Evaluation(call, gpu)
    so_far = lambda: (tuple(uses.dummies), tuple(uses.files))  # noqa: E731
    with box.recording() as uses, capturing(so_far) as launches:
        try:
            call.run(box)
        except Absent:
            result.absent = True
        except Exception as exc:  # vLLM's own error, or a gap in the stand-ins
            result.error = f"{type(exc).__name__}: {_first_line(exc)}"
            result.vllm_raises = _raised_by_vllm(exc, box) and not uses.dummies
    result.launches = [launch for launch, _ in launches]
    result.leaned = {launch.key: list(used) for launch, (used, _) in launches if used}
    result.read = {
        launch.key: sorted({_shown(Path(f), box.root) for f in files})
        for launch, (_, files) in launches
    }
    result.approximate = list(uses.dummies)
    result.files = sorted({_shown(Path(f), box.root) for f in uses.files})
    return result


def _shown(path: Path, root: Path) -> str:
    """A file vLLM's code read: relative to the tree when inside it (a copy reads the same)."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _raised_by_vllm(exc: Exception, box: Sandbox) -> bool:
    """Whether the innermost frame of the error is the tree's own code (not a stand-in's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).is_relative_to(box.root)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:200]
