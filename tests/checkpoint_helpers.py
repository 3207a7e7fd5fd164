"""Tiny Qwen3.5 checkpoints and PEFT adapters, written with a safetensors writer of the tests' own.

The expected weights of the merge tests never go through patchkit's reader
or writer: these write and read the files themselves. Checkpoints have
[GDN, attention, GDN] layers, dense or MoE, in three shards; factors are
small multiples of 1/8 (exact in bf16). Used by tests/test_merge.py and the
verify tests.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from patchkit.verify import checkpoint

# a safetensors writer and reader of the test's own

_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}

_TORCH = {v: k for k, v in _ST.items()}


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def st_write(path: Path, tensors: dict, gap: int = 0) -> None:
    """tensors: name -> torch tensor, or (dtype name, shape, raw bytes); `gap` filler bytes
    after each tensor (not written by safetensors itself, but bytes a rewrite must keep)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        if isinstance(t, tuple):
            dtype, shape, data = t
        else:
            dtype, shape, data = _ST[t.dtype], list(t.shape), _raw(t)
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data + b"\xab" * gap)
        offset += len(data) + gap
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def st_read(path: Path) -> dict[str, torch.Tensor]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        chunk = bytearray(data[8 + n + b : 8 + n + end])
        dtype = _TORCH[e["dtype"]]
        if not chunk:
            out[name] = torch.zeros(e["shape"], dtype=dtype)
            continue
        out[name] = torch.frombuffer(chunk, dtype=dtype).reshape(e["shape"]).clone()
    return out


def st_raw(path: Path) -> dict[str, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        k: data[8 + n + e["data_offsets"][0] : 8 + n + e["data_offsets"][1]]
        for k, e in header.items()
    }


# tiny Qwen3.5 checkpoints: [GDN, attention, GDN] layers, dense or MoE

H, V = 16, 40
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 4
KEY_DIM, VALUE_DIM, V_HEADS = 8, 8, 2
QKV = 2 * KEY_DIM + VALUE_DIM
I_DENSE = 24
E, I_MOE, I_SHARED = 4, 6, 6
LAYERS = ("linear_attention", "full_attention", "linear_attention")
VL = "model.language_model."
SHARDS = (
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
)


