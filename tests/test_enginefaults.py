"""verify's engine-side controls (patchkit.verify.enginefaults).

The worker side reads vLLM's LoRA bookkeeping by name: those names are read here from
the real trees of the releases it serves (0.20.0 to 0.34.0, both model runners). The
faults themselves are torch in place on tensors of the shapes and layouts vLLM creates
(slot first; B rank-major as the torch LoRA path re-lays it): each changes its own slot
only, as its bug would, and is applied again whenever vLLM fills the slot again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from patchkit.verify import enginefaults as ef
from tests.conftest import release_tree

torch = pytest.importorskip("torch", reason="the faults are torch in place")

RELEASES = ("0.20.0", "0.26.0", "0.29.0", "0.33.0", "0.34.0")


def source(version: str, path: str) -> str:
    return (release_tree(version) / "vllm" / path).read_text()


@pytest.mark.parametrize("version", RELEASES)
def test_the_names_the_worker_side_reads_are_vllms(version):
    parallel = source(version, "config/parallel.py")
    assert re.search(r"^\s+worker_extension_cls: str", parallel, re.M)
    assert "worker_extension_cls" in source(version, "v1/worker/worker_base.py")
    mixin = source(version, "v1/worker/lora_model_runner_mixin.py")
    assert "self.lora_manager = LRUCacheWorkerLoRAManager(" in mixin
    for runner in ("v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"):
        path = release_tree(version) / "vllm" / runner
        if path.exists():  # 0.34.0 has V2 alone; 0.20.0 has V1 alone
            assert re.search(r"class GPUModelRunner\([^)]*LoRAModelRunnerMixin", path.read_text())
    assert "self._adapter_manager = lora_manager" in source(version, "lora/worker_manager.py")
    manager = source(version, "lora/model_manager.py")
    assert re.search(r"def activate_adapter\(\s*self,\s*lora_id: int", manager)
    assert "self.lora_index_to_id[index] = lora_model.id" in manager
    # an id already in a slot returns at once, nothing written: wrap_activate's premise
    assert re.search(r"def activate_adapter\(.*?\n\s+if lora_id in self._active_adapters:\n"
                     r"\s+return False", manager, re.S)  # fmt: skip
    assert "self.modules: dict[str, BaseLayerWithLoRA]" in manager
    assert "self.lora_b_stacked = tuple(" in source(version, "lora/layers/base_linear.py")
    moe = source(version, "lora/layers/fused_moe.py")
    assert "self.w13_lora_b_stacked: tuple[torch.Tensor, ...] = tuple(" in moe
    assert "self.w2_lora_b_stacked: tuple[torch.Tensor, ...] = (" in moe
    # the fused MoE layer's lora_b_stacked: views into w13/w2, never changed twice
    assert re.search(r"self.lora_b_stacked.append\(\s*self.w2_lora_b_stacked\[0\]\[lora_id\]", moe)


SLOTS, RANK = 3, 4


class Linear:
    """A LoRA linear layer's weights as vLLM creates them: B (slots, 1, out, rank)."""

    def __init__(self, out: int, rank_major: bool = False):
        b = torch.randn(SLOTS, 1, out, RANK)
        if rank_major:  # as patchkit's torch LoRA path re-lays it: same shape, new strides
            b = b.reshape(SLOTS, out, RANK).transpose(1, 2).contiguous()
            b = b.as_strided((SLOTS, 1, out, RANK), (RANK * out, RANK * out, 1, out))
        self.lora_b_stacked = (b,)


class FusedMoE:
    """A fused-MoE LoRA layer's: w13 per slice and w2 (slots, experts, out, rank), and
    lora_b_stacked as views into them."""

    def __init__(self, experts: int = 4):
        self.w13_lora_b_stacked = tuple(torch.randn(SLOTS, experts, 6, RANK) for _ in "gu")
        self.w2_lora_b_stacked = (torch.randn(SLOTS, experts, 8, RANK),)
        self.lora_b_stacked = [self.w2_lora_b_stacked[0][s][0] for s in range(SLOTS)]


