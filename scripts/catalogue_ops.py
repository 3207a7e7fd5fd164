"""The torch ops of matmul-add-lora-linear, built from the catalogue, for the benchmarks.

For a machine whose vLLM is not patched: the patch's new module is made in
memory from the catalogue's diff and imported from a temporary directory
that is removed when the benchmark exits.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from packaging.version import Version

from patchkit.catalogue import Variant, load_catalogue
from patchkit.hunks import apply_file_patch
from patchkit.kernelcheck import TORCH_OPS, module_from_source

_DIRECTORY = tempfile.TemporaryDirectory(prefix="patchkit-ops-")  # removed at exit


def torch_ops_from_catalogue(version: str):
    """(torch_lora_shrink, torch_lora_expand) as the patch would install them, or None."""
    variant = load_catalogue().get("matmul-add-lora-linear").expected_for(Version(version))
    if not isinstance(variant, Variant):
        return None
    relpath = TORCH_OPS.replace(".", "/") + ".py"
    text, _ = apply_file_patch(None, variant.file_patch(relpath))
    module = module_from_source("patchkit_lora_matmul", text, Path(_DIRECTORY.name))
    return module.torch_lora_shrink, module.torch_lora_expand
