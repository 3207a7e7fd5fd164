#!/usr/bin/env python3
"""A stand-in for a user's model and adapters, for `patchkit verify --model` on a GPU host.

Builds, with transformers and PEFT, a random Qwen3.5 hybrid of 8 layers (6
Gated DeltaNet + 2 attention, hidden 1024, 32k positions) and three PEFT
adapters saved with ``save_pretrained`` as a user would: ``full`` (rank 128
on attention, GDN and MLP projections), ``qkv`` (rank 64, GDN in_proj_qkv
only) and ``z`` (rank 64, GDN in_proj_z only; vLLM #47639 / #57851).

    python scripts/verify_model_gpu.py OUT
    python -m patchkit verify --model OUT/model --lora full=OUT/full \\
        --lora qkv=OUT/qkv --lora z=OUT/z [--tensor-parallel-size 2]

The commands and results of the run on the test H200 host are in
docs/h200-2026-11-30f/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from patchkit.proof.e2e import TARGET_MODULES, qwen35_config, scale_lora_b  # noqa: E402

LAYERS = dict(
    num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    max_position_embeddings=32768,
)
# name: (rank, target modules, scale of the random lora_B)
ADAPTERS = {
    "full": (128, TARGET_MODULES, 0.3),
    "qkv": (64, r".*language_model.*\.in_proj_qkv", 1.0),
    "z": (64, r".*language_model.*\.in_proj_z", 1.0),
}


def build(out: Path) -> None:
    """Save the model (bf16) and the three adapters under out."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(5)
    model = Qwen3_5ForConditionalGeneration(qwen35_config(**LAYERS)).to(torch.bfloat16)
    model.save_pretrained(out / "model")
    for name, (rank, targets, scale) in ADAPTERS.items():
        base = Qwen3_5ForConditionalGeneration.from_pretrained(out / "model", dtype=torch.bfloat16)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets,
                            init_lora_weights=False)  # fmt: skip
        scale_lora_b(get_peft_model(base, config), scale).save_pretrained(out / name)
        print(f"adapter {name}: rank {rank}, {targets}")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
