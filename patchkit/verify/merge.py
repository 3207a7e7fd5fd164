"""The merged reference of `patchkit verify --model`: a LoRA adapter folded into the base weights.

`plan_merge(model_dir, adapter_dir)` reads only headers and small files and
says which checkpoint tensors each adapter module changes, with which scale,
and how many bytes the merged copy needs; `write_merged(plan, dest_dir)`
writes a checkpoint vLLM serves without LoRA: W + scale * (B @ A) for every
module (MoE experts included), computed in float32 and cast back to the
stored dtype. Neither imports vLLM; torch is imported inside functions.

What the merge follows (read in the vLLM 0.22.0, 0.26.0 and 0.33.0 wheels,
``~/.cache/patchkit-tests/vllm-<version>/``, and in PEFT's and transformers'
sources):

Adapter names. PEFT saves ``get_peft_model_state_dict`` (huggingface/peft
``src/peft/utils/save_and_load.py``): the PEFT model's parameter names with
the adapter name removed, ``base_model.model.<module>.lora_A.weight`` (r, in)
and ``.lora_B.weight`` (out, r); an ``nn.Embedding`` saves
``<module>.lora_embedding_A`` (r, num_embeddings) and ``lora_embedding_B``
(dim, r), delta ``(B @ A).T``. vLLM reads them the same way in all three
releases: ``vllm/lora/lora_model.py`` ``LoRAModel.from_local_checkpoint``
(``adapter_model.safetensors``, else ``.bin``/``.pt``) and
``vllm/lora/utils.py`` ``parse_fine_tuned_lora_name``, which strips
``base_model.model.``, renames with the model's ``hf_to_vllm_mapper`` and
splits off ``lora_A``/``lora_B``/``lora_embedding_A``/``lora_embedding_B``;
``*.embed_tokens.base_layer.weight`` and ``*.lm_head.base_layer.weight``
(full embedding copies PEFT may save) are skipped (``is_base_embedding_weights``).

Scale. PEFT (``src/peft/tuners/lora/layer.py`` ``update_layer``):
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; r and
alpha per module from ``rank_pattern``/``alpha_pattern``, the first key
matching ``(.*\\.)?(key)$`` against the module's name (``get_pattern_key``,
``src/peft/utils/other.py``; ``LoraModel._create_and_replace``), for
``target_parameters`` against the parameter's name. vLLM
(``vllm/lora/peft_helper.py`` ``PEFTHelper``, folded into lora_b by
``LoRALayerWeights.optimize`` in ``vllm/lora/lora_weights.py``): 0.22.0 and
0.26.0 (every release before 0.32.0) apply one scale, from the top-level r
and lora_alpha, to every module and never read the patterns; their
``PackedLoRALayerWeights.pack_moe`` (per-expert adapters) even uses
``lora_alpha / r`` under rsLoRA. 0.32.0/0.33.0 ``get_rank_and_scaling``
follow PEFT, with the fused experts matched as ``<experts>.gate_up_proj``
and ``<experts>.down_proj``. The merge follows PEFT (what the adapter
means) and the plan names every module where vLLM before 0.32 scales
differently, so a failed comparison there is explained.

What a Qwen3.5 adapter targets. HF module names (transformers
``src/transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py``; the dense
model is the same without the MoE block): attention ``q_proj`` (2 x heads x
head_dim rows: query and output gate), ``k_proj``, ``v_proj``, ``o_proj``;
Gated DeltaNet ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
``out_proj`` (``conv1d`` is a depthwise ``nn.Conv1d``, refused here); MLP and
shared expert ``gate_proj``, ``up_proj``, ``down_proj``, ``shared_expert_gate``;
``lm_head``, ``embed_tokens``; the router ``mlp.gate`` and the fused experts
are bare parameters, reachable only through PEFT ``target_parameters``. vLLM
fuses them (``packed_modules_mapping`` in
``vllm/model_executor/models/qwen3_5.py``: ``qkv_proj`` <- q/k/v_proj,
``gate_up_proj`` <- gate/up_proj, ``in_proj_qkvz`` <- in_proj_qkv/in_proj_z,
``in_proj_ba`` <- in_proj_b/in_proj_a; a qkv+z adapter is split over the
four ``in_proj_qkvz`` slices by ``expand_packed_lora`` in
``vllm/lora/layers/column_parallel_linear.py``); the merge works on the HF
names only, never on the fused ones. LoRA on ``embed_tokens``/``lm_head``
of Qwen3.5 is served from 0.29.0 on (``embedding_modules`` in qwen3_5.py;
0.22.0/0.26.0 do not list them as supported LoRA modules).

MoE checkpoint. transformers' ``Qwen3_5MoeExperts`` holds
``mlp.experts.gate_up_proj`` (E, 2 x moe_intermediate, hidden), gate rows
then up rows, and ``mlp.experts.down_proj`` (E, hidden, moe_intermediate),
applied as ``F.linear(x, W[e])``; also ``mlp.gate.weight`` (E, hidden),
``mlp.shared_expert.{gate,up,down}_proj.weight`` and
``mlp.shared_expert_gate.weight`` (1, hidden). vLLM's
``Qwen3_5Model.load_weights`` (qwen3_5.py) loads that fused layout (gate_up
chunked in two along dim -2 into w1/w3, not transposed) and the per-expert
layout ``mlp.experts.{e}.{gate,up,down}_proj.weight``
(``get_expert_mapping`` in ``qwen3_next.py``). The merge accepts both.

MoE LoRA. ``Qwen3_5MoeForConditionalGeneration.is_3d_moe_weight = True``, so
``vllm/lora/model_manager.py`` wraps the experts with ``FusedMoE3DWithLoRA``
(``vllm/lora/layers/fused_moe.py``) unless ``enable_mixed_moe_lora_format``
(0.22+; or ``enable_moe_shared_loras``, 0.26+) selects ``FusedMoEWithLoRA``.
The fused adapter is PEFT's ``target_parameters`` format:
``<experts>.base_layer.lora_{A,B}.weight`` is gate_up_proj and
``<experts>.lora_{A,B}.weight`` is down_proj (both required;
``_stack_moe_lora_weights``). vLLM reshapes lora_A to (E, r, in) and lora_B
(out, r*E) to (E, out, r), i.e. it reads gate_up A as (r*E, hidden) and B
as (2I, r*E): delta[e] = B[:, :, e] @ A[e]. PEFT's ``ParamWrapper``
(``peft/tuners/lora/layer.py``) writes that layout for Qwen3.5 from PEFT
0.20.0 on (it swaps in/out for 3-D parameters not marked ``is_transposed``;
transformers marks only (E, in, out) experts such as GPT-OSS's); PEFT
0.17-0.19 do not swap there and write A (r*E, out), B (in, r*E) with delta
``einsum("o r e, e r i -> e i o", B.reshape(in, r, E), A.reshape(E, r, out))``,
which vLLM 0.22-0.33 refuses or misreads. vLLM also asserts both wrappers,
so it cannot load an adapter on one of the two expert parameters (patchkit's
partial-moe-adapter reads one by its shapes and zeroes the other). Checked
by hand: transformers 5.24 with PEFT 0.19.0, 0.20.0 and 0.21.2, every merged
tensor bit-identical to PEFT's ``merge_and_unload`` (float32, cast to bf16).
The merge takes either layout, decided by the shapes (the PEFT >= 0.20 /
vLLM one when both fit), and the plan names the old one. transformers 5.24
fuses per-expert checkpoint tensors into these parameters at load and splits
them again in ``save_pretrained`` (``mlp.experts.{e}.{gate,up,down}_proj.weight``,
which is what it wrote for the check). PEFT nests the wrappers in
the parameters' registration order (``BaseTuner._inject_parameters``,
``src/peft/tuners/tuners_utils.py``): the innermost ``base_layer`` is
gate_up_proj, the outermost the last targeted parameter. Per-expert
adapters name ``<experts>.{e}.{gate,up,down}_proj`` (stacked by
``PackedLoRALayerWeights.pack_moe``), which a 3-D model accepts only
with ``enable_mixed_moe_lora_format`` (``_load_adapter`` in
``vllm/lora/worker_manager.py`` otherwise expects the module ``experts``).

Checkpoint layout. vLLM's ``DefaultModelLoader``
(``vllm/model_executor/model_loader/default_loader.py``) loads every tensor
of every ``*.safetensors`` file that ``model.safetensors.index.json`` names
(``filter_duplicate_safetensors_files`` in ``weight_utils.py``), never
per-tensor from the index; so a shard holding a changed tensor is rewritten
whole (same header, same offsets, only the merged tensors' bytes differ) and
the others are hard-linked, or symlinked where a hard link fails (another
file system, ``fs.protected_hardlinks``): linked shards cost no space, there
is no silent copy, and the plan's byte count is exact. Qwen3.5 checkpoints
name ``model.language_model.*`` (``Qwen3_5ForConditionalGeneration``; vLLM
maps that prefix to ``language_model.model.`` with Qwen3-VL's
``hf_to_vllm_mapper`` in ``qwen3_vl.py``) and ``lm_head.weight``; text-only
checkpoints ``model.*``. An adapter made on the other naming is merged onto
the checkpoint's names, with a note, because vLLM applies LoRA only to names
its mapper produces.

Refused (PatchkitError, one line): DoRA (``use_dora``, ``lora_magnitude_vector``:
the delta depends on a column norm and a magnitude vector, not B @ A; vLLM
refuses it too); trained biases (``bias`` other than "none": the adapter
carries replacement base biases) and ``lora_bias`` (a bias on lora_B);
``modules_to_save`` and ``trainable_token_indices`` (whole modules or rows
replaced, not a low-rank delta); ``init_lora_weights`` PiSSA/OLoRA/CorDA/LoftQ
(the adapter is relative to base weights PEFT changed at init);
``layer_replication``, aLoRA (``alora_invocation_tokens``: active only after
the invocation tokens), QALoRA and BD-LoRA (other deltas); other
``peft_type``s; a module without a base tensor, with a shape that does not
fit its base tensor, or whose rank differs from the config's; LoRA on a
non-floating (quantized) tensor or on a convolution; LoRA on ``lm_head`` or
``embed_tokens`` of a model with tied embeddings (the merged weight would
change both). Memory: tensors are processed in row blocks of at most
``_CHUNK_ELEMENTS`` and adapter factors are kept in a small LRU cache, so a
27B checkpoint never sits in memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import stat
import struct
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.errors import PatchkitError, os_error_line
from patchkit.fs.files import decode_user_json, read_user_json
from patchkit.fs.safepath import kind_of
from patchkit.verify.patterns import Matcher, compile_peft_key

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = ("adapter_model.bin", "adapter_model.pt")
PEFT_PREFIX = "base_model.model."

# Elements of one row block of a weight while it is merged (64 MiB in float32).
_CHUNK_ELEMENTS = 1 << 24
# Adapter factors (float32) kept between checkpoint tensors.
_CACHE_BYTES = 2 << 30
# Byte size of each safetensors dtype.
_DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_MERGEABLE = ("F32", "F16", "BF16", "F64")
# The largest safetensors header and model.safetensors.index.json read. Both
# hold one entry per tensor, about 100-150 bytes: a 5 GB shard of a per-expert
# MoE checkpoint, or a per-expert adapter of every expert of a 256-expert model
# (89,000 tensors), stays under 16 MB, and an index of 300,000 tensors under
# 32 MiB. A header parsed into Python objects takes several times its bytes,
# so the cap is also what bounds the memory a hostile file can take.
_MANIFEST_BYTES = 32 << 20
# adapter_config.json and config.json: PEFT's and transformers' are a few kB,
# a rank_pattern naming every module of a large model tens of kB.
_CONFIG_BYTES = 1 << 20
# Tensor dimensions (PyTorch tensors have at most 64; the product of the shape
# stays a small integer).
_MAX_DIMS = 64
# The fused expert parameters of Qwen3.5-MoE in registration order (PEFT nests
# target_parameters wrappers in this order: the first is the innermost base_layer).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
# The per-expert matrices of the same experts (gate_up_proj = gate_proj rows, then up_proj rows).
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
# vLLM's fused names, which HF checkpoints of Qwen3.5 do not hold.
_VLLM_FUSED = {
    "in_proj_qkvz": "in_proj_qkv and in_proj_z",
    "in_proj_ba": "in_proj_b and in_proj_a",
    "qkv_proj": "q_proj, k_proj and v_proj",
    "gate_up_proj": "gate_proj and up_proj",
}
_OK_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def _torch_dtype(name: str):
    import torch

    table = {
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F64": torch.float64,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
    if name not in table:
        raise PatchkitError(f"safetensors dtype {name} cannot be read as a torch tensor here")
    return table[name]


def _dtype_name(dtype) -> str:
    import torch

    table = {
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.float64: "F64",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    if dtype not in table:
        raise PatchkitError(f"torch dtype {dtype} has no safetensors name here")
    return table[dtype]


def _shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _tensor_bytes(t) -> bytes:
    """The raw bytes of a CPU tensor (no numpy needed)."""
    t = t.detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


# ---------------------------------------------------------------------------
# safetensors: an 8-byte little-endian header length, a JSON header, raw bytes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; begin/end are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """A safetensors file read lazily: the header at open, tensor bytes on request."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with _open_regular(self.path) as f:
                info = os.fstat(f.fileno())
                self.size, self._identity = info.st_size, (info.st_dev, info.st_ino)
                head = f.read(8)
                if len(head) < 8:
                    raise PatchkitError(
                        f"{self.path}: not a safetensors file (shorter than 8 bytes)"
                    )
                (length,) = struct.unpack("<Q", head)
                if length > _MANIFEST_BYTES or 8 + length > self.size:
                    raise PatchkitError(
                        f"{self.path}: not a safetensors file patchkit reads (header length "
                        f"{length} in a file of {self.size} bytes; at most {_MANIFEST_BYTES})"
                    )
                raw = f.read(length)
        except OSError as exc:
            raise PatchkitError(os_error_line(exc, "reading", path=self.path)) from exc
        try:
            header = decode_user_json(raw, _MANIFEST_BYTES)
        except ValueError as exc:
            raise PatchkitError(f"{self.path}: safetensors header unusable: {exc}") from None
        if not isinstance(header, dict):
            raise PatchkitError(f"{self.path}: safetensors header is not a JSON object")
        self.header_bytes = head + raw
        self.data_start = 8 + length
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise PatchkitError(f"{self.path}: safetensors __metadata__ is not a JSON object")
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            info = self._tensor_info(name, entry)
            size = _DTYPE_SIZES.get(info.dtype)
            if size is not None and info.numel * size != info.nbytes:
                raise PatchkitError(
                    f"{self.path}: {_shown(name)} is {info.dtype} {_shape(info.shape)} but "
                    f"holds {info.nbytes} bytes"
                )
            self.tensors[name] = info
        self._handle = None

    def _tensor_info(self, name: str, entry: object) -> TensorInfo:
        """One header entry, checked: a dtype name, a shape and two offsets inside the file."""
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
        if not (
            isinstance(dtype, str)
            and _counts(shape)
            and len(shape) <= _MAX_DIMS
            and _counts(offsets)
            and len(offsets) == 2
        ):
            raise PatchkitError(
                f"{self.path}: header entry {_shown(name)} is not "
                "{dtype: name, shape: [counts], data_offsets: [begin, end]}"
            )
        begin, end = offsets
        info = TensorInfo(name, dtype, tuple(shape), self.data_start + begin, self.data_start + end)
        if begin > end or info.end > self.size:
            raise PatchkitError(
                f"{self.path}: {_shown(name)} lies outside the file (bytes {begin}..{end} of "
                f"{self.size - self.data_start})"
            )
        return info

    def _file(self):
        """The file again for its tensors' bytes: the same file the header came from."""
        if self._handle is None:
            handle = _open_regular(self.path)
            info = os.fstat(handle.fileno())
            if (info.st_dev, info.st_ino) != self._identity:
                handle.close()
                raise PatchkitError(f"{self.path}: replaced since its header was read")
            self._handle = handle
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_bytes(self, begin: int, length: int) -> bytearray:
        f = self._file()
        f.seek(begin)
        buf = bytearray(length)
        if f.readinto(buf) != length:
            raise PatchkitError(f"{self.path}: truncated at byte {begin + length}")
        return buf

    def read_rows(self, name: str, row0: int, nrows: int):
        """Rows [row0, row0 + nrows) of a tensor viewed as (rows, shape[-1])."""
        import torch

        info = self.tensors[name]
        cols = info.shape[-1] if info.shape else 1
        item = _DTYPE_SIZES[info.dtype]
        dtype = _torch_dtype(info.dtype)
        if nrows * cols == 0:
            return torch.empty((nrows, cols), dtype=dtype)
        buf = self.read_bytes(info.begin + row0 * cols * item, nrows * cols * item)
        return torch.frombuffer(buf, dtype=dtype).reshape(nrows, cols)

    def tensor(self, name: str):
        """A whole tensor in its stored dtype (for adapter factors and small tensors)."""
        import torch

        info = self.tensors[name]
        dtype = _torch_dtype(info.dtype)
        if info.numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(self.read_bytes(info.begin, info.nbytes), dtype=dtype).reshape(
            info.shape
        )


