"""nan-probe on Model Runner V2 (vllm/v1/worker/gpu/model_runner.py), on each release's
real code: where the hooks sit in the patched runner (after every way a real step
runs the model, never in a dummy, profile or capture run; install after LoRA wrapped
the layers), the worker's check, V2's warm-up request ids, and the probe's host side
reading a V2 step with the release's own LoraState (lifted from lora_utils.py).

Stand-ins, for what needs a GPU: the model (a small decoder stack on the CPU) and the
InputBatch (a namespace with the release's own field names, checked against its
input_batch.py; the real one is made on the device). With the catalogue before this
change (V1 hooks only, 0.34.0 not applicable) every hook test here fails.
"""

from __future__ import annotations

import ast
import json
import re
import types

import numpy as np
import pytest
from packaging.version import Version

from tests.conftest import RELEASES, created_source, module_from_source, patched_text, release_tree
from tests.punica_harness import methods

V2 = "vllm/v1/worker/gpu/model_runner.py"
WORKER = "vllm/v1/worker/gpu_worker.py"
MODULE = "vllm/v1/worker/patchkit_nan_probe.py"
# Releases whose V2 execute_model has today's shape (hooked); 0.17/0.18 hook V1 only.
HOOKED = [r for r in RELEASES if Version(r) >= Version("0.19.0")]
REQUIRED = ("0.26.0", "0.29.0", "0.33.0", "0.34.0")


def runner_method(tree: ast.Module, name: str) -> ast.FunctionDef:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def calls(node: ast.AST) -> list[tuple[int, str]]:
    return sorted(
        (c.lineno, ast.unparse(c.func)) for c in ast.walk(node) if isinstance(c, ast.Call)
    )


def test_the_required_releases_are_tested():
    assert set(REQUIRED) <= set(HOOKED)


@pytest.mark.parametrize("version", HOOKED)
def test_v2_hooks_follow_every_real_model_run_and_only_real_ones(version):
    tree = ast.parse(patched_text(version, "nan-probe", V2))
    execute = runner_method(tree, "execute_model")
    found = calls(execute)
    hook = [line for line, name in found if name == "patchkit_nan_probe.after_forward"]
    assert len(hook) == 1, found
    runs = [line for line, name in found if name in (
        "self.model", "self.cudagraph_manager.run_fullgraph",
        "self.cudagraph_manager.run_pw_graph", "self.ubatch_runner.run")]  # fmt: skip
    assert runs and max(runs) < hook[0]
    # the hook's guard: `if not dummy_run:` (dummy, DP-padding and profile runs pass True)
    guard = next(
        n for n in ast.walk(execute)
        if isinstance(n, ast.If) and any(
            isinstance(c, ast.Call) and ast.unparse(c.func) == "patchkit_nan_probe.after_forward"
            for c in ast.walk(n))
    )  # fmt: skip
    assert ast.unparse(guard.test) == "not dummy_run"
    assert "input_batch" in ast.unparse(guard)
    load = runner_method(tree, "load_model")
    found = calls(load)
    install = [line for line, name in found if name == "patchkit_nan_probe.install"]
    lora = [line for line, name in found if name == "self.load_lora_model"]
    assert len(install) == 1 and lora and lora[0] < install[0]
    for name in ("_dummy_run", "capture_model"):
        assert not any("patchkit_nan_probe" in n for _, n in calls(runner_method(tree, name)))


@pytest.mark.parametrize("version", HOOKED)
def test_the_worker_checks_the_runner_it_loaded(version):
    tree = ast.parse(patched_text(version, "nan-probe", WORKER))
    load = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "load_model"
    )
    found = calls(load)
    check = [line for line, name in found if name == "patchkit_nan_probe.check_wired"]
    runner_load = [line for line, name in found if name == "self.model_runner.load_model"]
    assert len(check) == 1 and runner_load[0] < check[0]


@pytest.mark.parametrize("version", HOOKED)
def test_v2_warmup_request_ids_are_the_ones_the_probe_skips(version, probe):
    """V2's warm-ups run execute_model on made-up requests (not a dummy run): every
    request id (or id prefix) the release's warm-up code writes is skipped."""
    root = release_tree(version) / "vllm"
    paths = [
        root / "v1/worker/gpu/warmup.py",
        *sorted((root / "model_executor/warmup").glob("*.py")),
    ]
    text = "\n".join(p.read_text() for p in paths if p.exists())
    literals = re.findall(r'(?:req_id_prefix(?:: str)? ?= ?|req_ids = \[f)"(_[A-Za-z0-9_]+)', text)
    assert literals, "the warm-up names its requests"
    for literal in literals:
        assert probe.V2_WARMUP_ID.match(literal + "_0_"), literal
    assert not probe.V2_WARMUP_ID.match("chatcmpl-3f2a") and not probe.V2_WARMUP_ID.match("0")


# ----- the host side reading a V2 step -----