def model() -> dict:
    return {
        "model.layers.0.linear_attn.in_proj_qkvz": Linear(12),
        "model.layers.1.linear_attn.out_proj": Linear(8, rank_major=True),
        "model.layers.1.mlp.experts": FusedMoE(),
        "model.layers.2.self_attn.qkv_proj": Linear(10),
        "model.layers.3.mlp.experts": FusedMoE(),
    }


def snapshot(modules: dict) -> dict:
    return {
        (name, n): t.clone()
        for name, m in modules.items()
        for n, t in enumerate([*ef.b_tensors(m)])
    }


def changed_slots(before: dict, modules: dict) -> dict:
    """{(module, tensor): [slots that differ]}."""
    out = {}
    for (name, n), old in before.items():
        new = ef.b_tensors(modules[name])[n]
        slots = [s for s in range(SLOTS) if not torch.equal(old[s], new[s])]
        if slots:
            out[(name, n)] = slots
    return out


def test_scale_2_doubles_every_b_of_its_slot_only():
    modules = model()
    before = snapshot(modules)
    assert ef.apply_fault(modules, 1, ef.SCALE_2) == len(before)
    changed = changed_slots(before, modules)
    assert len(changed) == len(before) and all(v == [1] for v in changed.values())
    for (name, n), old in before.items():
        assert torch.equal(ef.b_tensors(modules[name])[n][1], old[1] * 2)


def test_layer_skipped_zeroes_the_first_lora_layer_of_its_slot_only():
    modules = model()
    before = snapshot(modules)
    ef.apply_fault(modules, 2, ef.LAYER_SKIPPED)
    assert ef.skipped_layer(modules) == 0
    assert changed_slots(before, modules) == {("model.layers.0.linear_attn.in_proj_qkvz", 0): [2]}
    assert not ef.b_tensors(modules["model.layers.0.linear_attn.in_proj_qkvz"])[0][2].any()
    # the first layer that has LoRA modules, not layer 0 as such
    later = {k: v for k, v in model().items() if ".layers.0." not in k}
    assert ef.skipped_layer(later) == 1 and ef.skipped_layer({}) is None


def test_experts_down_dropped_zeroes_w2_only_and_keeps_gate_up():
    modules = model()
    before = snapshot(modules)
    ef.apply_fault(modules, 0, ef.EXPERTS_DOWN_DROPPED)
    w2 = {(name, 2): [0] for name in modules if name.endswith("experts")}  # w13 g, u, then w2
    assert changed_slots(before, modules) == w2
    for name in w2:
        assert not modules[name[0]].w2_lora_b_stacked[0][0].any()


def test_b_permuted_moves_rows_of_its_slot_and_keeps_their_values():
    modules = model()
    before = snapshot(modules)
    ef.apply_fault(modules, 1, ef.B_PERMUTED)
    changed = changed_slots(before, modules)
    assert changed and all(v == [1] for v in changed.values())
    for (name, n), old in before.items():
        new = ef.b_tensors(modules[name])[n][1]
        rows = old[1].reshape(-1, old.shape[-2], RANK).transpose(1, 2).reshape(-1, old.shape[-2])
        again = new.reshape(-1, old.shape[-2], RANK).transpose(1, 2).reshape(-1, old.shape[-2])
        assert torch.equal(rows.sort(dim=1).values, again.sort(dim=1).values)


class Manager:
    """vLLM's LoRAModelManager as activate_adapter uses it: the id's weights written into
    the first free slot (here: a fixed value per id), its id in lora_index_to_id."""

    def __init__(self):
        self.modules = model()
        self.lora_index_to_id = [None] * SLOTS

    def activate_adapter(self, lora_id: int) -> bool:
        if lora_id in self.lora_index_to_id:  # as vLLM: already in a slot, nothing written
            return False
        index = self.lora_index_to_id.index(None)
        self.lora_index_to_id[index] = lora_id
        for module in self.modules.values():
            for b in ef.b_tensors(module):
                b[index].fill_(float(lora_id))
        return True

    def deactivate_adapter(self, lora_id: int) -> None:
        self.lora_index_to_id[self.lora_index_to_id.index(lora_id)] = None