def _open_regular(path: Path):
    """A regular file opened for reading; never waits on a FIFO, never opens a device.

    The type is checked before the open (a device is not opened at all) and on
    the descriptor (what was opened is what is read): a FIFO named like a weight
    file hung the read.
    """
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return os.fdopen(fd, "rb")
        os.close(fd)
    raise PatchkitError(f"{path}: {kind_of(mode)}, not a regular file")


def _counts(value: object) -> bool:
    """A JSON list of non-negative integers (no bools, no floats)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _shown(value: object, width: int = 80) -> str:
    """A value from a user's file for a one-line message: its repr (escaped), cut to width."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _user_json(path: Path, limit: int, what: str) -> dict:
    """A JSON object from a model or adapter file, or one line naming the file."""
    try:
        data = read_user_json(path, limit)
    except OSError as exc:
        raise PatchkitError(os_error_line(exc, "reading")) from None
    except ValueError as exc:
        raise PatchkitError(f"{path}: unusable as {what}: {exc}") from None
    if not isinstance(data, dict):
        raise PatchkitError(f"{path}: not a JSON object ({what} expected)")
    return data


def save_safetensors(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    """Write tensors (in the given order) as a safetensors file."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        data = _tensor_bytes(t)
        header[name] = {
            "dtype": _dtype_name(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)


# ---------------------------------------------------------------------------
# the base checkpoint and the adapter
# ---------------------------------------------------------------------------


def _safe_relname(name: str, where: Path) -> str:
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise PatchkitError(
            f"{where}: refuses weight file name {_shown(name)} outside the model directory"
        )
    return name


class _Checkpoint:
    """The base model directory: shards (headers only), index, config."""

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        if not model_dir.is_dir():
            raise PatchkitError(f"model directory {model_dir} does not exist")
        index = model_dir / INDEX_NAME
        self.index_meta: dict | None = None
        if index.is_file():
            data = _user_json(index, _MANIFEST_BYTES, "a safetensors index")
            weight_map, meta = data.get("weight_map"), data.get("metadata") or {}
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise PatchkitError(
                    f"{index}: weight_map is not a JSON object of tensor name to file name"
                )
            if not isinstance(meta, dict):
                raise PatchkitError(f"{index}: metadata is not a JSON object")
            self.index_meta = dict(meta)
            names = sorted({_safe_relname(v, index) for v in weight_map.values()})
        elif (model_dir / SINGLE_NAME).is_file():
            names = [SINGLE_NAME]
        else:
            names = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not names:
                raise PatchkitError(
                    f"{model_dir} holds no safetensors weights (model.safetensors or "
                    f"{INDEX_NAME}); the merge needs a safetensors checkpoint"
                )
        self.shards: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        for name in names:
            path = model_dir / name
            if not path.is_file():
                if not index.is_file():  # a FIFO or a dangling link found by the glob
                    raise PatchkitError(f"{path}: not a regular file (a weight file expected)")
                raise PatchkitError(f"{index}: names {_shown(name)}, which is not in {model_dir}")
            shard = SafetensorsFile(path)
            self.shards[name] = shard
            for key in shard.tensors:
                if key in self.where:
                    raise PatchkitError(
                        f"{model_dir}: tensor {key} is in both {self.where[key]} and {name}"
                    )
                self.where[key] = name
        self.config: dict = {}
        config = model_dir / "config.json"
        if config.is_file():
            self.config = _user_json(config, _CONFIG_BYTES, "a model config")

    def info(self, key: str) -> TensorInfo:
        return self.shards[self.where[key]].tensors[key]

    def has(self, key: str) -> bool:
        return key in self.where

    def tied_embeddings(self) -> bool:
        text = self.config.get("text_config")
        text = text if isinstance(text, dict) else {}
        return bool(self.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))

    def architecture(self) -> str:
        archs = self.config.get("architectures")
        first = archs[0] if isinstance(archs, list) and archs else ""
        return first if isinstance(first, str) else ""

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()


def _alternatives(name: str) -> list[str]:
    """The name, then the same module under the other Qwen3.5 naming (VL wrapper / text-only)."""
    vl = "model.language_model."
    if name.startswith(vl):
        return [name, "model." + name[len(vl) :]]
    if name.startswith("model.") and not name.startswith("model.visual."):
        return [name, vl + name[len("model.") :]]
    return [name]


@dataclass
class _AdapterConfig:
    path: Path
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    target_parameters: list[str]
    # Each pattern key, compiled (patterns.compile_peft_key): matched without backtracking.
    matchers: dict[str, Matcher] = field(default_factory=dict, repr=False)

    def _pattern(self, pattern: dict, name: str):
        """The value of the first key matching the name, PEFT's rule (get_pattern_key)."""
        for key, value in pattern.items():
            if self.matchers[key].match(name):
                return value
        return None

    def rank_alpha(self, name: str) -> tuple[int, float]:
        rank = self._pattern(self.rank_pattern, name)
        alpha = self._pattern(self.alpha_pattern, name)
        return (self.r if rank is None else int(rank)), (self.alpha if alpha is None else alpha)

    def scale(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @property
    def global_scale(self) -> float:
        return self.scale(self.r, self.alpha)


def read_adapter_config(adapter_dir: Path) -> _AdapterConfig:
    """The adapter's r, alpha and patterns, every value checked; one line naming the key if not.

    Read capped (1 MiB, FIFOs refused) and every pattern key compiled here,
    so what is refused is refused before any file is written or GPU touched.
    """
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        raise PatchkitError(f"adapter directory {adapter_dir} has no {ADAPTER_CONFIG}")
    cfg = _user_json(path, _CONFIG_BYTES, "a PEFT adapter config")

    def refuse(what: str) -> PatchkitError:
        return PatchkitError(f"{path}: {what}; patchkit merges plain LoRA adapters only")

    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise refuse(f"peft_type is {_shown(peft_type)[1:-1]}, not LORA")
    if cfg.get("use_dora"):
        raise refuse("use_dora is set (DoRA rescales columns by a magnitude vector)")
    if str(cfg.get("bias", "none")) != "none":
        raise refuse(f"bias is {_shown(cfg.get('bias'))} (the adapter trains base biases)")
    if cfg.get("lora_bias"):
        raise refuse("lora_bias is set (lora_B carries a bias)")
    if cfg.get("modules_to_save"):
        raise refuse(
            f"modules_to_save is {_shown(cfg['modules_to_save'])} (whole modules replaced)"
        )
    if cfg.get("trainable_token_indices"):
        raise refuse("trainable_token_indices is set (embedding rows replaced)")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _OK_INITS:
        raise refuse(
            f"init_lora_weights is {_shown(init)} (PiSSA/OLoRA/CorDA/LoftQ change the base weights "
            "at init; convert the adapter with PEFT's path_initial_model_for_weight_conversion)"
        )
    if cfg.get("layer_replication"):
        raise refuse("layer_replication is set")
    if cfg.get("alora_invocation_tokens"):
        raise refuse("alora_invocation_tokens is set (aLoRA acts only after its invocation tokens)")
    if cfg.get("use_qalora"):
        raise refuse("use_qalora is set")
    if cfg.get("use_bdlora"):
        raise refuse("use_bdlora is set")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    # 4.7 was read as 4, "8" and true as 8 and 1: only a number that is a whole rank counts
    if not _is_number(r) or r != int(r) or r <= 0:
        raise PatchkitError(f"{path}: r is {_shown(r)}; it must be a positive integer")
    if not _is_number(alpha):
        raise PatchkitError(f"{path}: lora_alpha is {_shown(alpha)}; it must be a number")
    use_rslora = cfg.get("use_rslora") or False
    if not isinstance(use_rslora, bool):  # "false" was read as true
        raise PatchkitError(f"{path}: use_rslora is {_shown(use_rslora)}, not true or false")
    rank_pattern = _mapping(path, cfg, "rank_pattern")
    alpha_pattern = _mapping(path, cfg, "alpha_pattern")
    for key, value in rank_pattern.items():
        if type(value) is not int or value <= 0:
            raise PatchkitError(
                f"{path}: rank_pattern[{_shown(key)}] is {_shown(value)}; ranks are "
                "positive integers"
            )
    for key, value in alpha_pattern.items():
        if not _is_number(value):
            raise PatchkitError(
                f"{path}: alpha_pattern[{_shown(key)}] is {_shown(value)}; a finite number"
            )
    target_parameters = cfg.get("target_parameters") or []
    if isinstance(target_parameters, str):
        target_parameters = [target_parameters]
    if not isinstance(target_parameters, list) or not all(
        isinstance(name, str) for name in target_parameters
    ):
        raise PatchkitError(f"{path}: target_parameters is not a list of parameter names")
    return _AdapterConfig(
        path=path,
        r=int(r),
        alpha=float(alpha),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern),
        alpha_pattern=dict(alpha_pattern),
        target_parameters=list(target_parameters),
        matchers=_matchers(path, rank_pattern, alpha_pattern),
    )


def _is_number(value: object) -> bool:
    """An int or a float, not a bool (JSON numbers: finite, read_user_json saw to that)."""
    return type(value) in (int, float) and math.isfinite(value)


def _matchers(path: Path, rank_pattern: dict, alpha_pattern: dict) -> dict[str, Matcher]:
    """Every pattern key compiled now, so a key that is refused is refused before any work.

    PEFT and vLLM run each key through Python's re, where ``(.|.)*(.|.)*Q``
    backtracks for ever; patterns.compile_peft_key matches the same names in
    linear time, or refuses the key.
    """
    matchers = {}
    for which, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        for key in pattern:
            if key not in matchers:
                try:
                    matchers[key] = compile_peft_key(key)
                except ValueError as exc:
                    raise PatchkitError(
                        f"{path}: {which} key {_shown(key)} is refused: {exc}"
                    ) from None
    return matchers


def _mapping(path: Path, cfg: dict, key: str) -> dict:
    """rank_pattern / alpha_pattern: an object, or one line (a list raised AttributeError)."""
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise PatchkitError(f"{path}: {key} is not a JSON object (module pattern to value)")
    return value


class _AdapterTensors:
    """The adapter's tensors: safetensors read lazily, or a .bin/.pt loaded whole."""

    def __init__(self, adapter_dir: Path):
        st = adapter_dir / ADAPTER_SAFETENSORS
        self._file: SafetensorsFile | None = None
        self._loaded: dict | None = None
        if st.is_file():
            self.path = st
            self._file = SafetensorsFile(st)
            self.shapes = {k: v.shape for k, v in self._file.tensors.items()}
            self.dtypes = {k: v.dtype for k, v in self._file.tensors.items()}
            return
        for name in ADAPTER_BIN:
            path = adapter_dir / name
            if path.is_file():
                import torch

                self.path = path
                try:
                    loaded = torch.load(path, map_location="cpu", weights_only=True)
                except Exception as exc:  # any unpickling failure: the user's file
                    raise PatchkitError(f"{path}: cannot be read as a state dict ({exc})") from exc
                if not isinstance(loaded, dict):
                    raise PatchkitError(f"{path}: not a state dict")
                self._loaded = loaded
                self.shapes = {k: tuple(v.shape) for k, v in loaded.items()}
                self.dtypes = {k: _dtype_name(v.dtype) for k, v in loaded.items()}
                return
        raise PatchkitError(
            f"adapter directory {adapter_dir} has no {ADAPTER_SAFETENSORS} (or adapter_model.bin)"
        )

    def float32(self, key: str):
        import torch

        if self._file is not None:
            return self._file.tensor(key).to(torch.float32)
        return self._loaded[key].to(torch.float32)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# ---------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------


@dataclass
class _Lora:
    """One adapter module's factors and how they form its delta."""

    module: str
    a_key: str
    b_key: str
    # linear: B @ A. embedding: (B @ A).T. experts / experts-legacy: one (E, d1, d2)
    # delta, expert e from the factors in the layout of vLLM and PEFT >= 0.20, or of
    # PEFT <= 0.19 (for (E, out, in) parameters such as Qwen3.5's).
    kind: str
    scale: float
    rank: int
    experts: int = 1

    def factors(self, cache: _FactorCache, expert: int | None):
        """(left, right), float32, with delta rows = scale * left @ right."""
        a = cache.get(self.a_key)
        b = cache.get(self.b_key)
        if self.kind == "linear":
            return b, a
        if self.kind == "embedding":
            return a.T, b.T
        e, n, r = expert, self.experts, self.rank
        if self.kind == "experts":  # A (r*E, d2), B (d1, r*E)
            return b.view(b.shape[0], r, n)[:, :, e], a.view(n, r, a.shape[1])[e]
        if self.kind == "experts-legacy":  # A (r*E, d1), B (d2, r*E)
            return a.view(n, r, a.shape[1])[e].T, b.view(b.shape[0], r, n)[:, :, e].T
        raise AssertionError(self.kind)


@dataclass
class _Piece:
    """Rows [row0, row0 + nrows) of checkpoint tensor `key` gain rows [sub0, sub0 + nrows)
    of a module's delta (of one expert, for expert modules)."""

    key: str
    row0: int
    nrows: int
    lora: _Lora
    expert: int | None = None
    sub0: int = 0


@dataclass
class ModuleMerge:
    """What one adapter module does to the checkpoint."""

    module: str
    kind: str
    rank: int
    scale: float
    targets: tuple[str, ...]


@dataclass
class MergePlan:
    """What `write_merged` will do, decided before anything is written."""

    model_dir: Path
    adapter_dir: Path
    modules: list[ModuleMerge]
    rewrite: list[str]  # shards rewritten with merged tensors
    link: list[str]  # shards hard-linked (or symlinked) unchanged
    copy: list[str]  # other files copied
    index_text: str | None  # the index written, when the checkpoint has one
    bytes_needed: int
    notes: list[str] = field(default_factory=list)
    _pieces: dict[str, list[_Piece]] = field(default_factory=dict, repr=False)
    _sources: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def changed_tensors(self) -> list[str]:
        return sorted(self._pieces)

    def describe(self) -> list[str]:
        """Lines for the user, before anything is written."""
        touched = len(self.changed_tensors)
        lines = [
            f"merged copy of {self.model_dir} with {self.adapter_dir}: needs "
            f"{human_bytes(self.bytes_needed)} ({len(self.rewrite)} of "
            f"{len(self.rewrite) + len(self.link)} weight files rewritten, {len(self.link)} "
            f"linked, {len(self.copy)} other files copied); {len(self.modules)} adapter modules "
            f"change {touched} tensors"
        ]
        lines += [f"note: {n}" for n in self.notes]
        return lines


def _module_keys(adapter: _AdapterTensors) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Adapter tensors grouped by module: {module: {"A"|"B": key}}, plus notes."""
    modules: dict[str, dict[str, str]] = {}
    skipped = []
    for key in adapter.shapes:
        name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        if name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")):
            skipped.append(key)  # a full copy of the base embedding; vLLM skips it too
            continue
        if "lora_magnitude_vector" in name:
            raise PatchkitError(
                f"{adapter.path}: {key} is a DoRA magnitude vector; DoRA is refused"
            )
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name) or re.fullmatch(
            r"(.+)\.lora_embedding_([AB])", name
        )
        if match is None:
            what = (
                "a lora_B bias (lora_bias)"
                if name.endswith(".lora_B.bias")
                else "not a LoRA factor"
            )
            raise PatchkitError(f"{adapter.path}: tensor {key} is {what}; refused")
        module, which = match.group(1), match.group(2)
        entry = modules.setdefault(module, {})
        kind = "embedding" if "lora_embedding_" in name else "linear"
        if entry.setdefault("kind", kind) != kind:
            raise PatchkitError(
                f"{adapter.path}: module {module} mixes lora_A/B and lora_embedding_A/B"
            )
        entry[which] = key
    for module, entry in modules.items():
        for which in ("A", "B"):
            if which not in entry:
                other = "B" if which == "A" else "A"
                raise PatchkitError(
                    f"{adapter.path}: module {module} has lora_{other} but no lora_{which}"
                )
    notes = []
    if skipped:
        notes.append(
            f"{len(skipped)} full embedding copies in the adapter are ignored, as vLLM does "
            f"({skipped[0]})"
        )
    return modules, notes


class _Planner:
    def __init__(self, ckpt: _Checkpoint, cfg: _AdapterConfig, adapter: _AdapterTensors):
        self.ckpt = ckpt
        self.cfg = cfg
        self.adapter = adapter
        self.pieces: dict[str, list[_Piece]] = {}
        self.modules: list[ModuleMerge] = []
        self.notes: list[str] = []
        self.renamed: list[tuple[str, str]] = []
        self.vllm_scale_differs: list[str] = []
        self.legacy_layout: list[str] = []
        self.expert_params: dict[str, set[str]] = {}
        self.per_expert: list[str] = []
        self.square: list[str] = []
        self._layouts: dict[str, dict | None] = {}
        self._modules: dict[str, dict[str, str]] = {}

    # -- names -------------------------------------------------------------

    def find(self, name: str) -> str | None:
        for alt in _alternatives(name):
            if self.ckpt.has(alt):
                if alt != name:
                    self.renamed.append((name, alt))
                return alt
        return None

    def where(self, key: str) -> str:
        return f"{key} in {self.ckpt.where[key]}"

    def fail(self, module: str, what: str) -> PatchkitError:
        return PatchkitError(f"{self.adapter.path.name}: module {module}: {what}")

    def shapes(self, entry: dict[str, str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.adapter.shapes[entry["A"]], self.adapter.shapes[entry["B"]]

    def add(self, piece: _Piece) -> None:
        info = self.ckpt.info(piece.key)
        if info.dtype not in _MERGEABLE:
            raise self.fail(
                piece.lora.module,
                f"base tensor {self.where(piece.key)} is {info.dtype}; LoRA can be merged into "
                "F32/F16/BF16 weights only (use the unquantized checkpoint)",
            )
        self.pieces.setdefault(piece.key, []).append(piece)

    def record(self, lora: _Lora, targets) -> None:
        self.modules.append(
            ModuleMerge(
                lora.module, lora.kind, lora.rank, lora.scale, tuple(dict.fromkeys(targets))
            )
        )
        if not math.isclose(lora.scale, self.cfg.global_scale, rel_tol=1e-9):
            self.vllm_scale_differs.append(lora.module)

    def check_factors(self, module: str, entry: dict[str, str]) -> None:
        for which in ("A", "B"):
            key = entry[which]
            shape, dtype = self.adapter.shapes[key], self.adapter.dtypes[key]
            if len(shape) != 2:
                raise self.fail(
                    module,
                    f"lora_{which} is {_shape(shape)}, not a matrix (LoRA on a convolution such "
                    "as the GDN conv1d is not supported)",
                )
            if dtype not in _MERGEABLE:
                raise self.fail(module, f"lora_{which} is {dtype}, not a floating-point tensor")

    def rank_for(self, module: str, pattern_name: str, rank: int) -> tuple[int, float]:
        cfg_rank, alpha = self.cfg.rank_alpha(pattern_name)
        if rank != cfg_rank:
            raise self.fail(
                module,
                f"its tensors have rank {rank} but {ADAPTER_CONFIG} gives r={cfg_rank} for "
                f"{pattern_name} (r / rank_pattern)",
            )
        return rank, self.cfg.scale(rank, alpha)

    # -- modules -----------------------------------------------------------

    def plan_module(self, module: str, entry: dict[str, str]) -> None:
        self.check_factors(module, entry)
        if entry["kind"] == "embedding":
            return self.plan_embedding(module, entry)
        root, depth = module, 0
        while root.endswith(".base_layer"):
            root, depth = root[: -len(".base_layer")], depth + 1
        if root.rsplit(".", 1)[-1] == "experts":
            layout = self.expert_layout(root)
            if layout is not None:
                return self.plan_experts(module, entry, root, depth, layout)
        if depth:
            raise self.fail(
                module, "no base tensor: a nested base_layer that is not an MoE experts module"
            )
        key = self.find(module + ".weight")
        if key is None:
            match = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)", module)
            layout = self.expert_layout(match.group(1)) if match else None
            if layout is not None and layout["fused"]:
                return self.plan_expert_slice(
                    module, entry, layout, int(match.group(2)), match.group(3)
                )
            last = module.rsplit(".", 1)[-1]
            hint = (
                f" ({last} is vLLM's fused name; HF checkpoints hold {_VLLM_FUSED[last]})"
                if last in _VLLM_FUSED
                else ""
            )
            raise self.fail(module, f"no base tensor {module}.weight in {self.ckpt.dir}{hint}")
        return self.plan_linear(module, entry, key)

    def plan_linear(self, module: str, entry: dict[str, str], key: str) -> None:
        info = self.ckpt.info(key)
        a, b = self.shapes(entry)
        self.check_tied(module, key)
        if len(info.shape) != 2 or a[1] != info.shape[1] or b[0] != info.shape[0] or a[0] != b[1]:
            raise self.fail(
                module,
                f"lora_A {_shape(a)} and lora_B {_shape(b)} do not fit base tensor "
                f"{self.where(key)} {_shape(info.shape)} (needs A (r, {info.shape[-1]}), "
                f"B ({info.shape[0]}, r))",
            )
        rank, scale = self.rank_for(module, module, a[0])
        lora = _Lora(module, entry["A"], entry["B"], "linear", scale, rank)
        self.add(_Piece(key, 0, info.shape[0], lora))
        self.record(lora, [key])

    def plan_embedding(self, module: str, entry: dict[str, str]) -> None:
        key = self.find(module + ".weight")
        if key is None:
            raise self.fail(module, f"no base tensor {module}.weight in {self.ckpt.dir}")
        self.check_tied(module, key)
        info = self.ckpt.info(key)
        a, b = self.shapes(entry)
        if len(info.shape) != 2 or a[1] != info.shape[0] or b[0] != info.shape[1] or a[0] != b[1]:
            raise self.fail(
                module,
                f"lora_embedding_A {_shape(a)} and lora_embedding_B {_shape(b)} do not fit base "
                f"tensor {self.where(key)} {_shape(info.shape)}",
            )
        rank, scale = self.rank_for(module, module, a[0])
        lora = _Lora(module, entry["A"], entry["B"], "embedding", scale, rank)
        self.add(_Piece(key, 0, info.shape[0], lora))
        self.record(lora, [key])

    def check_tied(self, module: str, key: str) -> None:
        last = module.rsplit(".", 1)[-1]
        if last in ("lm_head", "embed_tokens") and self.ckpt.tied_embeddings():
            raise self.fail(
                module,
                f"the model ties lm_head to embed_tokens (tie_word_embeddings), so merging into "
                f"{key} would change both",
            )

    # -- experts -----------------------------------------------------------

    def expert_layout(self, root: str) -> dict | None:
        """The experts under `root`: fused 3-D tensors or per-expert matrices (cached)."""
        if root not in self._layouts:
            self._layouts[root] = self._expert_layout(root)
        return self._layouts[root]

    def _expert_layout(self, root: str) -> dict | None:
        for alt in _alternatives(root):
            gate_up, down = alt + ".gate_up_proj", alt + ".down_proj"
            if self.ckpt.has(gate_up) or self.ckpt.has(down):
                params = {}
                for name, key in (("gate_up_proj", gate_up), ("down_proj", down)):
                    if self.ckpt.has(key):
                        shape = self.ckpt.info(key).shape
                        if len(shape) != 3:
                            raise PatchkitError(
                                f"{self.where(key)}: fused experts are {_shape(shape)}, not 3-D"
                            )
                        params[name] = shape
                if alt != root:
                    self.renamed.append((root, alt))
                return {"fused": True, "root": alt, "params": params}
            prefix = alt + "."
            indices = {
                int(k[len(prefix) :].split(".", 1)[0])
                for k in self.ckpt.where
                if k.startswith(prefix) and k[len(prefix) :].split(".", 1)[0].isdigit()
            }
            if indices:
                count = max(indices) + 1
                if indices != set(range(count)):
                    missing = sorted(set(range(count)) - indices)[:3]
                    raise PatchkitError(
                        f"{self.ckpt.dir}: experts under {alt} miss indices {missing}"
                    )
                params = {}
                gate, up, down = (self.ckpt.has(f"{alt}.0.{p}.weight") for p in EXPERT_PROJ)
                if gate and up:
                    g, u = (self.ckpt.info(f"{alt}.0.{p}.weight").shape for p in EXPERT_PROJ[:2])
                    if g != u or len(g) != 2:
                        raise PatchkitError(
                            f"{self.ckpt.dir}: {alt}.0 gate_proj {g} and up_proj {u} differ"
                        )
                    params["gate_up_proj"] = (count, 2 * g[0], g[1])
                if down:
                    d = self.ckpt.info(f"{alt}.0.down_proj.weight").shape
                    params["down_proj"] = (count, d[0], d[1])
                if alt != root:
                    self.renamed.append((root, alt))
                return {"fused": False, "root": alt, "params": params}
        return None

    def expert_rows(self, layout: dict, param: str, expert: int) -> list[tuple[str, int, int, int]]:
        """Where one expert's rows of an (E, d1, d2) parameter live: (key, row0, nrows, sub0)."""
        root = layout["root"]
        _, d1, _ = layout["params"][param]
        if layout["fused"]:
            return [(f"{root}.{param}", expert * d1, d1, 0)]
        if param == "down_proj":
            return [(f"{root}.{expert}.down_proj.weight", 0, d1, 0)]
        half = d1 // 2
        return [
            (f"{root}.{expert}.gate_proj.weight", 0, half, 0),
            (f"{root}.{expert}.up_proj.weight", 0, half, half),
        ]

    def plan_experts(self, module, entry, root, depth, layout) -> None:
        a, b = self.shapes(entry)
        targeted = [
            p
            for p in EXPERT_PARAMS
            if any(
                f"{root}.{p}" == t or f"{root}.{p}".endswith("." + t)
                for t in self.cfg.target_parameters
            )
        ]
        if targeted:
            if depth >= len(targeted):
                raise self.fail(
                    module, f"more nested base_layers than target_parameters {targeted}"
                )
            candidates = [targeted[len(targeted) - 1 - depth]]
        elif depth == 0 and (module + ".base_layer") in self._modules:
            candidates = ["down_proj"]  # vLLM's convention: base_layer is gate_up_proj
        elif depth == 1:
            candidates = ["gate_up_proj"]
        else:
            candidates = list(EXPERT_PARAMS)
        fits = []
        for param in candidates:
            if param not in layout["params"]:
                continue
            n, d1, d2 = layout["params"][param]
            if a[0] % n or b[1] != a[0]:
                continue
            if a[1] == d2 and b[0] == d1:
                fits.append((param, "experts"))
            elif a[1] == d1 and b[0] == d2:
                fits.append((param, "experts-legacy"))
        shapes = ", ".join(
            f"{layout['root']}.{p} {_shape(layout['params'][p])}"
            for p in candidates
            if p in layout["params"]
        )
        if not fits:
            raise self.fail(
                module,
                f"lora_A {_shape(a)} and lora_B {_shape(b)} fit no expert parameter "
                f"({shapes or 'none in the checkpoint'}; an (E, d1, d2) parameter takes "
                "A (r*E, d2), B (d1, r*E), or from PEFT <= 0.19 A (r*E, d1), B (d2, r*E))",
            )
        if len(fits) > 1:
            raise self.fail(
                module,
                f"lora_A {_shape(a)} and lora_B {_shape(b)} fit both {shapes}; name the parameter "
                f"in {ADAPTER_CONFIG} target_parameters",
            )
        param, kind = fits[0]
        n, d1, d2 = layout["params"][param]
        if d1 == d2:
            self.square.append(module)
        pattern_name = f"{root}.{param}"
        rank, scale = self.rank_for(module, pattern_name, a[0] // n)
        lora = _Lora(module, entry["A"], entry["B"], kind, scale, rank, experts=n)
        targets = []
        for e in range(n):
            for key, row0, nrows, sub0 in self.expert_rows(layout, param, e):
                self.add(_Piece(key, row0, nrows, lora, expert=e, sub0=sub0))
                targets.append(key)
        self.record(lora, targets)
        if kind == "experts-legacy":
            self.legacy_layout.append(module)
        self.expert_params.setdefault(layout["root"], set()).add(param)

    def plan_expert_slice(self, module, entry, layout, expert, proj) -> None:
        """A per-expert adapter module on a fused experts checkpoint."""
        param = "down_proj" if proj == "down_proj" else "gate_up_proj"
        if param not in layout["params"]:
            raise self.fail(module, f"no base tensor {layout['root']}.{param} in {self.ckpt.dir}")
        n, d1, d2 = layout["params"][param]
        rows = d1 if param == "down_proj" else d1 // 2
        offset = d1 // 2 if proj == "up_proj" else 0
        key = f"{layout['root']}.{param}"
        a, b = self.shapes(entry)
        if expert >= n or a[1] != d2 or b[0] != rows or a[0] != b[1]:
            raise self.fail(
                module,
                f"lora_A {_shape(a)} and lora_B {_shape(b)} do not fit expert {expert} of "
                f"{self.where(key)} {_shape((n, d1, d2))} (needs A (r, {d2}), B ({rows}, r))",
            )
        rank, scale = self.rank_for(module, module, a[0])
        lora = _Lora(module, entry["A"], entry["B"], "linear", scale, rank)
        self.add(_Piece(key, expert * d1 + offset, rows, lora))
        self.record(lora, [key])

    # -- all of it ---------------------------------------------------------

    def run(self, modules: dict[str, dict[str, str]]) -> None:
        self._modules = modules
        for module in sorted(modules):
            self.plan_module(module, modules[module])
        if self.renamed:
            first, to = self.renamed[0]
            self.notes.append(
                f"the adapter names modules as {first}, the checkpoint as {to}: merged onto the "
                "checkpoint's names; vLLM applies LoRA only to names its hf_to_vllm_mapper "
                "produces, so it may not apply this adapter at all"
            )
        if self.vllm_scale_differs:
            names = self.vllm_scale_differs
            self.notes.append(
                f"rank_pattern/alpha_pattern give {len(names)} modules (e.g. {names[0]}) a scale "
                f"other than the global {self.cfg.global_scale:g}; vLLM before 0.32 applies the "
                "global one (vllm/lora/peft_helper.py) and will not match this merge"
            )
        if self.legacy_layout:
            self.notes.append(
                f"{len(self.legacy_layout)} fused expert modules (e.g. {self.legacy_layout[0]}) "
                "have lora_A as (r*E, out), as PEFT <= 0.19 saved them; vLLM 0.22-0.33 "
                "(FusedMoE3DWithLoRA) and PEFT >= 0.20 read lora_A as (r*E, in), so vLLM "
                "refuses or misreads this adapter"
            )
        single = sorted(root for root, params in self.expert_params.items() if len(params) == 1)
        if single:
            param = next(iter(self.expert_params[single[0]]))
            self.notes.append(
                f"{len(single)} experts module{'s' if len(single) != 1 else ''} (e.g. {single[0]}) "
                "adapt one parameter "
                f"({param}); vLLM 0.17-0.33 (_stack_moe_lora_weights) needs both gate_up_proj "
                "and down_proj in a fused expert adapter and will not load it unless "
                "partial-moe-adapter is applied (`patchkit apply`)"
            )
        if self.square:
            self.notes.append(
                f"{len(self.square)} fused expert modules (e.g. {self.square[0]}) have square "
                "matrices, which fit both layouts: read as vLLM and PEFT >= 0.20 do"
            )
        self.per_expert = [m for m in self._modules if re.search(r"\.experts\.\d+\.", m)]
        if self.per_expert and self.ckpt.architecture().startswith("Qwen3_5Moe"):
            self.notes.append(
                f"{len(self.per_expert)} per-expert modules (e.g. {self.per_expert[0]}): vLLM "
                "serves Qwen3.5-MoE experts with FusedMoE3DWithLoRA and loads per-expert "
                "adapters only with --enable-mixed-moe-lora-format"
            )
        if self.per_expert and self.cfg.use_rslora:
            self.notes.append(
                "per-expert rsLoRA modules: vLLM before 0.32 scales packed experts by "
                "lora_alpha/r (PackedLoRALayerWeights.pack_moe), not lora_alpha/sqrt(r)"
            )


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _index_text(ckpt: _Checkpoint) -> str | None:
    if ckpt.index_meta is None:
        return None
    weight_map = {key: ckpt.where[key] for key in sorted(ckpt.where)}
    meta = dict(ckpt.index_meta)
    meta["total_size"] = sum(
        info.nbytes for shard in ckpt.shards.values() for info in shard.tensors.values()
    )
    return json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n"


def plan_merge(model_dir: Path | str, adapter_dir: Path | str) -> MergePlan:
    """Decide the merge of one PEFT LoRA adapter into a safetensors checkpoint; writes nothing."""
    model_dir, adapter_dir = Path(model_dir), Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise PatchkitError(f"adapter directory {adapter_dir} does not exist")
    ckpt = _Checkpoint(model_dir)
    cfg = read_adapter_config(adapter_dir)
    adapter = _AdapterTensors(adapter_dir)
    try:
        modules, notes = _module_keys(adapter)
        if not modules:
            raise PatchkitError(f"{adapter.path}: holds no LoRA factors")
        planner = _Planner(ckpt, cfg, adapter)
        planner.run(modules)
    finally:
        adapter.close()
        ckpt.close()
    rewrite = sorted({ckpt.where[key] for key in planner.pieces})
    link = sorted(set(ckpt.shards) - set(rewrite))
    copy = []
    for path in sorted(model_dir.iterdir()):
        if path.name in ckpt.shards or path.name == INDEX_NAME:
            continue
        if (
            path.is_file()
            and not path.name.endswith(_WEIGHT_SUFFIXES)
            and not path.name.startswith(".")
        ):
            copy.append(path.name)
    index_text = _index_text(ckpt)
    sizes = {name: (model_dir / name).stat() for name in list(ckpt.shards) + copy}
    needed = sum(sizes[name].st_size for name in rewrite + copy)
    if index_text is not None:
        needed += len(index_text.encode())
    return MergePlan(
        model_dir=model_dir,
        adapter_dir=adapter_dir,
        modules=planner.modules,
        rewrite=rewrite,
        link=link,
        copy=copy,
        index_text=index_text,
        bytes_needed=needed,
        notes=notes + planner.notes,
        _pieces=planner.pieces,
        _sources={n: (s.st_size, s.st_mtime_ns) for n, s in sizes.items() if n in ckpt.shards},
    )


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


class _FactorCache:
    """Adapter factors in float32, least recently used dropped past a byte budget."""

    def __init__(self, adapter: _AdapterTensors, budget: int):
        self.adapter = adapter
        self.budget = budget
        self.items: OrderedDict[str, object] = OrderedDict()
        self.size = 0

    def get(self, key: str):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        t = self.adapter.float32(key)
        self.items[key] = t
        self.size += t.numel() * 4
        while self.size > self.budget and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.size -= old.numel() * 4
        return t


def round_stochastically(block, generator):
    """``block`` (float32) in bf16, each value rounded down or up (in magnitude) at random.

    Up with the probability of the dropped bits' share of one bf16 step, so each
    value is right on average, with an error uncorrelated with rounding to
    nearest. Two merged references rounded these two ways are equally valid
    bf16 versions of the same float32 weights, so how far apart they serve is
    the precision of the merged reference itself (``verify --model``'s rounding
    control). bf16 whatever the checkpoint's dtype, because vLLM serves the
    references in bf16 (``proof/serving.py``): a float32 or float16 checkpoint
    is rounded there once more, at load, to nearest. The usual bit trick
    (random low 16 bits added, then cut off), about 3x faster than choosing
    between neighbours; NaN and inf are rounded to nearest.
    """
    import torch

    block = block.contiguous()
    noise = torch.randint(0, 1 << 16, block.shape, generator=generator, dtype=torch.int32)
    bits = (block.view(torch.int32) + noise) & -(1 << 16)
    rounded = bits.view(torch.float32).to(torch.bfloat16)
    return rounded.where(block.isfinite(), block.to(torch.bfloat16))


def _merge_tensor(
    src: SafetensorsFile, info: TensorInfo, pieces: list[_Piece], cache, out, generator=None
) -> None:
    """Write one merged tensor: row blocks in float32, W + scale * left @ right, cast back
    (to nearest, or stochastically with a ``generator``)."""
    import torch

    cols = info.shape[-1]
    rows = info.numel // cols
    dtype = _torch_dtype(info.dtype)
    step = max(1, _CHUNK_ELEMENTS // cols)
    pieces = sorted(pieces, key=lambda p: p.row0)
    for c0 in range(0, rows, step):
        c1 = min(rows, c0 + step)
        block = src.read_rows(info.name, c0, c1 - c0).to(torch.float32)
        for piece in pieces:
            o0, o1 = max(c0, piece.row0), min(c1, piece.row0 + piece.nrows)
            if o0 >= o1:
                continue
            left, right = piece.lora.factors(cache, piece.expert)
            s0 = piece.sub0 + o0 - piece.row0
            delta = left[s0 : s0 + o1 - o0] @ right
            block[o0 - c0 : o1 - c0] += delta.mul_(piece.lora.scale)
        if generator is None:
            rounded = block.to(dtype)
        else:  # bf16 values, stored in the checkpoint's dtype
            rounded = round_stochastically(block, generator).to(dtype)
        out.write(_tensor_bytes(rounded))


def _rewrite_shard(
    src: SafetensorsFile, dest: Path, pieces: dict[str, list[_Piece]], cache, generator=None
) -> None:
    """The shard again, byte for byte, except the merged tensors' data."""
    chunk = 1 << 24
    with open(dest, "wb") as out:
        out.write(src.header_bytes)
        pos = src.data_start
        for info in sorted(src.tensors.values(), key=lambda i: i.begin):
            if info.begin > pos:  # bytes between tensors, kept as they are
                out.write(src.read_bytes(pos, info.begin - pos))
            if info.name in pieces:
                _merge_tensor(src, info, pieces[info.name], cache, out, generator)
            else:
                for start in range(info.begin, info.end, chunk):
                    out.write(src.read_bytes(start, min(chunk, info.end - start)))
            pos = max(pos, info.end)
        if src.size > pos:
            out.write(src.read_bytes(pos, src.size - pos))


def _link(source: Path, dest: Path) -> str:
    real = source.resolve()
    try:
        os.link(real, dest)
        return "hardlink"
    except OSError:
        pass
    try:
        os.symlink(real, dest)
        return "symlink"
    except OSError as exc:
        raise PatchkitError(
            f"cannot hard-link or symlink {real} into {dest.parent} ({exc.strerror}); "
            "the merge does not copy unchanged shards"
        ) from exc


def write_merged(
    plan: MergePlan,
    dest_dir: Path | str,
    progress: Callable[[str], None] | None = None,
    stochastic_seed: int | None = None,
) -> dict[str, str]:
    """Write the merged checkpoint to dest_dir (which must not exist, or be empty).

    Written next to it first and renamed into place at the end, so dest_dir
    is either complete or absent. Returns {shard: "merged"|"hardlink"|"symlink"}.
    With ``stochastic_seed`` the merged tensors are rounded stochastically
    (``round_stochastically``, reproducible from the seed) instead of to nearest.
    """
    dest = Path(dest_dir).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PatchkitError(f"{dest} exists and is not empty; give write_merged a new directory")
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(parent).free
    except OSError as exc:
        raise PatchkitError(os_error_line(exc, "preparing")) from exc
    if free < plan.bytes_needed:
        raise PatchkitError(
            f"the merged checkpoint needs {human_bytes(plan.bytes_needed)} at {parent}, "
            f"{human_bytes(free)} is free; give --workdir a larger disk"
        )
    for name, (size, mtime) in plan._sources.items():
        st = (plan.model_dir / name).stat()
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise PatchkitError(f"{plan.model_dir / name} changed since the merge was planned")
    done: dict[str, str] = {}
    adapter = _AdapterTensors(plan.adapter_dir)
    cache = _FactorCache(adapter, _CACHE_BYTES)
    generator = _generator(stochastic_seed)
    work = None
    try:
        # A fresh staging directory of our own (mkdtemp), never one found by its name:
        # a directory of that name in the user's --keep DIR is theirs, not a leftover.
        work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=parent))
        for name in plan.copy:
            shutil.copyfile(plan.model_dir / name, work / name)
        if plan.index_text is not None:
            (work / INDEX_NAME).write_text(plan.index_text)
        for name in plan.link:
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            done[name] = _link(plan.model_dir / name, work / name)
        for name in plan.rewrite:
            if progress:
                progress(f"merging {name}")
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            with SafetensorsFile(plan.model_dir / name) as src:
                mine = {k: v for k, v in plan._pieces.items() if k in src.tensors}
                _rewrite_shard(src, work / name, mine, cache, generator)
            done[name] = "merged"
        if dest.exists():
            dest.rmdir()
        os.rename(work, dest)
    except OSError as exc:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        raise PatchkitError(os_error_line(exc, "writing the merged checkpoint to")) from exc
    except BaseException:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        adapter.close()
    return done


def _generator(seed: int | None):
    """A CPU generator for stochastic rounding, or None (round to nearest)."""
    if seed is None:
        return None
    import torch

    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def merged_checkpoint(
    model_dir: Path | str,
    adapter_dir: Path | str,
    workdir: Path | str,
    progress: Callable[[str], None] | None = None,
) -> Iterator[tuple[Path, MergePlan]]:
    """Plan, tell, write a merged checkpoint under workdir, and remove it afterwards."""
    plan = plan_merge(model_dir, adapter_dir)
    if progress:
        for line in plan.describe():
            progress(line)
    dest = Path(workdir) / f"merged-{Path(adapter_dir).name}-{os.getpid()}"
    write_merged(plan, dest, progress)
    try:
        yield dest, plan
    finally:
        shutil.rmtree(dest, ignore_errors=True)
