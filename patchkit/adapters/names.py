"""PEFT's file names and tensor names, and where a module sits in a Qwen3.5 language model."""

from __future__ import annotations

import re

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
PICKLES = ("adapter_model.bin", "adapter_model.pt")
PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(r"(?:model\.(?:language_model\.)?|language_model\.model\.)?layers\.(\d+)\.(.+)")
_TOP = {
    "model.embed_tokens": "embed_tokens",
    "model.language_model.embed_tokens": "embed_tokens",
    "lm_head": "lm_head",
}


def layer_and_name(module: str) -> tuple[int | None, str] | None:
    """(layer, name under the layer) of a language-model module, (None, name) for the
    embeddings, None for another part (the vision tower, mtp)."""
    if module in _TOP:
        return None, _TOP[module]
    match = _LAYER.fullmatch(module)
    return (int(match[1]), match[2]) if match else None