def test_the_fault_follows_its_id_into_whatever_slot_it_gets_and_nothing_else():
    manager, record = Manager(), []
    ef.wrap_activate(manager, {2: ef.SCALE_2}, record)
    manager.activate_adapter(1)  # the healthy adapter: slot 0, untouched
    manager.activate_adapter(2)  # its engine-side control: slot 1, doubled
    manager.activate_adapter(2)  # the next step asks again: already there, not again
    b = ef.b_tensors(manager.modules["model.layers.0.linear_attn.in_proj_qkvz"])[0]
    assert torch.all(b[0] == 1.0) and torch.all(b[1] == 4.0)
    manager.deactivate_adapter(1)
    manager.deactivate_adapter(2)
    manager.activate_adapter(2)  # back in slot 0: vLLM wrote it whole, the fault again
    assert torch.all(b[0] == 4.0)
    assert [(i, s, f) for i, s, f, _ in record] == [(2, 1, ef.SCALE_2), (2, 0, ef.SCALE_2)]


def test_the_faults_a_model_is_served_with():
    assert ef.EXPERTS_DOWN_DROPPED not in ef.faults_for(0)
    assert ef.EXPERTS_DOWN_DROPPED in ef.faults_for(256)


def test_the_serving_child_installs_each_fault_under_its_loras_id():
    """serving.serve calls _install_faults right after the engine starts: one
    collective_rpc to every worker, {LoRA int id: fault}, the ids _run_requests uses."""
    from patchkit.verify import serving

    calls = []

    class Engine:  # what _install_faults uses of vllm.LLM
        def collective_rpc(self, method, args=()):
            calls.append((method, args))
            return [{"modules": 5, "skipped_layer": 0}]

    loras = {"one": "/a/one", "one+half": "/c/half", "one+engine-scale-2": "/a/one"}
    job = serving.Job("eager", "/m", "eager", {}, [], loras=loras,
                      faults={"one+engine-scale-2": ef.SCALE_2})  # fmt: skip
    assert serving.lora_ids(job) == {"one": 1, "one+half": 2, "one+engine-scale-2": 3}
    assert serving._install_faults(Engine(), job) == [{"modules": 5, "skipped_layer": 0}]
    assert calls == [(ef.INSTALL, ({3: ef.SCALE_2},))]
    assert serving._install_faults(Engine(), serving.Job("b", "/m", "eager", {}, [])) == []
    assert len(calls) == 1


def test_the_injected_engine_bug_changes_one_line_of_a_private_copy(tmp_path):
    """scripts/proofs/inject_engine_bug.py on a hard-linked copy of the real 0.26.0 file:
    one line changed, the original untouched, undone byte for byte; refused (exit 1,
    nothing written) where the line is not there."""
    import os
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "scripts" / "proofs" / "inject_engine_bug.py"
    original = release_tree("0.26.0") / "vllm" / "lora" / "layers" / "column_parallel_linear.py"
    copy = tmp_path / "vllm" / "lora" / "layers" / "column_parallel_linear.py"
    copy.parent.mkdir(parents=True)
    before = original.read_bytes()
    copy.write_bytes(before)
    linked = tmp_path / "linked.py"
    os.link(copy, linked)

    def run(*args):
        return subprocess.run([sys.executable, str(script), str(tmp_path), *args],
                              capture_output=True, text=True)  # fmt: skip

    assert run().returncode == 0
    lines = zip(before.decode().splitlines(), copy.read_text().splitlines(), strict=True)
    changed = [(a, b) for a, b in lines if a != b]
    assert changed == [("        for i in range(self.n_slices):",
                        "        for i in range(self.n_slices - 1):")]  # fmt: skip
    assert linked.read_bytes() == before  # the link's other name kept the original
    refused = run()  # already in: the good line is not there
    assert refused.returncode == 1 and "nothing written" in refused.stderr
    assert run("--undo").returncode == 0 and copy.read_bytes() == before


def test_the_rpc_names_are_the_extensions_methods():
    assert callable(getattr(ef.FaultExtension, ef.INSTALL))
    assert callable(getattr(ef.FaultExtension, ef.APPLIED))