def base_tensors(dtype=torch.bfloat16, moe=False, per_expert=False, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, dt=None):
        return (torch.randn(*shape, generator=g) * 0.05).to(dt or dtype)

    t = {VL + "embed_tokens.weight": w(V, H)}
    for i, kind in enumerate(LAYERS):
        p = f"{VL}layers.{i}."
        t[p + "input_layernorm.weight"] = w(H, dt=torch.float32)
        if kind == "linear_attention":
            a = p + "linear_attn."
            t[a + "in_proj_qkv.weight"] = w(QKV, H)
            t[a + "in_proj_z.weight"] = w(VALUE_DIM, H)
            t[a + "in_proj_b.weight"] = w(V_HEADS, H)
            t[a + "in_proj_a.weight"] = w(V_HEADS, H)
            t[a + "conv1d.weight"] = w(QKV, 1, 4)
            t[a + "A_log"] = w(V_HEADS, dt=torch.float32)
            t[a + "dt_bias"] = w(V_HEADS)
            t[a + "norm.weight"] = w(VALUE_DIM // V_HEADS, dt=torch.float32)
            t[a + "out_proj.weight"] = w(H, VALUE_DIM)
        else:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = w(2 * HEADS * HEAD_DIM, H)
            t[a + "k_proj.weight"] = w(KV_HEADS * HEAD_DIM, H)
            t[a + "v_proj.weight"] = w(KV_HEADS * HEAD_DIM, H)
            t[a + "o_proj.weight"] = w(H, HEADS * HEAD_DIM)
            t[a + "q_norm.weight"] = w(HEAD_DIM, dt=torch.float32)
            t[a + "k_norm.weight"] = w(HEAD_DIM, dt=torch.float32)
        t[p + "post_attention_layernorm.weight"] = w(H, dt=torch.float32)
        m = p + "mlp."
        if moe:
            t[m + "gate.weight"] = w(E, H)
            if per_expert:
                for e in range(E):
                    t[f"{m}experts.{e}.down_proj.weight"] = w(H, I_MOE)
                    t[f"{m}experts.{e}.gate_proj.weight"] = w(I_MOE, H)
                    t[f"{m}experts.{e}.up_proj.weight"] = w(I_MOE, H)
            else:
                t[m + "experts.gate_up_proj"] = w(E, 2 * I_MOE, H)
                t[m + "experts.down_proj"] = w(E, H, I_MOE)
            t[m + "shared_expert.gate_proj.weight"] = w(I_SHARED, H)
            t[m + "shared_expert.up_proj.weight"] = w(I_SHARED, H)
            t[m + "shared_expert.down_proj.weight"] = w(H, I_SHARED)
            t[m + "shared_expert_gate.weight"] = w(1, H)
        else:
            t[m + "gate_proj.weight"] = w(I_DENSE, H)
            t[m + "up_proj.weight"] = w(I_DENSE, H)
            t[m + "down_proj.weight"] = w(H, I_DENSE)
    t[VL + "norm.weight"] = w(H, dt=torch.float32)
    t["lm_head.weight"] = w(V, H)
    t["mtp.fc.weight"] = w(H, 2 * H)
    t["mtp.layers.0.step"] = torch.arange(3, dtype=torch.int64)
    return t


def shard_of(key: str) -> str:
    if ".layers.0." in key or "embed_tokens" in key:
        return SHARDS[0]
    if ".layers.1." in key:
        return SHARDS[1]
    return SHARDS[2]


def write_checkpoint(
    path: Path, tensors: dict, tie=False, arch="Qwen3_5ForConditionalGeneration"
) -> Path:
    path.mkdir(parents=True)
    groups: dict[str, dict] = {}
    for key, t in tensors.items():
        groups.setdefault(shard_of(key), {})[key] = t
    weight_map = {}
    for name, group in groups.items():
        st_write(path / name, group)
        weight_map.update({k: name for k in group})
    (path / checkpoint.INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=1)
    )
    (path / "config.json").write_text(
        json.dumps({"architectures": [arch], "text_config": {"tie_word_embeddings": tie}})
    )
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "generation_config.json").write_text("{}")
    return path


def dyadic(*shape, seed: int) -> torch.Tensor:
    """Multiples of 1/8 in [-0.5, 0.5]: exact in bf16, exact sums in float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).to(torch.float32) / 8


def write_adapter(path: Path, factors: dict, dtype=torch.bfloat16, **config) -> Path:
    """factors: module -> (A, B); embedding modules as ("emb", A, B); raw extra keys via config
    key "_extra" (name -> tensor)."""
    path.mkdir(parents=True)
    tensors = {}
    for module, f in factors.items():
        if f[0] == "emb":
            tensors[f"base_model.model.{module}.lora_embedding_A"] = f[1].to(dtype)
            tensors[f"base_model.model.{module}.lora_embedding_B"] = f[2].to(dtype)
        else:
            tensors[f"base_model.model.{module}.lora_A.weight"] = f[0].to(dtype)
            tensors[f"base_model.model.{module}.lora_B.weight"] = f[1].to(dtype)
    tensors.update(config.pop("_extra", {}))
    st_write(path / "adapter_model.safetensors", tensors)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "target_modules": sorted({m.split(".")[-1] for m in factors}),
        "target_parameters": None,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "fan_in_fan_out": False,
    }
    cfg.update(config)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def lin(module_shape: tuple[int, int], r: int, seed: int):
    out, inp = module_shape
    return dyadic(r, inp, seed=seed), dyadic(out, r, seed=seed + 1000)
