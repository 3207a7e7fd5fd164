"""Tiny Qwen3.5 configs and PEFT adapters written byte by byte (no torch), for `adapter check`.

Names and layouts are PEFT's: ``base_model.model.model.language_model.layers.N.<module>
.lora_A.weight`` for linear modules; for target_parameters on the routed experts (PEFT 0.21)
``...mlp.experts.base_layer.lora_A.weight`` (gate_up_proj) and ``...mlp.experts.lora_A.weight``
(down_proj) with two parameters, ``...mlp.experts.lora_A.weight`` alone with one, lora_A
(r*E, in) and lora_B (out, r*E). Every value of a factor is one small number (1/128 in bf16)
unless poisoned or asked to be zero (an all-zero factor is a finding of its own).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

H, VOCAB, LAYERS = 16, 40, 3
TYPES = ["linear_attention", "full_attention", "linear_attention"]
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 4
NK, DK, NV, DV = 2, 4, 2, 4
QKV, Z = 2 * NK * DK + NV * DV, NV * DV
E, I_MOE, I_SHARED, I_DENSE = 4, 6, 6, 24
P = "base_model.model.model.language_model.layers."
SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
# one small finite value per type, every element of a factor (not zero: see the docstring)
FILL = {
    "BF16": b"\x00\x3c",
    "F16": struct.pack("<e", 0.0078125),
    "F32": struct.pack("<f", 0.0078125),
    "F64": struct.pack("<d", 0.0078125),
    "F8_E4M3": b"\x08",
    "F8_E5M2": b"\x04",
}


def config(moe: bool) -> dict:
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "layer_types": TYPES,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": NK,
        "linear_key_head_dim": DK,
        "linear_num_value_heads": NV,
        "linear_value_head_dim": DV,
        "vocab_size": VOCAB,
    }
    if moe:
        text |= {
            "num_experts": E,
            "moe_intermediate_size": I_MOE,
            "shared_expert_intermediate_size": I_SHARED,
        }
    else:
        text["intermediate_size"] = I_DENSE
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return {"architectures": [arch], "text_config": text}


def write_model(path: Path, moe: bool) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config(moe)))
    return path


def tensor(shape, dtype="BF16", poison: dict | None = None, zero: bool = False) -> tuple:
    """(dtype, shape, raw bytes): FILL (or zeros), with {flat index: raw element bytes}
    poked in."""
    n = 1
    for d in shape:
        n *= d
    size = SIZES[dtype]
    data = bytearray(n * size) if zero or dtype not in FILL else bytearray(FILL[dtype] * n)
    for index, raw in (poison or {}).items():
        data[index * size : index * size + size] = raw
    return dtype, list(shape), bytes(data)


BF16_NAN, BF16_INF, BF16_NEG_INF = b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"
F16_INF = struct.pack("<e", float("inf"))
F32_NAN = struct.pack("<f", float("nan"))
F64_NAN = struct.pack("<d", float("nan"))


def write_safetensors(path: Path, tensors: dict) -> None:
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def linear(module: str, out: int, inp: int, r: int = 4, zero_b=False, **poison) -> dict:
    """A PEFT linear module's two factors, A (r, in) and B (out, r)."""
    return {
        f"{P}{module}.lora_A.weight": tensor((r, inp), poison=poison.get("a")),
        f"{P}{module}.lora_B.weight": tensor((out, r), poison=poison.get("b"), zero=zero_b),
    }


def dense_tensors(r: int = 4, zero_b: bool = False) -> dict:
    """Attention in layer 1, GDN in layers 0 and 2, the dense MLP everywhere."""
    t = {}
    for layer in range(LAYERS):
        if TYPES[layer] == "full_attention":
            t |= linear(f"{layer}.self_attn.q_proj", 2 * HEADS * HEAD_DIM, H, r, zero_b)
            t |= linear(f"{layer}.self_attn.o_proj", H, HEADS * HEAD_DIM, r, zero_b)
        else:
            t |= linear(f"{layer}.linear_attn.in_proj_qkv", QKV, H, r, zero_b)
            t |= linear(f"{layer}.linear_attn.in_proj_z", Z, H, r, zero_b)
            t |= linear(f"{layer}.linear_attn.out_proj", H, Z, r, zero_b)
        t |= linear(f"{layer}.mlp.down_proj", H, I_DENSE, r, zero_b)
    return t


def experts(layer: int, params=("gate_up_proj", "down_proj"), r: int = 4, legacy=False) -> dict:
    """PEFT 0.21's target_parameters layout on the fused experts of one layer."""
    shapes = {"gate_up_proj": (2 * I_MOE, H), "down_proj": (H, I_MOE)}
    names = (
        {"gate_up_proj": "mlp.experts.base_layer", "down_proj": "mlp.experts"}
        if len(params) == 2
        else {params[0]: "mlp.experts"}
    )
    t = {}
    for param in params:
        out, inp = shapes[param]
        if legacy:
            out, inp = inp, out
        name = f"{P}{layer}.{names[param]}"
        t[f"{name}.lora_A.weight"] = tensor((r * E, inp))
        t[f"{name}.lora_B.weight"] = tensor((out, r * E))
    return t


def moe_tensors(r: int = 4) -> dict:
    t = {}
    for layer in range(LAYERS):
        t |= linear(f"{layer}.mlp.shared_expert.down_proj", H, I_SHARED, r)
        t |= experts(layer, r=r)
    return t


def write_adapter(path: Path, tensors: dict, **config) -> Path:
    path.mkdir(parents=True)
    write_safetensors(path / "adapter_model.safetensors", tensors)
    modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors}
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": sorted(m for m in modules if m not in ("experts", "base_layer")),
        "target_parameters": None,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
    }
    cfg.update(config)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
