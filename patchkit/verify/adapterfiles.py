"""A PEFT LoRA adapter as the merge reads it: adapter_config.json, its tensors, PEFT's key rules.

``read_adapter_config`` checks every value the merge uses (r, lora_alpha,
use_rslora, rank_pattern and alpha_pattern, whose keys are compiled by
patchkit.verify.patterns so a hostile pattern cannot backtrack for ever)
and refuses, in one line naming the key, every adapter whose delta is not
scale * B @ A (DoRA, trained biases, replaced modules, PiSSA-style inits,
aLoRA, ...). ``module_keys`` groups the tensors by module as PEFT names
them and vLLM reads them; ``AdapterTensors`` reads them (safetensors
lazily, a .bin/.pt whole) and ``FactorCache`` keeps the float32 factors
of the merge within a byte budget. The sources read for these rules are in
docs/verify.md ("The merged reference").
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.adapters.directory import Directory
from patchkit.adapters.safetensorsfile import SafetensorsFile, dtype_name, shown
from patchkit.errors import PatchkitError
from patchkit.verify.checkpoint import CONFIG_BYTES
from patchkit.verify.patterns import Matcher, compile_peft_key

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = ("adapter_model.bin", "adapter_model.pt")
PEFT_PREFIX = "base_model.model."
_OK_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass
class AdapterConfig:
    path: Path
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    target_parameters: list[str]
    # Each pattern key, compiled (patterns.compile_peft_key): matched without backtracking.
    matchers: dict[str, Matcher] = field(default_factory=dict, repr=False)

    def _pattern(self, which: str, pattern: dict, name: str):
        """The value of the first key matching the name, PEFT's rule (get_pattern_key);
        a key whose matching runs past patterns.MAX_WORK is refused in one line."""
        for key, value in pattern.items():
            try:
                found = self.matchers[key].match(name)
            except ValueError as exc:
                raise PatchkitError(
                    f"{self.path}: {which} key {shown(key)} is refused: {exc}"
                ) from None
            if found:
                return value
        return None

    def rank_alpha(self, name: str) -> tuple[int, float]:
        rank = self._pattern("rank_pattern", self.rank_pattern, name)
        alpha = self._pattern("alpha_pattern", self.alpha_pattern, name)
        return (self.r if rank is None else int(rank)), (self.alpha if alpha is None else alpha)

    def scale(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @property
    def global_scale(self) -> float:
        return self.scale(self.r, self.alpha)


def read_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """The adapter's r, alpha and patterns, every value checked; one line naming the key if not.

    Read through the directory's descriptor as `adapter check` reads it (a
    regular file, or a link to one beside it; capped at 1 MiB; no FIFO, no
    device, no link out of the directory) and every pattern key compiled here,
    so what is refused is refused before any file is written or GPU touched.
    """
    path = adapter_dir / ADAPTER_CONFIG
    with Directory(adapter_dir) as folder:
        if not folder.has(ADAPTER_CONFIG):
            raise PatchkitError(f"adapter directory {adapter_dir} has no {ADAPTER_CONFIG}")
        cfg = folder.read_json(ADAPTER_CONFIG, "a PEFT adapter config")

    def refuse(what: str) -> PatchkitError:
        return PatchkitError(f"{path}: {what}; patchkit merges plain LoRA adapters only")

    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise refuse(f"peft_type is {shown(peft_type)[1:-1]}, not LORA")
    if cfg.get("use_dora"):
        raise refuse("use_dora is set (DoRA rescales columns by a magnitude vector)")
    if str(cfg.get("bias", "none")) != "none":
        raise refuse(f"bias is {shown(cfg.get('bias'))} (the adapter trains base biases)")
    if cfg.get("lora_bias"):
        raise refuse("lora_bias is set (lora_B carries a bias)")
    if cfg.get("modules_to_save"):
        raise refuse(f"modules_to_save is {shown(cfg['modules_to_save'])} (whole modules replaced)")
    if cfg.get("trainable_token_indices"):
        raise refuse("trainable_token_indices is set (embedding rows replaced)")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _OK_INITS:
        raise refuse(
            f"init_lora_weights is {shown(init)} (PiSSA/OLoRA/CorDA/LoftQ change the base weights "
            "at init; convert the adapter with PEFT's path_initial_model_for_weight_conversion)"
        )
    if cfg.get("layer_replication"):
        raise refuse("layer_replication is set")
    if cfg.get("alora_invocation_tokens"):
        raise refuse("alora_invocation_tokens is set (aLoRA acts only after its invocation tokens)")
    if cfg.get("use_qalora"):
        raise refuse("use_qalora is set")
    if cfg.get("use_bdlora"):
        raise refuse("use_bdlora is set")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    # 4.7 was read as 4, "8" and true as 8 and 1: only a number that is a whole rank counts
    if not _is_number(r) or r != int(r) or r <= 0:
        raise PatchkitError(f"{path}: r is {shown(r)}; it must be a positive integer")
    if not _is_number(alpha):
        raise PatchkitError(f"{path}: lora_alpha is {shown(alpha)}; it must be a number")
    use_rslora = cfg.get("use_rslora") or False
    if not isinstance(use_rslora, bool):  # "false" was read as true
        raise PatchkitError(f"{path}: use_rslora is {shown(use_rslora)}, not true or false")
    rank_pattern = _mapping(path, cfg, "rank_pattern")
    alpha_pattern = _mapping(path, cfg, "alpha_pattern")
    for key, value in rank_pattern.items():
        if type(value) is not int or value <= 0:
            raise PatchkitError(
                f"{path}: rank_pattern[{shown(key)}] is {shown(value)}; ranks are positive integers"
            )
    for key, value in alpha_pattern.items():
        if not _is_number(value):
            raise PatchkitError(
                f"{path}: alpha_pattern[{shown(key)}] is {shown(value)}; a finite number"
            )
    target_parameters = cfg.get("target_parameters") or []
    if isinstance(target_parameters, str):
        target_parameters = [target_parameters]
    if not isinstance(target_parameters, list) or not all(
        isinstance(name, str) for name in target_parameters
    ):
        raise PatchkitError(f"{path}: target_parameters is not a list of parameter names")
    return AdapterConfig(
        path=path,
        r=int(r),
        alpha=float(alpha),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern),
        alpha_pattern=dict(alpha_pattern),
        target_parameters=list(target_parameters),
        matchers=_matchers(path, rank_pattern, alpha_pattern),
    )


def _is_number(value: object) -> bool:
    """An int or a float, not a bool (JSON numbers: finite, read_user_json saw to that)."""
    return type(value) in (int, float) and math.isfinite(value)


def _matchers(path: Path, rank_pattern: dict, alpha_pattern: dict) -> dict[str, Matcher]:
    """Every pattern key compiled now, so a key that is refused is refused before any work.

    PEFT and vLLM run each key through Python's re, where ``(.|.)*(.|.)*Q``
    backtracks for ever; patterns.compile_peft_key matches the same names in
    linear time, or refuses the key.
    """
    matchers = {}
    for which, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        for key in pattern:
            if key not in matchers:
                try:
                    matchers[key] = compile_peft_key(key)
                except ValueError as exc:
                    raise PatchkitError(
                        f"{path}: {which} key {shown(key)} is refused: {exc}"
                    ) from None
    return matchers


def _mapping(path: Path, cfg: dict, key: str) -> dict:
    """rank_pattern / alpha_pattern: an object, or one line (a list raised AttributeError)."""
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise PatchkitError(f"{path}: {key} is not a JSON object (module pattern to value)")
    return value


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
                        raise PatchkitError(
                            f"{self.path}: cannot be read as a state dict ({exc})"
                        ) from exc
                if not isinstance(loaded, dict):
                    raise PatchkitError(f"{self.path}: not a state dict")
                self._loaded = loaded
                self.shapes = {k: tuple(v.shape) for k, v in loaded.items()}
                self.dtypes = {k: dtype_name(v.dtype) for k, v in loaded.items()}
                return
        raise PatchkitError(
            f"adapter directory {adapter_dir} has no {ADAPTER_SAFETENSORS} (or adapter_model.bin)"
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
            raise PatchkitError(
                f"{adapter.path}: {key} is a DoRA magnitude vector; DoRA is refused"
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
            raise PatchkitError(f"{adapter.path}: tensor {key} is {what}; refused")
        module, which = match.group(1), match.group(2)
        entry = modules.setdefault(module, {})
        kind = "embedding" if "lora_embedding_" in name else "linear"
        if entry.setdefault("kind", kind) != kind:
            raise PatchkitError(
                f"{adapter.path}: module {module} mixes lora_A/B and lora_embedding_A/B"
            )
        entry[which] = key
    for module, entry in modules.items():
        for which in ("A", "B"):
            if which not in entry:
                other = "B" if which == "A" else "A"
                raise PatchkitError(
                    f"{adapter.path}: module {module} has lora_{other} but no lora_{which}"
                )
    notes = []
    if skipped:
        notes.append(
            f"{len(skipped)} full embedding copies in the adapter are ignored, as vLLM does "
            f"({skipped[0]})"
        )
    return modules, notes
