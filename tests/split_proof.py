"""Run inside a patched vLLM 0.17/0.18 tree (PYTHONPATH): exercise the real split code on CPU.

Prints one JSON object. Used by tests/test_split_backport.py; it needs vLLM's
own import dependencies, not a GPU. What it does, all with the tree's code:
- imports the patched models/qwen3_5.py;
- builds a Qwen3_5GatedDeltaNet from a tiny Qwen3.5 text config with and
  without the split, in a one-process (gloo) tensor-parallel group;
- wraps in_proj_qkv / in_proj_z with the LoRA layer classes vLLM's LoRA
  manager would pick for the patched packed mapping, loads the warm-up dummy
  LoRA the way the manager builds it, then a qkv + z adapter, and reads back
  each slice;
- feeds checkpoint-named weights through Qwen3_5Model.load_weights.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_K, HEAD_V, RANK = 64, 2, 4, 16, 16, 8


def init_parallel():
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_file = tempfile.mktemp()
    init_distributed_environment(1, 0, f"file://{init_file}", 0, backend="gloo")
    initialize_model_parallel(1, 1)


def text_config():
    from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=HEAD_K,
        linear_value_head_dim=HEAD_V,
        linear_conv_kernel_dim=4,
    )


def build_gdn(config, split: bool, prefix: str):
    from vllm.model_executor.models.qwen3_5 import Qwen3_5GatedDeltaNet

    return Qwen3_5GatedDeltaNet(config, prefix=prefix, split_in_proj_qkvz=split)


def lora_round_trip(gdn, packed_mapping) -> dict:
    """Wrap both projections as the LoRA manager would, load dummy then real weights."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.utils import from_layer

    lora_config = LoRAConfig(max_lora_rank=RANK, max_loras=2, lora_dtype=torch.float32)
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name in ("in_proj_qkv", "in_proj_z"):
        layer = from_layer(getattr(gdn, name), 2, lora_config, packed_mapping.get(name, []))
        out[name] = {"class": type(layer).__name__}
        dummy = LoRALayerWeights.create_dummy_lora_weights(
            name,
            layer.lora_a_stacked[0].shape[-1],
            layer.lora_b_stacked[0].shape[-2],
            RANK,
            layer.lora_a_stacked[0].dtype,
            "cpu",
        )
        layer.set_lora(0, dummy.lora_a, dummy.lora_b)
        sizes = list(getattr(layer.base_layer, "output_sizes", [layer.base_layer.output_size]))
        lora_a = torch.randn(RANK, HIDDEN, generator=gen)
        lora_b = torch.randn(sum(sizes), RANK, generator=gen)
        layer.set_lora(1, lora_a, lora_b)
        slices_ok, start = [], 0
        for i, size in enumerate(sizes):
            a_ok = torch.equal(
                layer.lora_a_stacked[i][1, 0], lora_a.to(layer.lora_a_stacked[i].dtype)
            )
            b_ok = torch.equal(
                layer.lora_b_stacked[i][1, 0, :size],
                lora_b[start : start + size].to(layer.lora_b_stacked[i].dtype),
            )
            slices_ok.append(a_ok and b_ok)
            start += size
        out[name].update(slices=sizes, slices_ok=slices_ok)
    return out


def fused_lora_error(gdn, packed_mapping) -> str:
    """The unpatched layout under LoRA: 4 slices, 2 packed names (vLLM #35286)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.utils import from_layer

    lora_config = LoRAConfig(max_lora_rank=RANK, max_loras=2, lora_dtype=torch.float32)
    names = packed_mapping["in_proj_qkvz"]
    layer = from_layer(gdn.in_proj_qkvz, 2, lora_config, names)
    dummies = [
        LoRALayerWeights.create_dummy_lora_weights(
            n, HIDDEN, layer.lora_b_stacked[i].shape[-2], RANK, torch.float32, "cpu"
        )
        for i, n in enumerate(names)
    ]  # what the manager packs for two names
    try:
        layer.set_lora(0, [d.lora_a for d in dummies], [d.lora_b for d in dummies])
    except Exception as exc:  # noqa: BLE001 - the point is which error
        return f"{type(layer).__name__}: {type(exc).__name__}: {exc}"
    return f"{type(layer).__name__}: no error"


def load(config, split: bool) -> dict:
    """Checkpoint names in, parameters out, through the real Qwen3_5Model.load_weights."""
    from vllm.model_executor.models.qwen3_5 import Qwen3_5Model

    class Holder(torch.nn.Module):
        load_weights = Qwen3_5Model.load_weights
        get_expert_mapping = staticmethod(lambda: [])

        def __init__(self):
            super().__init__()
            self.config = config
            self.split_in_proj_qkvz = split
            self.layers = torch.nn.ModuleList([build_gdn(config, split, f"L{split}.0")])

    model = Holder()
    gen = torch.Generator().manual_seed(1)
    key, value = KEY_HEADS * HEAD_K, VALUE_HEADS * HEAD_V
    qkv = torch.randn(2 * key + value, HIDDEN, generator=gen)
    z = torch.randn(value, HIDDEN, generator=gen)
    loaded = model.load_weights(
        [("layers.0.in_proj_qkv.weight", qkv), ("layers.0.in_proj_z.weight", z)]
    )
    gdn = model.layers[0]
    if split:
        ok = torch.equal(gdn.in_proj_qkv.weight, qkv) and torch.equal(gdn.in_proj_z.weight, z)
    else:
        ok = torch.equal(gdn.in_proj_qkvz.weight, torch.cat([qkv, z]))
    return {"loaded": sorted(loaded), "weights_ok": ok}


def main() -> None:
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    # A release wheel's version has no "+cpu", so vLLM would not pick its CPU
    # platform by itself on a machine without GPUs.
    vllm.platforms._current_platform = CpuPlatform()
    if not hasattr(torch._C._cpu, "_is_avx512_supported"):
        # vLLM 0.17's CPU platform probes this torch 2.10 function at import;
        # newer torch builds (where this runs) dropped it. Only kernel
        # selection for the CPU backend reads it, which this proof never runs.
        torch._C._cpu._is_avx512_supported = lambda: False
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        run()


def run() -> None:
    import vllm.model_executor.models.qwen3_5 as qwen3_5

    init_parallel()
    config = text_config()
    split = build_gdn(config, True, "s.0")
    fused = build_gdn(config, False, "f.0")
    mapping = qwen3_5.split_packed_mapping(qwen3_5.Qwen3_5ForCausalLMBase.packed_modules_mapping)
    result = {
        "module": qwen3_5.__file__,
        "split": {
            "flag": split.split_in_proj_qkvz,
            "in_proj_qkvz": split.in_proj_qkvz is None,
            "qkv_sizes": list(split.in_proj_qkv.output_sizes),
            "z_size": split.in_proj_z.output_size,
        },
        "fused": {
            "flag": fused.split_in_proj_qkvz,
            "has_split_layers": hasattr(fused, "in_proj_qkv") or hasattr(fused, "in_proj_z"),
            "qkvz_sizes": list(fused.in_proj_qkvz.output_sizes),
        },
        "packed_mapping": mapping,
        "lora": lora_round_trip(split, mapping),
        "fused_lora_error": fused_lora_error(
            fused, qwen3_5.Qwen3_5ForCausalLMBase.packed_modules_mapping
        ),
        "load_split": load(config, True),
        "load_fused": load(config, False),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.exit(main())
