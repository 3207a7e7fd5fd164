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
- ``moe``: e2e's tiny Qwen3.5-MoE (4 layers, hidden 1024, 8 routed experts of
  intermediate 256, top 2, a shared expert) and three rank-16 adapters on the
  routed experts through PEFT's ``target_parameters``: ``down``
  (``mlp.experts.down_proj`` only), ``gate_up`` (``mlp.experts.gate_up_proj``
  only) and ``both`` (vLLM #48460, patch partial-moe-adapter: unpatched vLLM
  loads only ``both``). PEFT writes the files; the factors are random, sized
  as e2e's expert factors so that the experts' LoRA is clearly visible.

- ``wide35b``: Qwen3.5/3.6-35B-A3B widths (hidden 2048, 256 routed experts
  of moe_intermediate 512, top 8, a shared expert of 512, 16/2 attention
  heads of 256, 16/32 GDN heads of 128) cut to 8 layers in the real model's
  3 GDN : 1 attention pattern (about 6.8 B parameters, 13.6 GB in bf16; the
  e2e vocabulary of 4096), and one rank-16 adapter ``a0`` on attention, GDN,
  the shared expert and the routed experts (``target_parameters``
  gate_up_proj and down_proj, the layout PEFT 0.21 writes). Built on the
  GPU. ``--poison a0`` puts the inf in layer 1's shared-expert down_proj.
  The whole proof in one command: scripts/proofs/verify_moe_proof.sh.

``--poison NAME`` also writes ``poisoned``: a copy of adapter NAME with an inf
in one lora_B (layer 1's mlp.down_proj, as scripts/proofs/nan_probe_gpu.py does),
for the run that shows the check fails when it should:
served on the Triton backend (PATCHKIT_LORA_BACKEND=triton), `verify --model`
must fail and name it.

    python scripts/proofs/verify_model_gpu.py OUT [--preset user|wide27b|moe] [--poison NAME]
    python -m patchkit verify --model OUT/model --lora full=OUT/full \\
        --lora qkv=OUT/qkv --lora z=OUT/z [--tensor-parallel-size 2]
    python -m patchkit verify --model OUT/model --lora down=OUT/down \\
        --lora gate_up=OUT/gate_up --lora both=OUT/both        # --preset moe

The commands and results of the run on the test H200 host are in
docs/evidence.md; how a GPU sitting is planned and run is at its end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from patchkit.verify.toolkit import (  # noqa: E402
    DENSE27B_WIDTHS,
    MOE35B_WIDTHS,
    MOE_TARGET_MODULES,
    TARGET_MODULES,
    expert_factors,
    qwen35_config,
    qwen35_moe_config,
    save_expert_adapter,
    scale_lora_b,
)

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
            DENSE27B_WIDTHS,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            max_position_embeddings=32768,
        ),
        {"full": (128, TARGET_MODULES, 0.3), "attn-mlp": (128, ATTN_MLP, 0.3)},
    ),
}