def test_a_fault_no_worker_applied_is_named():
    """The records of the H100's LoRA engine (ids 4-7: the four engine-side controls of a0)
    say every fault applied; one missing from a worker, or applied to no tensor, names its
    control, with the worker."""
    ids = {"a0": 1, "a0+half": 2, "a0+no-experts": 3, "a0+engine-scale-2": 4,
           "a0+engine-layer-skipped": 5}  # fmt: skip
    faults = {"a0+engine-scale-2": ef.SCALE_2, "a0+engine-layer-skipped": ef.LAYER_SKIPPED}
    worker = [[4, 3, ef.SCALE_2, 112], [5, 0, ef.LAYER_SKIPPED, 15]]
    assert ef.not_applied(ids, faults, [worker]) == {}
    assert ef.not_applied(ids, faults, [worker, worker]) == {}
    zero = [[4, 3, ef.SCALE_2, 112], [5, 0, ef.LAYER_SKIPPED, 0]]
    [(name, why)] = ef.not_applied(ids, faults, [worker, zero]).items()
    assert name == "a0+engine-layer-skipped"
    assert why.startswith("its engine-side fault (layer-skipped) changed no tensor in worker 1")
    other_id = [[4, 3, ef.SCALE_2, 112], [2, 0, ef.LAYER_SKIPPED, 15]]
    assert list(ef.not_applied(ids, faults, [other_id])) == ["a0+engine-layer-skipped"]
    assert sorted(ef.not_applied(ids, faults, [])) == sorted(faults)  # no worker answered


def test_the_serving_child_marks_a_control_whose_fault_took_no_effect_not_served():
    """Its answers were the adapter's own: the result keeps none of them, and says why."""
    from patchkit.verify import serving

    class Engine:
        def collective_rpc(self, method, args=()):
            assert method == ef.APPLIED
            return [[[3, 1, ef.SCALE_2, 0]]]  # activated, but nothing found to change

    loras = {"one": "/a/one", "one+half": "/c/half", "one+engine-scale-2": "/a/one"}
    requests = [("lora:one", "p600", "one"), ("control:one+engine-scale-2", "p600",
                "one+engine-scale-2")]  # fmt: skip
    job = serving.Job("eager", "/m", "eager", {}, requests, loras=loras,
                      faults={"one+engine-scale-2": ef.SCALE_2})  # fmt: skip
    runs = {"lora:one": {"p600": {"x": 1}}, "control:one+engine-scale-2": {"p600": {"x": 1}}}
    found = serving._faults_applied(Engine(), job, [{"modules": 5}], runs)
    assert found["not_applied"] == ["one+engine-scale-2"]
    assert runs["lora:one"] == {"p600": {"x": 1}}
    assert runs["control:one+engine-scale-2"]["error"].startswith(
        "its engine-side fault (scale-2) changed no tensor in worker 0 of 1"
    )


@pytest.mark.parametrize(
    "applied",
    [
        None,
        "4 3 scale-2 112",
        [None],
        ["4 3 scale-2 112"],
        [[None, 7, {"id": 4}]],
        [[[4, 3, ef.SCALE_2]]],
        [[[4, 3, ef.SCALE_2, None]]],
        [[[4, 3, ef.SCALE_2, "112"]]],
        [[[4, 3, ef.SCALE_2, True]]],
        [[{0: 4, 2: ef.SCALE_2, 3: 112}]],
        [[[4, 3, ef.SCALE_2, 112]], None],
    ],
)
def test_worker_records_of_another_shape_name_the_control_never_crash(applied):
    """The records come from the workers' extension: a shape it never writes (a worker's
    None, a string, a record short of its count or counting with no int) is a worker
    that did not say it applied the fault. The control is named not served; the serving
    child does not die on it (TypeError, IndexError, KeyError) and lose every answer."""
    ids = {"a0": 1, "a0+engine-scale-2": 4}
    faults = {"a0+engine-scale-2": ef.SCALE_2}
    assert list(ef.not_applied(ids, faults, applied)) == ["a0+engine-scale-2"]
