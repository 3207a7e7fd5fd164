"""PEFT's file names and tensor names, and where a module sits in a Qwen3.5 language model."""

from __future__ import annotations

import re

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
PICKLES = ("adapter_model.bin", "adapter_model.pt")
PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(
    r"(?:model\.(?:language_model\.)?|language_model\.model\.)?layers\.([0-9]+)\.(.+)"
)
# The most digits of a layer's or an expert's index (the largest models have a few hundred
# layers and experts); int() of a 5,000-digit index raised ValueError.
MAX_INDEX_DIGITS = 9
NO_INDEX = -1  # an index no module of any model has
_TOP = {
    "model.embed_tokens": "embed_tokens",
    "model.language_model.embed_tokens": "embed_tokens",
    "lm_head": "lm_head",
}


def layer_and_name(module: str) -> tuple[int | None, str] | None:
    """(layer, name under the layer) of a language-model module, (None, name) for the
    embeddings, None for another part (the vision tower, mtp); the layer is NO_INDEX
    when its index is not one a model spells (:func:`index`)."""
    if module in _TOP:
        return None, _TOP[module]
    match = _LAYER.fullmatch(module)
    return (index(match[1]), match[2]) if match else None


def index(digits: str) -> int:
    """A layer's or an expert's index as a model's module names spell it (``0``, ``17``);
    NO_INDEX for one they never do: a leading zero (``01``) or more than
    MAX_INDEX_DIGITS digits. vLLM finds no module of such a name and skips its factors."""
    if len(digits) > MAX_INDEX_DIGITS or (len(digits) > 1 and digits[0] == "0"):
        return NO_INDEX
    return int(digits)
