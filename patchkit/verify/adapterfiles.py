"""A PEFT LoRA adapter as the merge reads it: adapter_config.json, its tensors, PEFT's key rules.

``read_adapter_config`` is the reader `adapter check` uses too
(:mod:`patchkit.adapters.adapterconfig`: one rule for r, lora_alpha,
use_rslora and the patterns, whose keys are compiled by
patchkit.adapters.patterns so a hostile pattern cannot backtrack for ever),
refusing the first of its problems in one line naming the key: every
adapter whose delta is not scale * B @ A (DoRA, trained biases, replaced
modules, PiSSA-style inits, aLoRA, ...) is refused with the words `adapter
check` reports it in. ``module_keys`` groups the tensors by module as PEFT
names them and vLLM reads them; ``AdapterTensors`` reads them (safetensors
lazily, a .bin/.pt whole) and ``FactorCache`` keeps the float32 factors of
the merge within a byte budget. The sources read for these rules are in
docs/verify.md ("The merged reference").
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

from patchkit.adapters import adapterconfig
from patchkit.adapters.adapterconfig import AdapterConfig
from patchkit.adapters.directory import Directory
from patchkit.adapters.names import ADAPTER_CONFIG, ADAPTER_SAFETENSORS, PEFT_PREFIX, PICKLES
from patchkit.adapters.safetensorsfile import SafetensorsFile, dtype_name
from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.verify.checkpoint import CONFIG_BYTES

ADAPTER_BIN = PICKLES


class AdapterUnreadable(PatchkitError):
    """An adapter whose weights cannot be read: no weights file, or one that is no state
    dict (``path``: the directory or the file)."""

    code = Code.ADAPTER_UNREADABLE


class AdapterRefused(PatchkitError):
    """An adapter the merge refuses for what its tensors are (DoRA, a bias, a factor
    without its pair): ``path``, and the ``module`` or ``tensor`` where it knows it."""

    code = Code.ADAPTER_REFUSED


def read_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """The adapter's r, alpha and patterns, every value checked; one line naming the key if not.

    Read through the directory's descriptor as `adapter check` reads it (a
    regular file, or a link to one beside it; capped at 1 MiB; no FIFO, no
    device, no link out of the directory), by the same reader and rule, every
    pattern key compiled, so what is refused is refused before any file is
    written or GPU touched, in the words `adapter check` names it with.
    """
    return adapterconfig.read_strict(Path(adapter_dir))


class AdapterTensors:
    """The adapter's tensors: safetensors read lazily, or a .bin/.pt loaded whole.

    Its files are opened through the directory's descriptor (:class:`Directory`:
    a regular file, or a link to one beside it), held until :meth:`close`: a
    link out of the adapter or a FIFO is refused in one line naming the file.
    """

    def __init__(self, adapter_dir: Path):
        self.folder = Directory(adapter_dir)
        try:
            self._open(adapter_dir)
        except BaseException:
            self.folder.close()
            raise

    def _open(self, adapter_dir: Path) -> None:
        folder = self.folder
        self._file: SafetensorsFile | None = None
        self._loaded: dict | None = None
        if folder.has(ADAPTER_SAFETENSORS):
            self.path = adapter_dir / ADAPTER_SAFETENSORS
            self._file = SafetensorsFile(self.path, opener=lambda: folder.open(ADAPTER_SAFETENSORS))
            self.shapes = {k: v.shape for k, v in self._file.tensors.items()}
            self.dtypes = {k: v.dtype for k, v in self._file.tensors.items()}
            return
        for name in ADAPTER_BIN:
            if folder.has(name):
                import torch

                self.path = adapter_dir / name
                with folder.open(name) as f:
                    try:
                        loaded = torch.load(f, map_location="cpu", weights_only=True)
                    except Exception as exc:  # any unpickling failure: the user's file
                        raise AdapterUnreadable(
                            f"{self.path}: cannot be read as a state dict ({exc})",
                            path=self.path,
                            error=str(exc),
                        ) from exc
                if not isinstance(loaded, dict):
                    raise AdapterUnreadable(f"{self.path}: not a state dict", path=self.path)
                self._loaded = loaded
                self.shapes = {k: tuple(v.shape) for k, v in loaded.items()}
                self.dtypes = {k: dtype_name(v.dtype) for k, v in loaded.items()}
                return
        raise AdapterUnreadable(
            f"adapter directory {adapter_dir} has no {ADAPTER_SAFETENSORS} (or adapter_model.bin)",
            path=adapter_dir,
        )

    def float32(self, key: str):
        import torch

        if self._file is not None:
            return self._file.tensor(key).to(torch.float32)
        return self._loaded[key].to(torch.float32)

    def read_config(self) -> bytes:
        """adapter_config.json's bytes, read through the same descriptor, capped."""
        return self.folder.read_bytes(ADAPTER_CONFIG, CONFIG_BYTES, "a PEFT adapter config")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self.folder.close()


class FactorCache:
    """Adapter factors in float32, least recently used dropped past a byte budget."""

    def __init__(self, adapter: AdapterTensors, budget: int):
        self.adapter = adapter
        self.budget = budget
        self.items: OrderedDict[str, object] = OrderedDict()
        self.size = 0

    def get(self, key: str):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        t = self.adapter.float32(key)
        self.items[key] = t
        self.size += t.numel() * 4
        while self.size > self.budget and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.size -= old.numel() * 4
        return t


def module_keys(adapter: AdapterTensors) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Adapter tensors grouped by module: {module: {"A"|"B": key}}, plus notes."""
    modules: dict[str, dict[str, str]] = {}
    skipped = []
    for key in adapter.shapes:
        name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        if name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")):
            skipped.append(key)  # a full copy of the base embedding; vLLM skips it too
            continue
        if "lora_magnitude_vector" in name:
            raise AdapterRefused(
                f"{adapter.path}: {key} is a DoRA magnitude vector; DoRA is refused",
                path=adapter.path,
                tensor=key,
            )
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name) or re.fullmatch(
            r"(.+)\.lora_embedding_([AB])", name
        )
        if match is None:
            what = (
                "a lora_B bias (lora_bias)"
                if name.endswith(".lora_B.bias")
                else "not a LoRA factor"
            )
            raise AdapterRefused(
                f"{adapter.path}: tensor {key} is {what}; refused", path=adapter.path, tensor=key
            )
        module, which = match.group(1), match.group(2)
        entry = modules.setdefault(module, {})
        kind = "embedding" if "lora_embedding_" in name else "linear"
        if entry.setdefault("kind", kind) != kind:
            raise AdapterRefused(
                f"{adapter.path}: module {module} mixes lora_A/B and lora_embedding_A/B",
                path=adapter.path,
                module=module,
            )
        entry[which] = key
    for module, entry in modules.items():
        for which in ("A", "B"):
            if which not in entry:
                other = "B" if which == "A" else "A"
                raise AdapterRefused(
                    f"{adapter.path}: module {module} has lora_{other} but no lora_{which}",
                    path=adapter.path,
                    module=module,
                )
    notes = []
    if skipped:
        notes.append(
            f"{len(skipped)} full embedding copies in the adapter are ignored, as vLLM does "
            f"({skipped[0]})"
        )
    return modules, notes
