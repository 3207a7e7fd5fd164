#!/usr/bin/env python3
"""Stand-ins for a user's model and adapters, for `patchkit verify --model` on a GPU host.

Builds, with transformers and PEFT, a random Qwen3.5 hybrid and PEFT
adapters saved with ``save_pretrained`` as a user would. Presets:

- ``user`` (the default): 8 layers (6 Gated DeltaNet + 2 attention), hidden
  1024, and three adapters: ``full`` (rank 128 on attention, GDN and MLP
  projections), ``qkv`` (rank 64, GDN in_proj_qkv only) and ``z`` (rank 64,
  GDN in_proj_z only; vLLM #47639 / #57851).
- ``wide27b``: Qwen3.5-27B widths (those of scripts/bench_serving.py: hidden
  5120, intermediate 17408, 24/4 attention heads, 16/48 GDN heads) cut to 4
  layers (3 GDN + 1 attention, about 1.6 B parameters, 3.1 GB in bf16), and
  two rank-128 adapters: ``full`` (attention, GDN and MLP) and ``attn-mlp``
  (attention and MLP only). Built on the GPU when one is visible.

``--poison NAME`` also writes ``poisoned``: a copy of adapter NAME with an inf
in one lora_B (layer 1's mlp.down_proj, as scripts/nan_probe_gpu.py does),
for the run that shows the check fails when it should (issue 19, item 6):
served on the Triton backend (PATCHKIT_LORA_BACKEND=triton), `verify --model`
must fail and name it.

    python scripts/verify_model_gpu.py OUT [--preset user|wide27b] [--poison NAME]
    python -m patchkit verify --model OUT/model --lora full=OUT/full \\
        --lora qkv=OUT/qkv --lora z=OUT/z [--tensor-parallel-size 2]

The commands and results of the run on the test H200 host are in
docs/evidence.md; how a GPU sitting is planned and run is at its end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from patchkit.proof.e2e import TARGET_MODULES, qwen35_config, scale_lora_b  # noqa: E402

ATTN_MLP = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
# name: (text config over e2e's TINY_TEXT, {adapter: (rank, target modules, lora_B scale)})
PRESETS = {
    "user": (
        dict(
            num_hidden_layers=8,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            max_position_embeddings=32768,
        ),
        {
            "full": (128, TARGET_MODULES, 0.3),
            "qkv": (64, r".*language_model.*\.in_proj_qkv", 1.0),
            "z": (64, r".*language_model.*\.in_proj_z", 1.0),
        },
    ),
    "wide27b": (
        dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=24,
            num_key_value_heads=4,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            max_position_embeddings=32768,
        ),
        {"full": (128, TARGET_MODULES, 0.3), "attn-mlp": (128, ATTN_MLP, 0.3)},
    ),
}


def build(out: Path, preset: str = "user", text: dict | None = None) -> dict:
    """Save the model (bf16) and the preset's adapters under out; ``text`` overrides
    the preset's text config (the CPU dry run shrinks the widths with it)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    layers, adapters = PRESETS[preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(5)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration(qwen35_config(**{**layers, **(text or {})}))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out / "model")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters")
    del model
    built = {"model": str(out / "model")}
    for name, (rank, targets, scale) in adapters.items():
        base = Qwen3_5ForConditionalGeneration.from_pretrained(out / "model", dtype=torch.bfloat16)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets,
                            init_lora_weights=False)  # fmt: skip
        scale_lora_b(get_peft_model(base, config), scale).save_pretrained(out / name)
        built[name] = str(out / name)
        print(f"adapter {name}: rank {rank}, {targets}")
    return built


def poison(source: Path, dest: Path) -> str:
    """Copy an adapter with an inf in one lora_B (nan_probe_gpu's poison, the same place)."""
    from scripts.nan_probe_gpu import poison as poison_copy

    shutil.rmtree(dest, ignore_errors=True)
    name = poison_copy(source, dest)
    print(f"poisoned: {source.name} with inf in {name}")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="user")
    parser.add_argument("--poison", metavar="NAME", help="also write OUT/poisoned from NAME")
    args = parser.parse_args(argv)
    if args.poison and args.poison not in PRESETS[args.preset][1]:
        parser.error(f"--poison {args.poison}: the {args.preset} preset has "
                     f"{', '.join(PRESETS[args.preset][1])}")  # fmt: skip
    build(args.out, args.preset)
    if args.poison:
        poison(args.out / args.poison, args.out / "poisoned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
