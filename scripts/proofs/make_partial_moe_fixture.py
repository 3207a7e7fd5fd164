#!/usr/bin/env python3
"""Save what PEFT writes for LoRA on one or both fused expert parameters, and PEFT's delta.

tests/test_partial_moe_adapter.py loads these through each release's real
vLLM loader (pristine and patched by partial-moe-adapter) and compares the
experts' stacked LoRA with the delta PEFT itself merges, so the layout the
patch reads is PEFT's own, not one written by hand. The tests run without
PEFT; this script, run where transformers and PEFT are installed, makes the
file they read:

    pip install 'transformers>=5.17' 'peft==0.21.2'
    python scripts/proofs/make_partial_moe_fixture.py tests/data/peft-0.21.2-moe-one-parameter.pt

A tiny random Qwen3.5-MoE (scripts/proofs/check_merge_against_peft.py's: hidden 32,
4 experts of intermediate 12) with its routed experts' weights zeroed, so that
``merge_and_unload`` leaves exactly PEFT's delta in them; per case (``down``,
``gate_up``, ``both``) a rank-2 adapter on ``target_parameters`` with random
factors, saved with ``save_pretrained``. The file holds, per case, the
adapter_config.json fields, layer 0's expert tensors under PEFT's names, and
the merged (E, out, in) weights of layer 0's ``gate_up_proj`` and
``down_proj`` (float32).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_merge_against_peft import build  # noqa: E402

CASES = {
    "down": ["mlp.experts.down_proj"],
    "gate_up": ["mlp.experts.gate_up_proj"],
    "both": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
EXPERTS = "model.language_model.layers.0.mlp.experts"


def case(targets: list[str], work: Path, seed: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    model = build(True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.zero_()  # merge_and_unload then leaves exactly the delta
    config = LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=targets,
                        exclude_modules=r".*visual.*")  # fmt: skip
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(work)
    tensors = load_file(work / "adapter_model.safetensors")
    merged = peft_model.to(torch.float32).merge_and_unload().state_dict()
    return {
        "config": json.loads((work / "adapter_config.json").read_text()),
        "tensors": {k: v for k, v in tensors.items() if f"{EXPERTS}." in k},
        "merged": {p: merged[f"{EXPERTS}.{p}"].clone() for p in ("gate_up_proj", "down_proj")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import peft
    import torch
    import transformers

    saved = {"versions": {"transformers": transformers.__version__, "peft": peft.__version__}}
    with tempfile.TemporaryDirectory() as work:
        for seed, (name, targets) in enumerate(CASES.items()):
            saved[name] = case(targets, Path(work) / name, seed)
            shapes = {k.rsplit("experts", 1)[1]: tuple(v.shape)
                      for k, v in saved[name]["tensors"].items()}  # fmt: skip
            print(f"{name}: {shapes}")
    torch.save(saved, args.out)
    print(f"wrote {args.out} (transformers {transformers.__version__}, peft {peft.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
