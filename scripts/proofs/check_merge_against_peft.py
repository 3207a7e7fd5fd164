#!/usr/bin/env python3
"""Check patchkit's merged reference against PEFT's own merge, on real transformers models.

Builds tiny random Qwen3.5 (dense) and Qwen3.5-MoE models with transformers,
saves them in bf16 (transformers splits the fused experts into per-expert
tensors on save), makes PEFT LoRA adapters with random factors on them
(attention, GDN, MLP, shared expert, fused experts through
``target_parameters``; rsLoRA and rank/alpha patterns in some), and compares
every tensor ``patchkit.verify.mergewrite`` writes with ``merge_and_unload()``
of the same adapter in float32, cast to bf16. The expert layout PEFT writes
depends on its version (see docs/verify.md ("The merged reference")), so run it under
each PEFT of interest:

    pip install -e '.[gpu]'            # transformers + peft (no GPU needed here)
    python scripts/proofs/check_merge_against_peft.py [--keep DIR]

Prints one line per case and exits 1 when any tensor differs.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

CASES = {
    "dense": (
        False,
        dict(
            r=4,
            lora_alpha=8,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "in_proj_qkv",
                "in_proj_z",
                "in_proj_b",
                "in_proj_a",
                "out_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        ),
    ),
    "dense-rslora-patterns": (
        False,
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            rank_pattern={"o_proj": 2},
            alpha_pattern={"in_proj_z": 3},
            target_modules=["o_proj", "in_proj_z", "in_proj_qkv"],
        ),
    ),
    "moe": (
        True,
        dict(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj", "in_proj_qkv", "gate_proj", "up_proj", "down_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    ),
    "moe-down-only": (
        True,
        dict(
            r=2,
            lora_alpha=4,
            target_modules=[],
            target_parameters=["mlp.experts.down_proj"],
            rank_pattern={"experts.down_proj": 3},
        ),
    ),
    "moe-gate-up-only-rslora": (
        True,
        dict(
            r=2,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["o_proj", "shared_expert_gate"],
            target_parameters=["mlp.experts.gate_up_proj"],
            alpha_pattern={"gate_up_proj": 6},
        ),
    ),
}


def text_config(moe: bool) -> dict:
    cfg = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    )
    if moe:
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=12,
        )
    else:
        cfg.update(intermediate_size=48)
    return cfg


def build(moe: bool):
    import torch
    import transformers as tf

    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=1,
    )
    if moe:
        config = tf.Qwen3_5MoeConfig(text_config=text_config(True), vision_config=vision)
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = tf.Qwen3_5Config(text_config=text_config(False), vision_config=vision)
        model = tf.Qwen3_5ForConditionalGeneration(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model.to(torch.bfloat16)


def fuse_experts(out: dict, ref: dict) -> None:
    """Per-expert tensors of the saved checkpoint back into transformers' fused parameters."""
    import torch

    for key in ref:
        m = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", key)
        if not m or key in out:
            continue
        root, n = m.group(1), ref[key].shape[0]
        if m.group(2) == "gate_up_proj":
            parts = [
                torch.cat(
                    [out.pop(f"{root}.{e}.gate_proj.weight"), out.pop(f"{root}.{e}.up_proj.weight")]
                )
                for e in range(n)
            ]
        else:
            parts = [out.pop(f"{root}.{e}.down_proj.weight") for e in range(n)]
        out[key] = torch.stack(parts)


def check(name: str, moe: bool, lora: dict, work: Path) -> bool:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from patchkit.verify.toolkit import plan_merge, write_merged

    model = build(moe)
    model_dir = work / f"model-{name}"
    model.save_pretrained(model_dir, max_shard_size="20KB")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(exclude_modules=r".*visual.*", **lora))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.5)
    adapter_dir = work / f"lora-{name}"
    peft_model.save_pretrained(adapter_dir)
    ref = peft_model.to(torch.float32).merge_and_unload().state_dict()

    plan = plan_merge(model_dir, adapter_dir)
    write_merged(plan, work / f"merged-{name}")
    out = {}
    for f in (work / f"merged-{name}").glob("*.safetensors"):
        out.update(load_file(f))
    fuse_experts(out, ref)
    if set(out) != set(ref):
        print(f"{name}: FAIL, tensors differ in name: {sorted(set(out) ^ set(ref))[:4]}")
        return False
    differ = [k for k in out if not torch.equal(out[k], ref[k].to(out[k].dtype))]
    changed = sum(not torch.equal(out[k], base[k].to(out[k].dtype)) for k in out)
    kinds = sorted({m.kind for m in plan.modules})
    status = "ok" if not differ and changed else "FAIL"
    print(
        f"{name}: {status}, {changed} of {len(out)} tensors changed, {len(differ)} differ from "
        f"PEFT merge_and_unload (kinds {', '.join(kinds)}; {len(plan.notes)} notes)"
        + (f": {differ[:3]}" if differ else "")
    )
    for note in plan.notes:
        print(f"    note: {note}")
    return status == "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keep", type=Path, help="write the models and adapters here and keep them"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import peft
    import transformers

    print(f"transformers {transformers.__version__}, peft {peft.__version__}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="patchkit-merge-check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        ok = [check(name, moe, lora, work) for name, (moe, lora) in CASES.items()]
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
