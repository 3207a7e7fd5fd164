"""Control adapters for `verify --model`: the user's adapter changed the way a bug changes it.

A verdict that passes an adapter says something only if it would have
failed the adapter served wrong. So every run serves, beside each adapter,
copies of it that a broken LoRA path would produce, and the verdict must
reject each one (PASSED needs every control rejected; one inside the bound
makes the adapter INCONCLUSIVE: the run could not tell the two apart):

- ``half``: every lora_B multiplied by 0.5, the adapter at 50 % strength
  (a wrong scaling, a lost alpha). Halving lora_B rather than lora_alpha
  keeps adapter_config.json byte for byte: rank_pattern, alpha_pattern and
  use_rslora all go on meaning what they meant (halving alpha would have to
  reach every alpha_pattern entry, and rsLoRA scales by alpha / sqrt(r)),
  and multiplying by 0.5 is exact in bf16, fp16 and fp32 (the exponent
  moves, the mantissa does not), so the control differs from the adapter by
  exactly half its delta and nothing else. It stays a valid PEFT adapter.
- ``no-experts``: the routed-expert factors dropped (vLLM reading an
  adapter's expert weights as absent, or as another projection's). PEFT
  writes them in three layouts: fused 3D parameters through
  ``target_parameters`` (``...mlp.experts.base_layer.lora_A/B`` and
  ``...mlp.experts.lora_A/B`` for two parameters, ``...mlp.experts.lora_A/B``
  alone for one) and per-expert 2D modules (``...mlp.experts.N.gate_proj``).
  The shared expert (``mlp.shared_expert``) is not a routed expert and stays.
  Its config drops ``target_parameters`` (it no longer holds them).
- ``ignored``: the adapter not applied at all; that is the base model's
  answers, served anyway, so it needs no files. An adapter with nothing but
  expert factors has ``no-experts`` equal to this, and is judged on the same
  base answers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from patchkit.adapters import safetensorsfile
from patchkit.verify import adapterfiles, enginefaults

HALF, NO_EXPERTS, IGNORED = "half", "no-experts", "ignored"
WHAT = {HALF: "50 % strength", NO_EXPERTS: "experts ignored", IGNORED: "adapter ignored"}
# Joins an adapter's NAME and the control's kind; NAME (usermodel.NAME) never holds it,
# so a control's name cannot be a user's adapter's.
SEP = "+"
HALF_SCALE = 0.5
# Routed-expert factors, as a key reads after PEFT's "base_model.model." prefix.
EXPERT_KEY = re.compile(
    r"(?:^|.*\.)mlp\.experts(?:\.base_layer)*\.lora_[AB]\.weight"
    r"|(?:^|.*\.)mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|gate_up_proj)\.lora_[AB]\.weight"
)


@dataclass(frozen=True)
class Control:
    """One control of an adapter: served from ``path`` as a LoRA adapter, or (``path``
    None) judged on the base model's answers, which is what it would serve."""

    adapter: str
    kind: str  # HALF, NO_EXPERTS or IGNORED
    path: Path | None

    @property
    def name(self) -> str:
        """Its LoRA name in the engine, and its request label after ``control:``."""
        return f"{self.adapter}{SEP}{self.kind}"

    @property
    def what(self) -> str:
        return WHAT.get(self.kind) or enginefaults.WHAT[self.fault]

    @property
    def fault(self) -> str | None:
        """The engine-side fault (patchkit.verify.enginefaults) this control is served
        with, or None for a control of the adapter's files."""
        return self.kind.removeprefix(enginefaults.PREFIX) if self.is_engine else None

    @property
    def is_engine(self) -> bool:
        return self.kind.startswith(enginefaults.PREFIX)

    @property
    def label(self) -> str:
        """The request label of its answers: its own, or the base model's."""
        return f"control:{self.name}" if self.path is not None else "base"


def is_expert_key(key: str) -> bool:
    """A routed expert's LoRA factor, in any of PEFT's three layouts."""
    name = key.removeprefix(adapterfiles.PEFT_PREFIX)
    return EXPERT_KEY.fullmatch(name) is not None


def build(adapter: str, adapter_dir: Path, workdir: Path) -> list[Control]:
    """The controls of one adapter, their files written under workdir/control-NAME+KIND.

    The adapter's files are the user's: read through its directory's descriptor
    (adapterfiles.AdapterTensors, as `adapter check` reads them), so a link out
    of the adapter or a FIFO is refused in one line naming the file."""
    tensors = adapterfiles.AdapterTensors(adapter_dir)
    try:
        keys = list(tensors.shapes)
        config_bytes = tensors.read_config()  # never by path: a link out, a FIFO
        out = [_half(adapter, tensors, keys, config_bytes, workdir)]
        experts = [k for k in keys if is_expert_key(k)]
        if experts and len(experts) < len(keys):
            kept = [k for k in keys if k not in experts]
            out.append(_no_experts(adapter, tensors, kept, config_bytes, workdir))
        elif experts:  # nothing left but the base model: judged on its answers
            out.append(Control(adapter, NO_EXPERTS, None))
    finally:
        tensors.close()
    out.append(Control(adapter, IGNORED, None))
    return out


def engine_controls(adapter: str, adapter_dir: Path, routed_experts: int) -> list[Control]:
    """The engine-side controls of one adapter: its own files, served under LoRA ids of
    their own that the engine changes as a bug in its LoRA code would
    (patchkit.verify.enginefaults; the expert fault only on a model with routed experts)."""
    return [
        Control(adapter, enginefaults.PREFIX + fault, adapter_dir)
        for fault in enginefaults.faults_for(routed_experts)
    ]


def _half(adapter, tensors, keys, config_bytes: bytes, workdir: Path) -> Control:
    control = Control(adapter, HALF, workdir / f"control-{adapter}{SEP}{HALF}")
    scaled = {key: _stored(tensors, key, HALF_SCALE if _is_b(key) else 1.0) for key in keys}
    _write(control.path, config_bytes, scaled)
    return control


def _no_experts(adapter, tensors, kept, config_bytes: bytes, workdir: Path) -> Control:
    control = Control(adapter, NO_EXPERTS, workdir / f"control-{adapter}{SEP}{NO_EXPERTS}")
    config = json.loads(config_bytes)
    if isinstance(config, dict) and config.get("target_parameters"):
        config["target_parameters"] = None
    _write(
        control.path,
        json.dumps(config, indent=2).encode(),
        {key: _stored(tensors, key, 1.0) for key in kept},
    )
    return control


def _is_b(key: str) -> bool:
    return ".lora_B." in key or key.endswith(".lora_embedding_B")


def _stored(tensors, key: str, scale: float):
    """The tensor in the dtype it was stored in, times ``scale`` (exact for 0.5)."""
    dtype = safetensorsfile.torch_dtype(tensors.dtypes[key])
    return (tensors.float32(key) * scale).to(dtype)


def _write(directory: Path, config_bytes: bytes, tensors: dict) -> None:
    directory.mkdir(parents=True)
    (directory / adapterfiles.ADAPTER_CONFIG).write_bytes(config_bytes)
    safetensorsfile.save_safetensors(
        directory / adapterfiles.ADAPTER_SAFETENSORS, tensors, {"format": "pt"}
    )