torch = pytest.importorskip("torch", reason="the probe module needs torch (the test extra)")

from tests.probe_helpers import Model  # noqa: E402 (torch first)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe_v2")
    return module_from_source(
        "patchkit_nan_probe_v2", created_source("nan-probe", MODULE), directory
    )


def lora_state_class(version: str):
    """The release's own LoraState (vllm/v1/worker/gpu/lora_utils.py), its methods lifted."""
    text = (release_tree(version) / "vllm/v1/worker/gpu/lora_utils.py").read_text()
    names = ("__init__", "add_request", "remove_request")
    found = methods(text, "lora_utils.py", "LoraState", names, {"np": np, "NO_LORA_ID": 0})
    return type("LoraState", (), found)


def input_batch_fields(version: str) -> set[str]:
    text = (release_tree(version) / "vllm/v1/worker/gpu/input_batch.py").read_text()
    cls = next(
        n
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.ClassDef) and n.name == "InputBatch"
    )
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


@pytest.mark.parametrize("version", [r for r in RELEASES if r in REQUIRED])
def test_a_v2_step_is_attributed_to_its_requests_and_adapters(
    version, probe, tmp_path, monkeypatch, capfd
):
    fields = input_batch_fields(version)
    assert {"req_ids", "num_reqs", "query_start_loc_np"} <= fields
    state = lora_state_class(version)(max_num_reqs=4)
    bad_lora = types.SimpleNamespace(lora_name="poisoned", lora_int_id=7)
    state.add_request("base-0", 0, None)
    state.add_request("lora-1", 1, bad_lora)
    model = Model()
    runner = types.SimpleNamespace(model=model, max_num_tokens=16, lora_state=state)
    log = tmp_path / "probe.jsonl"
    monkeypatch.setenv("PATCHKIT_PROBE_LOG", str(log))
    monkeypatch.delenv("PATCHKIT_PROBE_STATS", raising=False)
    monkeypatch.setattr(probe, "_PROBE", None)
    monkeypatch.setattr(probe, "_WIRED", None)
    probe.install(runner, "v2")
    # a warm-up step (V2's own request ids): nothing is read
    warm = types.SimpleNamespace(req_ids=["_warmup_0_"], num_reqs=1,
                                 query_start_loc_np=np.array([0, 3], dtype=np.int32))  # fmt: skip
    x = torch.randn(3, 8)
    x[1] = float("nan")
    model(None, x)
    probe.after_forward(runner, warm)
    # a real step: base-0 has tokens 0-2, lora-1 tokens 3-5 (one NaN row); a padded
    # request after num_reqs (V2 pads query_start_loc_np with the last bound)
    bounds = np.array([0, 3, 6, 6], dtype=np.int32)
    batch = types.SimpleNamespace(req_ids=["base-0", "lora-1", "pad"], num_reqs=2,
                                  query_start_loc_np=bounds)  # fmt: skip
    x = torch.randn(8, 8)
    x[4] = float("nan")
    model(None, x)
    probe.after_forward(runner, batch)
    probe.flush()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["runner"] == "v2"
    steps = lines[1:]
    assert steps and {r["step"] for r in steps} == {0}
    assert all(r["bad_requests"] == ["lora-1"] for r in steps)
    assert all(r["requests"] == ["base-0", "lora-1"] for r in steps)
    assert all(r["adapters"] == {"lora-1": "poisoned"} for r in steps)
    assert steps[0]["layer"] == 0 and steps[0]["kind"] == "input"
    # a removed request loses its adapter, as in the release
    state.remove_request("lora-1")
    assert "lora-1" not in state.lora_requests
    probe.check_wired(runner)  # wired: says nothing
    assert "no probe hooks" not in capfd.readouterr().err


def test_a_runner_without_hooks_says_so_once_when_the_probe_is_asked_for(
    probe, tmp_path, monkeypatch, capfd
):
    monkeypatch.setattr(probe, "_WIRED", None)
    monkeypatch.setenv("PATCHKIT_PROBE_LOG", str(tmp_path / "p.jsonl"))
    unhooked = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})()
    probe.check_wired(unhooked)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Model Runner V2" in err[0] and "no probe hooks" in err[0]
    monkeypatch.delenv("PATCHKIT_PROBE_LOG")
    probe.check_wired(unhooked)
    assert capfd.readouterr().err == ""


def test_without_the_log_variable_a_v2_install_wraps_nothing(probe, monkeypatch):
    monkeypatch.delenv("PATCHKIT_PROBE_LOG", raising=False)
    monkeypatch.setattr(probe, "_PROBE", None)
    model = Model()
    probe.install(types.SimpleNamespace(model=model, max_num_tokens=4), "v2")
    assert probe._PROBE is None
    assert all(type(m).__name__ != "Probed" and not hasattr(m, "_patchkit_kind")
               for m in model.modules())  # fmt: skip
