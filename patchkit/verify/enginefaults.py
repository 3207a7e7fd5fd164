"""Engine-side controls of `verify --model`: vLLM's LoRA code changed inside the serving
process, as real bugs change it, in the engines the run starts anyway.

The adapter-side controls (patchkit.verify.adaptercontrols) change the adapter's files;
a bug in vLLM's LoRA code changes what the engine does with correct files. So each
LoRA engine also serves the user's adapter, from the same files, under a LoRA id of its
own per fault, and when vLLM's LoRAModelManager.activate_adapter has written that id's
weights into a slot, the fault changes the slot's stacked tensors in place:

- ``scale-2``: every lora_B of the slot doubled (a LoRA scaling applied twice);
- ``layer-skipped``: every lora_B of one decoder layer (the first that has LoRA
  modules) zeroed: that layer's LoRA skipped. The first, because a skip there reaches
  every layer after it: on a CPU stand-in of the 35B-A3B-wide cut (256 experts top 8,
  transformers + PEFT in bf16 against float32; docs/evidence.md) skipping layer 0 moved
  the answers as far as half strength does (6.4-7.3x the bf16 noise against 6.7-6.8x),
  the middle layer no farther than the healthy adapter's own distance (3.0-3.3x against
  2.4-3.4x): a fault no rule can tell from noise proves nothing;
- ``experts-down-dropped`` (models with routed experts): the routed experts' down
  projection (w2) lora_B zeroed in every MoE layer, the gate/up projection kept;
- ``b-permuted``: the rows of every lora_B permuted (a fixed permutation per
  tensor): the slot serves another adapter of the same strength, as a request
  given another slot's adapter would.

The adapter's own id is never touched, and vLLM rewrites a slot whole whenever it
activates another adapter there, so nothing is restored: a fault lives exactly as
long as its id's weights sit in the slot, and CUDA graphs, which read these very
buffers, see it. Doubling, zeroing and permuting are exact in bf16.

The worker side (FaultExtension) runs in vLLM's worker processes, through
``worker_extension_cls`` and ``LLM.collective_rpc``; the names it reads
(``model_runner.lora_manager._adapter_manager``, ``activate_adapter``,
``lora_index_to_id``, ``modules``, ``lora_b_stacked``, ``w13_lora_b_stacked``,
``w2_lora_b_stacked``) are those of vLLM 0.20.0-0.34.0, on both model runners
(tests/test_enginefaults.py reads them from the real trees).
"""

from __future__ import annotations

import re

SCALE_2, LAYER_SKIPPED, EXPERTS_DOWN_DROPPED, B_PERMUTED = (
    "scale-2",
    "layer-skipped",
    "experts-down-dropped",
    "b-permuted",
)
WHAT = {
    SCALE_2: "LoRA scale doubled in vLLM",
    LAYER_SKIPPED: "first LoRA layer skipped in vLLM",
    EXPERTS_DOWN_DROPPED: "experts' down_proj LoRA dropped in vLLM",
    B_PERMUTED: "another adapter's weights in its slot",
}
DENSE_FAULTS = (SCALE_2, LAYER_SKIPPED, B_PERMUTED)
MOE_FAULTS = (*DENSE_FAULTS, EXPERTS_DOWN_DROPPED)
PREFIX = "engine-"  # a control kind "engine-scale-2": adaptercontrols.Control.kind
EXTENSION = "patchkit.verify.enginefaults.FaultExtension"
INSTALL = "patchkit_install_faults"  # the methods collective_rpc calls: FaultExtension's
APPLIED = "patchkit_fault_applications"
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PERMUTATION_SEED = 20261207


def faults_for(routed_experts: int) -> tuple[str, ...]:
    """The faults a model is served with: the expert fault only where experts are."""
    return MOE_FAULTS if routed_experts else DENSE_FAULTS


def not_applied(ids: dict[str, int], faults: dict[str, str], applied: list) -> dict[str, str]:
    """{LoRA name: why} of the faults asked (``faults``: {name: fault}) that some worker
    never applied to a tensor: ``applied`` is each worker's records (id, slot, fault, n),
    ``ids`` each name's LoRA id. Such a control served the adapter itself (or, under
    tensor parallelism, part of it changed): it measures nothing it stands for, and must
    not be read as a fault the run caught or missed. A worker's answer of another shape
    than the extension writes says nothing applied, never ends the serving child."""
    workers = applied if isinstance(applied, (list, tuple)) else []
    out = {}
    for name, fault in faults.items():
        lora_id = ids[name]
        misses = [
            worker
            for worker, records in enumerate(workers)
            if not _changed_a_tensor(records, lora_id, fault)
        ]
        if misses or not workers:
            where = f"worker {misses[0]} of {len(workers)}" if workers else "no worker"
            out[name] = (
                f"its engine-side fault ({fault}) changed no tensor in {where}: "
                "not the control it stands for"
            )
    return out