# The moe preset's adapters: the routed experts' fused parameters each trains.
MOE_ADAPTERS = {
    "down": ["mlp.experts.down_proj"],
    "gate_up": ["mlp.experts.gate_up_proj"],
    "both": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
MOE_RANK = 16

WIDE35B = MOE35B_WIDTHS  # Qwen3.5/3.6-35B-A3B widths, 8 layers
WIDE35B_ADAPTERS = {"a0": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
# lora_B of the linear modules, as e2e scales PEFT's random init (a visible effect,
# sane logits); the experts' factors as build_moe draws them.
WIDE35B_B_SCALE = 0.3
POISON_WIDE35B = "layers.1.mlp.shared_expert.down_proj.lora_B"


def build(out: Path, preset: str = "user", text: dict | None = None) -> dict:
    """Save the model (bf16) and the preset's adapters under out; ``text`` overrides
    the preset's text config (the CPU dry run shrinks the widths with it)."""
    if preset == "moe":
        return build_moe(out, text)
    if preset == "wide35b":
        return build_wide35b(out, text)
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


def build_moe(out: Path, text: dict | None = None) -> dict:
    """The moe preset: a Qwen3.5-MoE and PEFT adapters on one or both expert parameters
    (e2e.save_expert_adapter, which --e2e's MoE case uses for its partial adapters)."""
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(5)
    model = Qwen3_5MoeForConditionalGeneration(qwen35_moe_config(**(text or {})))
    model.to(torch.bfloat16).save_pretrained(out / "model")
    del model
    built = {"model": str(out / "model")}
    for name, targets in MOE_ADAPTERS.items():
        save_expert_adapter(out / "model", out / name, targets, MOE_RANK)
        built[name] = str(out / name)
        print(f"adapter {name}: rank {MOE_RANK}, target_parameters {targets}")
    return built


def build_wide35b(out: Path, text: dict | None = None) -> dict:
    """The wide35b preset: the model saved, then the same model wrapped by PEFT in place
    (no second 13.6 GB load) for the adapter; built on the GPU when one is visible."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5MoeForConditionalGeneration

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(5)
    with torch.device(device):
        model = Qwen3_5MoeForConditionalGeneration(qwen35_moe_config(**{**WIDE35B, **(text or {})}))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out / "model")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters")
    built = {"model": str(out / "model")}
    for name, targets in WIDE35B_ADAPTERS.items():
        config = LoraConfig(r=MOE_RANK, lora_alpha=MOE_RANK, target_modules=MOE_TARGET_MODULES,
                            target_parameters=targets, init_lora_weights=False,
                            exclude_modules=r".*visual.*")  # fmt: skip
        peft_model = scale_lora_b(get_peft_model(model, config), WIDE35B_B_SCALE)
        expert_factors(peft_model, MOE_RANK)  # the experts' factors as build_moe draws them
        peft_model.save_pretrained(out / name)
        model = peft_model.unload()  # the base model again, for the next adapter
        built[name] = str(out / name)
        print(f"adapter {name}: rank {MOE_RANK}, attention, GDN, shared expert, {targets}")
    return built


def poison_wide35b(source: Path, dest: Path) -> str:
    """The wide35b adapter with an inf in layer 1's shared-expert down_proj lora_B (it
    has no dense mlp.down_proj, where nan_probe_gpu's poison goes)."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    path = dest / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = next(n for n in sorted(tensors) if POISON_WIDE35B in n)
    tensors[name][0, 0] = float("inf")
    save_file(tensors, str(path), metadata={"format": "pt"})
    print(f"poisoned: {source.name} with inf in {name}")
    return name


def poison(source: Path, dest: Path) -> str:
    """Copy an adapter with an inf in one lora_B (nan_probe_gpu's poison, the same place:
    layer POISON_LAYER's mlp.down_proj, one value)."""
    from scripts.proofs.nan_probe_gpu import POISON_MODULE
    from scripts.proofs.nan_probe_gpu import poison as poison_copy

    shutil.rmtree(dest, ignore_errors=True)
    name = poison_copy(source, dest, POISON_MODULE, 1)
    print(f"poisoned: {source.name} with inf in {name}")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted([*PRESETS, "moe", "wide35b"]), default="user")
    parser.add_argument("--poison", metavar="NAME", help="also write OUT/poisoned from NAME")
    args = parser.parse_args(argv)
    adapters = {"moe": MOE_ADAPTERS, "wide35b": WIDE35B_ADAPTERS}.get(args.preset) or (
        PRESETS[args.preset][1]
    )
    if args.poison and args.poison not in adapters:
        parser.error(f"--poison {args.poison}: the {args.preset} preset has "
                     f"{', '.join(adapters)}")  # fmt: skip
    build(args.out, args.preset)
    if args.poison:
        make = poison_wide35b if args.preset == "wide35b" else poison
        make(args.out / args.poison, args.out / "poisoned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
