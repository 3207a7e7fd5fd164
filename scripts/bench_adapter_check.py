#!/usr/bin/env python3
"""Time `patchkit adapter check` on a ~1 GB adapter at Qwen3.5-35B-A3B widths.

Target: at most 5 s per GB of adapter on the 2-core machine. The adapter is
PEFT 0.21's layout (rank 64 on the routed experts' gate_up_proj and
down_proj through target_parameters, and on the shared expert and
attention/GDN projections) in bf16, over as many layers as make ~1 GB; the
values are random finite bf16 (a 16 MiB random block repeated), with one NaN
in the last tensor, so every byte is read and judged and the check must find
it. ``--worst`` makes every element +Inf instead: every chunk then takes the
path that counts and locates the bad values. The config.json has the 35B-A3B
widths (hidden 2048, 256 experts, moe_intermediate 512). Each run is a fresh
process (what an init container pays), with the page cache warm from writing
the file; prints seconds per run, s/GB of the median, and the child's peak
RSS.

    python scripts/bench_adapter_check.py [--layers 6] [--runs 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H, E, I_MOE, SHARED, VOCAB, LAYERS = 2048, 256, 512, 512, 248320, 40
R = 64
P = "base_model.model.model.language_model.layers."
BLOCK = 16 << 20


def config() -> dict:
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)]
    text = {
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "layer_types": types,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "vocab_size": VOCAB,
        "num_experts": E,
        "moe_intermediate_size": I_MOE,
        "shared_expert_intermediate_size": SHARED,
    }
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}


def shapes(layers: int) -> dict[str, tuple[int, int]]:
    t = {}
    for layer in range(layers):
        p = f"{P}{layer}."
        t[p + "mlp.experts.base_layer.lora_A.weight"] = (R * E, H)
        t[p + "mlp.experts.base_layer.lora_B.weight"] = (2 * I_MOE, R * E)
        t[p + "mlp.experts.lora_A.weight"] = (R * E, I_MOE)
        t[p + "mlp.experts.lora_B.weight"] = (H, R * E)
        t[p + "mlp.shared_expert.down_proj.lora_A.weight"] = (R, SHARED)
        t[p + "mlp.shared_expert.down_proj.lora_B.weight"] = (H, R)
        if (layer + 1) % 4:
            t[p + "linear_attn.in_proj_qkv.lora_A.weight"] = (R, H)
            t[p + "linear_attn.in_proj_qkv.lora_B.weight"] = (2 * 16 * 128 + 32 * 128, R)
            t[p + "linear_attn.out_proj.lora_A.weight"] = (R, 32 * 128)
            t[p + "linear_attn.out_proj.lora_B.weight"] = (H, R)
        else:
            t[p + "self_attn.q_proj.lora_A.weight"] = (R, H)
            t[p + "self_attn.q_proj.lora_B.weight"] = (2 * 16 * 256, R)
    return t


def finite_block() -> bytes:
    """Random bf16 whose exponents stay below all-ones (bit 6 of the top byte cleared)."""
    raw = bytearray(os.urandom(BLOCK))
    raw[1::2] = bytes(raw[1::2]).translate(bytes(b & 0xBF for b in range(256)))
    return bytes(raw)


def write_adapter(path: Path, layers: int, worst: bool = False) -> int:
    path.mkdir(parents=True)
    t = shapes(layers)
    header, offset = {}, 0
    for name, (rows, cols) in t.items():
        n = rows * cols * 2
        header[name] = {
            "dtype": "BF16",
            "shape": [rows, cols],
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = b"\x80\x7f" * (BLOCK // 2) if worst else finite_block()
    with open(path / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            n = min(left, BLOCK)
            f.write(block[:n])
            left -= n
        f.seek(8 + len(raw) + offset - 2)
        f.write(b"\xc0\x7f")  # one NaN, the last element of the last tensor
    targets = ["in_proj_qkv", "out_proj", "q_proj", "down_proj"]
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    cfg = {
        "peft_type": "LORA",
        "r": R,
        "lora_alpha": 2 * R,
        "target_modules": targets,
        "target_parameters": params,
        "use_rslora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return 8 + len(raw) + offset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="write the adapter here and keep it")
    ap.add_argument(
        "--worst", action="store_true", help="every element +Inf (the slow path on every byte)"
    )
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-adapter-"))
    adapter, model = work / "adapter", work / "model"
    size = write_adapter(adapter, args.layers, args.worst)
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config()))
    cmd = [
        sys.executable,
        "-m",
        "patchkit",
        "adapter",
        "check",
        str(adapter),
        "--model",
        str(model),
    ]
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 1 or "nonfinite" not in done.stdout:
            sys.exit(f"expected exit 1 with the NaN found, got {done.returncode}:\n{done.stdout}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    median = statistics.median(times)
    print(f"adapter: {size / 1e9:.3f} GB, {len(shapes(args.layers))} tensors")
    print("runs (s): " + ", ".join(f"{t:.2f}" for t in times))
    print(f"median {median:.2f} s = {median / (size / 1e9):.2f} s/GB; peak RSS {rss:.0f} MiB")
    print(done.stdout.splitlines()[0])
    if not args.keep:
        for f in adapter.iterdir():
            f.unlink()
        for d in (adapter, model):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        work.rmdir()


if __name__ == "__main__":
    main()