def _changed_a_tensor(records: object, lora_id: int, fault: str) -> bool:
    """Whether one worker's records hold (``lora_id``, slot, ``fault``, n > 0): a record is
    the extension's 4-tuple (a list once through JSON), its id and count ints."""
    if not isinstance(records, (list, tuple)):
        return False
    return any(
        isinstance(r, (list, tuple))
        and len(r) == 4
        and _count(r[0]) == lora_id
        and r[2] == fault
        and (_count(r[3]) or 0) > 0
        for r in records
    )


def _count(value: object) -> int | None:
    """An int the extension wrote; None for anything else (True is no tensor count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def layer_of(module_name: str) -> int | None:
    found = LAYER.search(module_name)
    return int(found.group(1)) if found else None


def b_tensors(module) -> list:
    """The stacked lora_B tensors of one LoRA module, slot first. A fused-MoE module's
    are w13 and w2 (its ``lora_b_stacked`` is a list of views into them, per expert,
    which must not be changed a second time)."""
    if getattr(module, "w13_lora_b_stacked", None) is not None:
        return [*_as_list(module.w13_lora_b_stacked), *_as_list(module.w2_lora_b_stacked)]
    return _as_list(getattr(module, "lora_b_stacked", None))


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def skipped_layer(modules: dict) -> int | None:
    """The layer ``layer-skipped`` skips: the first decoder layer that holds LoRA modules."""
    return min((n for n in map(layer_of, modules) if n is not None), default=None)


def apply_fault(modules: dict, index: int, fault: str) -> int:
    """Change slot ``index`` of the LoRA modules ({name: module}) as ``fault`` says; the
    number of tensors changed (0: the fault found nothing to change here)."""
    import torch

    changed = 0
    skipped = skipped_layer(modules) if fault == LAYER_SKIPPED else None
    with torch.no_grad():
        for name, module in modules.items():
            if fault == SCALE_2:
                for b in b_tensors(module):
                    b[index].mul_(2.0)
                    changed += 1
            elif fault == LAYER_SKIPPED and layer_of(name) == skipped:
                for b in b_tensors(module):
                    b[index].zero_()
                    changed += 1
            elif fault == EXPERTS_DOWN_DROPPED:
                for b in _as_list(getattr(module, "w2_lora_b_stacked", None)):
                    b[index].zero_()
                    changed += 1
            elif fault == B_PERMUTED:
                for number, b in enumerate(b_tensors(module)):
                    _permute_rows(b[index], number)
                    changed += 1
    return changed


def _permute_rows(slot, number: int) -> None:
    """Permute the output rows (dimension -2) of one slot's lora_B, the same way on every
    run: a fixed generator per tensor."""
    import torch

    rows = slot.shape[-2]
    generator = torch.Generator().manual_seed(PERMUTATION_SEED + number)
    order = torch.randperm(rows, generator=generator).to(slot.device)
    slot.copy_(slot.index_select(slot.dim() - 2, order))


def wrap_activate(manager, faults: dict[int, str], record: list) -> None:
    """Wrap ``manager.activate_adapter`` (vLLM's LoRAModelManager, this instance) so that
    the slot of a faulted id is changed after vLLM fills it, and only then; each
    application is appended to ``record`` as (id, slot, fault, tensors changed)."""
    activate = manager.activate_adapter

    def activate_adapter(lora_id, *args, **kwargs):
        # vLLM calls this for every active adapter at every step and returns at once when
        # the id already holds a slot: only a slot just written takes the fault, once
        written = lora_id not in manager.lora_index_to_id
        result = activate(lora_id, *args, **kwargs)
        fault = faults.get(lora_id)
        if fault is not None and written and lora_id in manager.lora_index_to_id:
            index = manager.lora_index_to_id.index(lora_id)
            record.append((lora_id, index, fault, apply_fault(manager.modules, index, fault)))
        return result

    manager.activate_adapter = activate_adapter


class FaultExtension:
    """Mixed into vLLM's GPU worker by ``worker_extension_cls``: the method the serving
    child calls once, through ``LLM.collective_rpc``, right after the engine starts."""

    def patchkit_install_faults(self, faults: dict) -> dict:
        """Install the faults ({LoRA int id: fault}) in this worker's LoRA manager; what it
        found: the LoRA modules it can reach and the layer a skip would take."""
        manager = self.model_runner.lora_manager._adapter_manager
        self.patchkit_fault_record = []
        wrap_activate(manager, {int(k): v for k, v in faults.items()}, self.patchkit_fault_record)
        return {"modules": len(manager.modules), "skipped_layer": skipped_layer(manager.modules)}

    def patchkit_fault_applications(self) -> list:
        """Every fault applied so far in this worker: (id, slot, fault, tensors changed)."""
        return list(getattr(self, "patchkit_fault_record", []))
