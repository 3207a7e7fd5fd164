"""nan-probe: the opt-in catalogue entry, its hooks in every release's real
runner, and the created module run on the CPU (the custom op, the host side, the log).

The GPU side (CUDA graphs replaying the op, the Triton and torch LoRA paths) is
proven on the H200 by scripts/proofs/nan_probe_gpu.py (docs/evidence.md).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import types
from pathlib import Path

import pytest
from packaging.version import Version

from tests.conftest import (
    CATALOGUE,
    copy_tree,
    created_source,
    module_from_source,
    patched_text,
    release_tree,
    releases_with_variant,
    run_cli,
    snapshot,
)
from tests.helpers import report_row

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
MODULE = "vllm/v1/worker/patchkit_nan_probe.py"


def status_of(root: Path) -> dict[str, str]:
    result = run_cli("status", "--target", str(root), "--json")
    assert result.exit_code == 0, result.output
    return {p["id"]: p["state"] for p in json.loads(result.stdout)["patches"]}


# ----- the catalogue entry -----


def test_list_shows_it_as_opt_in():
    result = run_cli("list", "--json")
    assert result.exit_code == 0
    entry = next(p for p in json.loads(result.stdout)["patches"] if p["id"] == "nan-probe")
    assert entry["opt_in"] is True
    assert "nan-probe" in run_cli("list").stdout


@pytest.mark.slow
def test_plain_apply_skips_it_only_adds_it_and_revert_takes_it_off(tmp_path):
    root = copy_tree("0.26.0", tmp_path / "site")
    pristine = snapshot(root)
    assert status_of(root)["nan-probe"] == "opt-in"
    applied = json.loads(run_cli("apply", "--target", str(root), "--json").stdout)
    [probe] = [p for p in applied["patches"] if p["id"] == "nan-probe"]
    assert (probe["state"], probe["action"]) == ("opt-in", "none")  # listed, left alone
    assert not (root / MODULE).exists()
    default_set = snapshot(root)
    only = run_cli("apply", "--target", str(root), "--only", "nan-probe")
    assert only.exit_code == 0, only.output
    assert only.stdout.splitlines()[-1] == "apply: 1 applied now; now 5 applied, 1 not-applicable"
    assert (root / MODULE).read_text() == created_source("nan-probe", MODULE)
    assert status_of(root) == {
        "expand-block-n": "applied",
        "matmul-add-lora-linear": "applied",
        "split-in-proj-qkvz": "not-applicable",
        "partial-gdn-adapter": "applied",
        "partial-moe-adapter": "applied",
        "nan-probe": "applied",
    }
    again = run_cli("apply", "--target", str(root))  # plain apply leaves it where it is
    assert again.stdout.splitlines()[-1] == "apply: nothing to do; now 5 applied, 1 not-applicable"
    off = run_cli("revert", "--target", str(root), "--only", "nan-probe")
    assert off.exit_code == 0, off.output
    assert "opt-in" in off.stdout.splitlines()[-1]
    assert snapshot(root) == default_set
    assert run_cli("apply", "--target", str(root), "--only", "nan-probe").exit_code == 0
    all_off = run_cli("revert", "--target", str(root))  # plain revert takes it off too
    assert all_off.exit_code == 0, all_off.output
    assert all_off.stdout.splitlines()[-1].startswith("revert: 5 reverted now")
    assert snapshot(root) == pristine


def test_plain_revert_names_it_opt_in_as_status_does_when_it_is_not_applied(tmp_path):
    """Every command shows every patch: revert, too, lists nan-probe, and in status's word."""
    root = copy_tree("0.26.0", tmp_path / "site")
    assert run_cli("apply", "--target", str(root)).exit_code == 0
    reverted = run_cli("revert", "--target", str(root))
    assert report_row(reverted.stdout, "nan-probe").split()[:2] == ["nan-probe", "opt-in"]
    assert reverted.stdout.splitlines()[-1] == (
        "revert: 4 reverted now; now 4 needed, 1 not-applicable, 1 opt-in"
    )


def test_revert_only_names_it_opt_in_as_status_does_when_it_is_not_applied(tmp_path):
    """`revert --only nan-probe` on a tree without it said 'needed' (and warned 'not
    applied (needed)') where status says 'opt-in': one patch, two names."""
    root = copy_tree("0.26.0", tmp_path / "site")
    before = snapshot(root)
    result = run_cli("revert", "--target", str(root), "--only", "nan-probe", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    [entry] = [p for p in report["patches"] if p["id"] == "nan-probe"]
    assert (entry["state"], entry["state_before"]) == ("opt-in", "opt-in")
    assert [w["message"] for w in report["warnings"]] == ["nan-probe is not applied (opt-in)"]
    text = run_cli("revert", "--target", str(root), "--only", "nan-probe")
    assert text.stdout.splitlines()[-1] == (
        "revert: nothing to do; now 4 needed, 1 not-applicable, 1 opt-in"
    )
    assert report_row(text.stdout, "nan-probe").split()[:2] == ["nan-probe", "opt-in"]
    assert "(needed)" not in text.output
    assert snapshot(root) == before


@pytest.mark.slow
def test_revert_after_a_reinstall_does_not_advise_what_it_has_just_done(tmp_path):
    """pip installs 0.21.0 over a patched 0.26.0 (its files over ours, ours left): revert
    removed the created files, then printed '`patchkit revert --only nan-probe` removes
    the rest (vllm/v1/worker/patchkit_nan_probe.py)' on the 'reverted now' line."""
    from tests.conftest import release_tree

    root = copy_tree("0.26.0", tmp_path / "site")
    assert run_cli("apply", "--target", str(root)).exit_code == 0
    assert run_cli("apply", "--target", str(root), "--only", "nan-probe").exit_code == 0
    shutil.rmtree(root / "vllm-0.26.0.dist-info")
    shutil.copytree(release_tree("0.21.0"), root, symlinks=True, dirs_exist_ok=True)
    result = run_cli("revert", "--target", str(root))
    assert result.exit_code == 0, result.output
    assert not (root / MODULE).exists()
    lines = [x for x in result.stdout.splitlines() if "reverted now" in x]
    assert lines and not [x for x in lines if "removes the rest" in x], lines


def test_an_opt_in_value_that_is_not_a_boolean_is_refused(tmp_path):
    from patchkit.catalogue.load import load_catalogue
    from patchkit.errors import PatchkitError
    from tests.conftest import CATALOGUE

    root = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, root)
    meta = root / "nan-probe" / "patch.toml"
    meta.write_text(meta.read_text().replace("opt_in = true", 'opt_in = "yes"'))
    with pytest.raises(PatchkitError, match="opt_in: true or false expected"):
        load_catalogue(root)


# ----- the hooks, in every release's real runner -----


def method(tree: ast.Module, name: str) -> ast.FunctionDef:
    runner = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"
    )
    return next(n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == name)


def calls_in(node: ast.AST) -> list[str]:
    return [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]


def line_of(node: ast.AST, name: str) -> int:
    """The source line of the first call of ``name`` in ``node`` (ast.walk is not in order)."""
    return min(c.lineno for c in ast.walk(node) if isinstance(c, ast.Call)
               and ast.unparse(c.func) == name)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "version",
    [
        v
        for v in releases_with_variant("nan-probe")
        if RUNNER in CATALOGUE.get("nan-probe").expected_for(Version(v)).paths
    ],
)
def test_hooks_sit_where_only_real_steps_reach_them(version):
    """after_forward is in _model_forward, which only execute_model calls (never
    _dummy_run: profile, warm-up, capture); install follows load_lora_model."""
    tree = ast.parse(patched_text(version, "nan-probe", RUNNER))
    callers = {
        n.name
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "GPUModelRunner"
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and "self._model_forward" in calls_in(n)
    }
    assert callers == {"execute_model"}
    forward = method(tree, "_model_forward")
    assert line_of(forward, "self.model") < line_of(forward, "patchkit_nan_probe.after_forward")
    load = method(tree, "load_model")
    assert line_of(load, "self.load_lora_model") < line_of(load, "patchkit_nan_probe.install")
    for name in ("_dummy_run", "capture_model", "execute_model"):
        assert not any("patchkit_nan_probe" in c for c in calls_in(method(tree, name)))


def lora_layer_bases(version: str) -> dict[str, list[str]]:
    """Each class in the release's vllm/lora/layers and the names of its bases."""
    classes = {}
    for path in sorted((release_tree(version) / "vllm/lora/layers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
    return classes


def ancestors(classes: dict[str, list[str]], name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for base in classes.get(todo.pop(), []):
            if base not in seen:
                seen.add(base)
                todo.append(base)
    return seen


@pytest.mark.parametrize("version", releases_with_variant("nan-probe"))
def test_the_class_names_the_probe_sorts_lora_wrappers_by_hold_in_every_release(version):
    """The probe tells a LoRA linear wrapper (probed) from another LoRA wrapper inside
    a layer (MoE experts: named in the header as not probed) by these two class
    names in the MRO; every linear wrapper and FusedMoEWithLoRA of the real release
    must fall on the right side."""
    classes = lora_layer_bases(version)
    linear = [c for c in classes if "BaseLinearLayerWithLoRA" in ancestors(classes, c)]
    assert {"ColumnParallelLinearWithLoRA", "RowParallelLinearWithLoRA",
            "MergedQKVParallelLinearWithLoRA"} <= set(linear)  # fmt: skip
    moe = [c for c in classes if c.startswith("FusedMoE") and c.endswith("WithLoRA")]
    assert "FusedMoEWithLoRA" in moe
    for name in moe:
        assert "BaseLayerWithLoRA" in ancestors(classes, name), name
        assert "BaseLinearLayerWithLoRA" not in ancestors(classes, name), name


# ----- the created module on the CPU -----

torch = pytest.importorskip("torch", reason="the probe module needs torch (the test extra)")

from tests.probe_helpers import (  # noqa: E402 (torch first)
    BaseLayerWithLoRA,
    BaseLinearLayerWithLoRA,
    Layer,
    Model,
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The created module, imported once (its custom op is registered once per process)."""
    directory = tmp_path_factory.mktemp("probe")
    return module_from_source("patchkit_nan_probe", created_source("nan-probe", MODULE), directory)


def fake_runner(model, req_ids, bounds, adapters=None):
    """The runner attributes the probe reads: model, input batch, query_start_loc."""
    known = {i + 1: types.SimpleNamespace(lora_name=n) for i, n in enumerate(adapters or [])}
    mapping = [0] * len(req_ids)
    for i, name in enumerate(adapters or []):
        mapping[i] = i + 1 if name else 0
    batch = types.SimpleNamespace(
        num_reqs=len(req_ids),
        req_ids=req_ids,
        request_lora_mapping=mapping,
        lora_id_to_lora_request=known,
    )
    qsl = types.SimpleNamespace(np=bounds)
    return types.SimpleNamespace(model=model, max_num_tokens=16, input_batch=batch,
                                 query_start_loc=qsl)  # fmt: skip


def installed(probe, log: Path, monkeypatch, req_ids, bounds, adapters=None):
    """A Model with the probe installed as vLLM's load_model would, logging to ``log``
    (no statistics); returns the model and the fake runner of its steps."""
    model = Model()
    monkeypatch.setenv("PATCHKIT_PROBE_LOG", str(log))
    monkeypatch.delenv("PATCHKIT_PROBE_STATS", raising=False)
    runner = fake_runner(model, req_ids, bounds, adapters)
    probe.install(runner)
    return model, runner


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_op_writes_each_rows_max_and_exact_counts(probe):
    rows = torch.zeros(2, 6)
    stats = torch.zeros(2, 5, dtype=torch.float64)
    x = torch.tensor([[1.0, -3.0], [float("nan"), 2.0], [float("-inf"), 0.5], [0.0, 0.0]])
    torch.ops.patchkit.probe_record([x], rows, stats, 1, True)
    values = rows[1, :4]
    assert values[0] == 3.0 and torch.isnan(values[1]) and torch.isinf(values[2])
    assert values[3] == 0.0 and rows[0].eq(0).all()
    nan, inf, count, total, squares = stats[1].tolist()
    assert (nan, inf, count, total, squares) == (1, 1, 6, 0.5, 1 + 9 + 4 + 0.25)


def test_the_op_takes_the_worst_of_hidden_and_residual_and_never_overruns(probe):
    rows = torch.zeros(1, 3)
    stats = torch.zeros(1, 5, dtype=torch.float64)
    hidden = torch.ones(5, 4)
    residual = torch.ones(5, 4)
    residual[1, 2] = float("inf")
    torch.ops.patchkit.probe_record([hidden, residual], rows, stats, 0, False)
    assert rows[0].tolist() == [1.0, float("inf"), 1.0]  # 5 rows, a buffer of 3
    assert stats.eq(0).all()  # no statistics asked for


# The row kernel's cases: (widths of the tensors of one call, token rows). Row 1
# holds a NaN, row 2 an Inf, row 0 a -Inf in the last tensor's last column and,
# with two tensors, row 3 a NaN in one and an Inf in the other (NaN wins).
ROW_KERNEL_CASES = [((5120, 5120), 64), ((96,), 3), ((34816,), 5), ((7, 13), 17),
                    ((100, 5000, 33), 4), ((4097,), 1)]  # fmt: skip

ROW_KERNEL_SCRIPT = """
import json, sys, importlib.util, torch
spec = importlib.util.spec_from_file_location("probe", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["probe"] = module
spec.loader.exec_module(module)
out = []
for widths, rows in json.loads(sys.argv[2]):
    g = torch.Generator().manual_seed(len(out))
    flats = [(torch.randn(rows, w, generator=g) * 30).to(torch.bfloat16) for w in widths]
    if rows > 3:
        flats[0][1, 2] = float("nan")
        flats[-1][2, 0] = float("inf")
        flats[-1][0, -1] = float("-inf")
        flats[0][3, 0], flats[-1][3, 1] = float("inf"), float("nan")
    reference, kernel = torch.full((rows,), -7.0), torch.full((rows,), -7.0)
    module._torch_row_absmax(flats, reference)
    module._triton_row_absmax(flats, kernel)
    out.append([[repr(v) for v in reference.tolist()], [repr(v) for v in kernel.tolist()]])
print(json.dumps(out))
"""


def test_the_triton_row_kernel_matches_torchs_reductions(tmp_path):
    """The kernel the probe runs on a GPU, run by Triton's interpreter on the CPU,
    against the torch reference: NaN over Inf over any finite value, row by row,
    tensors wider than one block, several tensors in one call."""
    pytest.importorskip(
        "triton",
        reason="no Triton here (pip install triton 'numpy<2.3' runs it in Triton's interpreter)",
    )
    import subprocess
    import sys

    source = tmp_path / "probe_module.py"
    source.write_text(created_source("nan-probe", MODULE))
    cases = json.dumps(ROW_KERNEL_CASES)
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ROW_KERNEL_SCRIPT, str(source), cases],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    for (widths, rows), (reference, kernel) in zip(ROW_KERNEL_CASES, results, strict=True):
        assert kernel == reference, (widths, rows)
        if rows > 3:
            assert reference[:4] == ["inf", "nan", "inf", "nan"], (widths, reference[:4])
        assert "-7.0" not in kernel  # every row written


def test_only_per_token_tensors_with_values_count_for_the_rows(probe):
    """A forward argument that is not one row per token (a 1-D tensor, another
    length) or has no values is left out on both paths: torch's norm raises on
    an empty row, and the kernel would read past a shorter tensor."""
    rows = torch.full((2, 4), -7.0)
    stats = torch.zeros(2, 5, dtype=torch.float64)
    hidden = torch.ones(4, 3)
    odd = [torch.full((8,), 1000.0), torch.full((2, 3), 500.0), torch.zeros(4, 0)]
    torch.ops.patchkit.probe_record([hidden, *odd], rows, stats, 0, False)
    assert rows[0].tolist() == [1.0] * 4
    torch.ops.patchkit.probe_record([torch.zeros(4, 0)], rows, stats, 1, False)
    assert rows[1].tolist() == [0.0] * 4  # nothing to look at: written, not stale


def test_the_probe_falls_back_to_torch_when_the_kernel_fails(probe, monkeypatch, capfd):
    """A Triton that cannot build or launch the kernel must not stop the server:
    one line on stderr, and the op goes on with torch's reductions."""
    target = torch.zeros(2)
    flats = [torch.tensor([[1.0, -4.0], [2.0, float("nan")]])]

    def broken(flats, target):
        raise RuntimeError("ptxas died\n  x = tl.load(ptr)\n      ^")

    monkeypatch.setattr(probe, "_triton_row_absmax", broken)
    monkeypatch.setattr(probe, "ROW_KERNEL", "triton")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    probe.row_absmax(flats, target)
    switched = probe.ROW_KERNEL
    monkeypatch.undo()
    assert target[0] == 4.0 and torch.isnan(target[1])
    assert switched == "torch"  # later calls go straight to torch
    err = capfd.readouterr().err
    assert (
        err.count("patchkit nan-probe: the Triton row kernel failed (RuntimeError: ptxas died)")
        == 1
    )
    assert len(err.strip().splitlines()) == 1  # one line, not Triton's source excerpt


def test_a_layer_output_is_hidden_and_residual_a_projection_its_output_only(probe):
    out, bias = torch.zeros(2), torch.ones(2)
    assert len(probe._output_tensors((out, bias), "layer")) == 2
    assert len(probe._output_tensors((out, bias), "lora")) == 1
    assert probe._output_tensors((out, None), "lora")[0] is out
    assert probe._tensors([torch.arange(3), out]) == [out]  # positions are not probed


def test_install_finds_layers_and_lora_projections_in_order(probe, tmp_path):
    model = Model()
    log = tmp_path / "probe.jsonl"
    found = probe.install_on(model, str(log), False, 16, torch.device("cpu"))
    slots = [(s.layer, s.module, s.kind, s.order) for s in found.slots]
    assert slots[:4] == [(0, "input", "input", -1), (0, "output", "output", -1),
                         (0, "qkv_proj", "lora", 0), (0, "o_proj", "lora", 1)]  # fmt: skip
    assert len(slots) == 1 + 3 * 3
    header = records(log)[0]
    assert header["probe"] == "nan-probe" and header["stats"] is False
    assert len(header["slots"]) == len(slots)
    assert type(model.layers[0]).__name__ == "Layer"  # the subclass keeps the name
    assert isinstance(model.layers[0].qkv_proj, BaseLinearLayerWithLoRA)


class FusedMoEWithLoRA(BaseLayerWithLoRA):
    """Stands in for vLLM's MoE expert LoRA wrapper: not probed, named in the header."""

    def forward(self, x):
        return x


def test_moe_expert_lora_is_named_in_the_header_as_not_probed(probe, tmp_path):
    model = Model()
    model.layers[1].experts = FusedMoEWithLoRA()
    log = tmp_path / "probe.jsonl"
    found = probe.install_on(model, str(log), False, 16, torch.device("cpu"))
    header = records(log)[0]
    assert header["unprobed_lora"] == [  # the probed projections are not listed
        {"layer": 1, "module": "experts", "class": "FusedMoEWithLoRA"}
    ]
    assert "experts" not in [s.module for s in found.slots]
    assert type(model.layers[1].experts) is FusedMoEWithLoRA  # left unwrapped
    assert isinstance(model.layers[1].qkv_proj, BaseLinearLayerWithLoRA)
    plain = tmp_path / "plain.jsonl"
    probe.install_on(Model(), str(plain), False, 16, torch.device("cpu"))
    assert records(plain)[0]["unprobed_lora"] == []


def test_a_step_logs_only_the_points_with_a_bad_row_and_the_requests(probe, tmp_path, monkeypatch):
    log = tmp_path / "probe.jsonl"
    model, runner = installed(
        probe, log, monkeypatch, ["r0", "r1"], [0, 3, 5], adapters=[None, "poisoned"]
    )
    with torch.no_grad():
        model.layers[1].o_proj.linear.bias[0] = float("inf")  # every row from layer 1's o_proj
        model(torch.arange(5), torch.randn(5, 8))
    probe.after_forward(runner)
    assert probe._PROBE.rows.eq(0).all()  # reset once the step is queued for the host
    probe.flush()
    steps = records(log)[1:]
    assert [(r["layer"], r["module"]) for r in steps] == [
        (1, "output"), (1, "o_proj"), (2, "output"), (2, "qkv_proj"), (2, "o_proj")
    ]  # fmt: skip
    first = steps[1]
    assert first["step"] == 0 and first["inf_rows"] == 5 and first["nan_rows"] == 0
    assert first["requests"] == ["r0", "r1"] and first["bad_requests"] == ["r0", "r1"]
    assert first["adapters"] == {"r1": "poisoned"} and first["tokens"] == 5
    assert set(first) >= {"rank", "kind", "order", "absmax", "time"}


def test_a_long_adapter_name_is_cut_on_every_record(probe, tmp_path, monkeypatch):
    """vLLM's lora_name has no limit and each record repeats the batch's names: a
    5000-character one is written cut to 200 (its length and hash kept), as the
    report cuts it, so a batch of such names stays a line the report reads."""
    from patchkit.probe.report import MAX_ADAPTER_NAME, bounded

    long_name = "n" * 5000
    log = tmp_path / "probe.jsonl"
    model, runner = installed(probe, log, monkeypatch, ["r0"], [0, 5], adapters=[long_name])
    with torch.no_grad():
        model.layers[1].o_proj.linear.bias[0] = float("inf")
        model(torch.arange(5), torch.randn(5, 8))
    probe.after_forward(runner)
    probe.flush()
    names = {r["adapters"]["r0"] for r in records(log)[1:]}
    assert names == {bounded(long_name, MAX_ADAPTER_NAME)}
    assert len(names.pop()) == 200


def test_nothing_is_logged_when_all_is_finite_unless_stats_are_asked(probe, tmp_path, monkeypatch):
    for stats, expected in (("", 0), ("1", 1 + 3 * 3)):
        model = Model()
        log = tmp_path / f"probe-{stats or 'off'}.jsonl"
        monkeypatch.setenv("PATCHKIT_PROBE_LOG", str(log))
        monkeypatch.setenv("PATCHKIT_PROBE_STATS", stats)
        runner = fake_runner(model, ["r0"], [0, 4])
        probe.install(runner)
        with torch.no_grad():
            model(torch.arange(4), torch.randn(4, 8))
        probe.after_forward(runner)
        probe.flush()
        steps = records(log)[1:]
        assert len(steps) == expected
        if stats:
            line = steps[0]
            assert line["nan"] == 0 and line["inf"] == 0 and line["bad_requests"] == []
            assert line["std"] > 0 and line["absmax"] >= abs(line["mean"])


def test_without_the_log_variable_nothing_is_wrapped(probe, monkeypatch):
    monkeypatch.delenv("PATCHKIT_PROBE_LOG", raising=False)
    monkeypatch.setattr(probe, "_PROBE", None)
    model = Model()
    probe.install(fake_runner(model, [], [0]))
    assert type(model.layers[0]) is Layer and probe._PROBE is None
    probe.after_forward(fake_runner(model, [], [0]))  # a no-op


def test_a_dummy_run_writes_the_buffer_and_no_line(probe, tmp_path, monkeypatch):
    """Profile/warm-up/capture runs call the model but never _model_forward: the next
    real step overwrites what they wrote, and only real steps are read."""
    log = tmp_path / "probe.jsonl"
    model, runner = installed(probe, log, monkeypatch, ["r0"], [0, 2])
    with torch.no_grad():
        model(torch.arange(4), torch.full((4, 8), float("nan")))  # a dummy run: no after_forward
        model(torch.arange(2), torch.randn(2, 8))
    probe.after_forward(runner)
    probe.flush()
    assert records(log)[1:] == []


@pytest.mark.slow
def test_the_hook_traces_into_a_compiled_graph(probe, tmp_path, monkeypatch):
    """torch.compile(fullgraph=True): Dynamo traces the subclass and the op (its fake
    impl), Inductor compiles the rest on the CPU; the op still writes the buffer."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("Inductor on the CPU needs a C compiler")
    log = tmp_path / "probe.jsonl"
    model, runner = installed(probe, log, monkeypatch, ["r0", "r1"], [0, 2, 5])
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(5, 8)
    x[3, 1] = float("nan")
    with torch.no_grad():
        compiled(torch.arange(5), x)
    probe.after_forward(runner)
    probe.flush()
    steps = records(log)[1:]
    assert steps and steps[0]["module"] == "input" and steps[0]["nan_rows"] == 1
    assert all(r["bad_requests"] == ["r1"] for r in steps)


def test_the_report_reads_what_the_module_writes(probe, tmp_path, monkeypatch):
    log = tmp_path / "probe.jsonl"
    model, runner = installed(
        probe, log, monkeypatch, ["r0", "r1"], [0, 3, 5], adapters=[None, "bad"]
    )
    with torch.no_grad():
        model.layers[2].qkv_proj.linear.weight[0, 0] = float("nan")
        model(torch.arange(5), torch.randn(5, 8))
    probe.after_forward(runner)
    probe.flush()
    result = run_cli("probe", "report", str(log), "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)["affected_requests"]
    assert {(f["request"], f["layer"], f["module"]) for f in found} == {
        ("r0", 2, "qkv_proj"), ("r1", 2, "qkv_proj")
    }  # fmt: skip


def test_the_module_needs_no_vllm():
    """It runs inside vLLM but imports only torch and the standard library."""
    tree = ast.parse(created_source("nan-probe", MODULE))
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}  # fmt: skip
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "vllm" not in roots and "torch" in roots


# ----- the log path must never crash or stall the server -----


@pytest.fixture
def alarm():
    """Fail a test that blocks (a FIFO open) instead of hanging the suite."""
    import signal

    def expired(signum, frame):
        raise TimeoutError("blocked on the probe log")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_log_path_that_cannot_be_written_leaves_the_model_unwrapped(
    probe, tmp_path, monkeypatch, capfd, alarm
):
    """A directory, a FIFO without a reader, a missing folder, /dev/full: install() raised
    (vLLM's load_model failed) or blocked forever in open(); now it warns and probes nothing."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo, tmp_path / "missing" / "probe.jsonl", Path("/dev/full")):
        monkeypatch.setenv("PATCHKIT_PROBE_LOG", str(path))
        monkeypatch.setattr(probe, "_PROBE", None)
        model = Model()
        runner = fake_runner(model, ["r0"], [0, 2])
        probe.install(runner)
        assert probe._PROBE is None and type(model.layers[0]) is Layer, path
        probe.after_forward(runner)
        assert str(path) in capfd.readouterr().err
    assert fifo.exists() and not (tmp_path / "missing").exists()


def test_a_log_that_goes_bad_while_serving_drops_lines_and_never_raises(
    probe, tmp_path, monkeypatch, capfd
):
    """The log replaced by a directory mid-run: after_forward raised inside _model_forward."""
    log = tmp_path / "probe.jsonl"
    model, runner = installed(probe, log, monkeypatch, ["r0"], [0, 2])
    log.unlink()
    log.mkdir()
    for _ in range(3):
        with torch.no_grad():
            model(torch.arange(2), torch.full((2, 8), float("nan")))
        probe.after_forward(runner)
    probe.flush()
    err = capfd.readouterr().err
    assert err.count(str(log)) == 1, err  # one warning, then silence


def test_an_unexpected_error_reading_a_step_turns_the_probe_off_not_the_server(
    probe, tmp_path, monkeypatch, capsys
):
    """A later vLLM that renames a runner attribute must not fail the requests."""
    log = tmp_path / "probe.jsonl"
    model, runner = installed(probe, log, monkeypatch, ["r0"], [0, 4])
    del runner.query_start_loc  # what a renamed attribute looks like to the probe
    with torch.no_grad():
        model(torch.arange(4), torch.randn(4, 8))
    probe.after_forward(runner)  # no exception
    assert probe._PROBE is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "probe is off" in err[0] and "AttributeError" in err[0]
    probe.after_forward(runner)  # and nothing more after it
    assert capsys.readouterr().err == ""


# ----- the log is never written through a link, nor into another user's file -----


def refused(probe, path: Path) -> str:
    """The reason the probe gives for not writing ``path`` (fails if it wrote)."""
    with pytest.raises(OSError) as caught:
        probe.write_lines(str(path), [{"step": 0}])
    return caught.value.strerror


def secret(path: Path) -> Path:
    """A file of the server's user (root in the tests) that nobody asked it to log into."""
    path.write_text("root's data\n")
    path.chmod(0o600)
    return path


def test_a_link_planted_as_the_log_is_refused_and_the_server_loads_unprobed(
    probe, tmp_path, monkeypatch, capfd
):
    """Another user plants probe.jsonl -> a root-owned file: the root server appended its
    header there. Now one stderr line, no probe, the target untouched."""
    target = secret(tmp_path / "target")
    log = tmp_path / "probe.jsonl"
    log.symlink_to(target)
    monkeypatch.setattr(probe, "_PROBE", None)
    model, runner = installed(probe, log, monkeypatch, ["r0"], [0, 2])
    assert probe._PROBE is None and type(model.layers[0]) is Layer
    probe.after_forward(runner)  # serving goes on
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(log) in err[0] and "symbolic link" in err[0], err
    assert "probe is off" in err[0]
    assert target.read_text() == "root's data\n" and log.is_symlink()


def test_a_dangling_link_creates_nothing(probe, tmp_path):
    """probe.jsonl -> a name that does not exist: open(O_CREAT) made it, mode 0644."""
    log = tmp_path / "probe.jsonl"
    log.symlink_to(tmp_path / "made-by-root")
    assert "symbolic link" in refused(probe, log)
    assert not (tmp_path / "made-by-root").exists()


def test_a_hard_link_to_another_file_is_refused(probe, tmp_path):
    target = secret(tmp_path / "target")
    log = tmp_path / "probe.jsonl"
    os.link(target, log)
    assert "2 hard links" in refused(probe, log)
    assert target.read_text() == "root's data\n"


def test_a_file_another_user_owns_is_refused(probe, tmp_path):
    """Running as root, a log owned by uid 12345 (another user's file, or one they made
    to be written by root) is not appended to."""
    log = tmp_path / "probe.jsonl"
    log.write_text("")
    os.chown(log, 12345, 12345)
    assert (
        refused(probe, log) == f"owned by uid 12345, not by the server's user (uid {os.geteuid()})"
    )
    assert log.read_text() == ""


def test_a_fifo_or_a_device_is_refused_by_type_without_being_opened(probe, tmp_path, monkeypatch):
    """Opening a FIFO wakes its reader, opening a device runs its driver (a watchdog
    starts counting): looked at with lstat, never opened."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    assert refused(probe, fifo) == "not a regular file"
    assert refused(probe, Path("/dev/null")) == "not a regular file"
    monkeypatch.undo()
    assert not any(name.endswith(("fifo", "null")) for name in opened), opened


def test_a_link_in_a_directory_component_is_refused(probe, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "logs").symlink_to(real)
    reason = refused(probe, tmp_path / "logs" / "probe.jsonl")
    assert reason.startswith("'logs' is a symbolic link"), reason
    assert list(real.iterdir()) == []


def test_a_directory_other_users_can_write_to_gets_no_log(probe, tmp_path):
    """World-writable and not sticky: another user could rename any file of root's onto
    the log's name, or plant one; neither a new log nor an existing one is written."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "writable by other users" in refused(probe, shared / "probe.jsonl")
    assert list(shared.iterdir()) == []
    existing = secret(shared / "old.jsonl")
    assert "writable by other users" in refused(probe, existing)
    assert existing.read_text() == "root's data\n"
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    assert "writable by other users" in refused(probe, group / "probe.jsonl")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    assert "owned by uid 12345" in refused(probe, theirs / "probe.jsonl")


def test_a_sticky_directory_of_root_or_of_the_server_takes_a_new_log_mode_0600(probe, tmp_path):
    """/tmp (root's, mode 1777) is fine for a root server: O_EXCL|O_NOFOLLOW creates the
    log or fails on a name planted first, and the sticky bit keeps others from renaming
    it. The new log is the server user's only (0600: request ids, adapter names)."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    log = sticky / "probe.jsonl"
    probe.write_lines(str(log), [{"step": 0}])
    probe.write_lines(str(log), [{"step": 1}, {"step": 2}])
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [0, 1, 2]
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    os.chown(sticky, 12345, 12345)  # sticky, but another user's: they may rename in it
    assert "owned by uid 12345" in refused(probe, sticky / "other.jsonl")


def test_an_existing_log_keeps_its_mode_and_a_relative_path_is_walked_from_the_cwd(
    probe, tmp_path, monkeypatch
):
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "probe.jsonl"
    log.write_text("")
    log.chmod(0o640)
    monkeypatch.chdir(tmp_path)
    probe.write_lines("logs/probe.jsonl", [{"step": 0}])
    probe.write_lines("./logs/../logs/probe.jsonl", [{"step": 1}])
    assert len(log.read_text().splitlines()) == 2 and stat.S_IMODE(log.stat().st_mode) == 0o640
    (tmp_path / "link").symlink_to(tmp_path / "logs")
    assert "symbolic link" in refused(probe, Path("link/probe.jsonl"))
    for name in ("logs/", "logs/.", "logs/.."):  # strings: Path() drops a trailing "/."
        assert refused(probe, name) == "names a directory, not a file"


def test_a_component_swapped_for_a_link_during_the_walk_is_never_followed(
    probe, tmp_path, monkeypatch
):
    """The race: between the probe's checks, another user swaps a directory of the path
    for a link to where they want root's writes. The swap is made at each open() the
    opener makes, in turn: the walk holds each directory it opened, so a swap after it
    passed a name changes nothing and one before is a link it refuses. Never a byte lands
    in the attacker's directory."""
    real_open = os.open
    for at in range(1, 32):
        case = tmp_path / str(at)
        (case / "logs").mkdir(parents=True)
        (case / "attacker").mkdir()
        calls = []

        def swap_then_open(path, flags, *args, at=at, case=case, calls=calls, **kwargs):
            calls.append(path)
            if len(calls) == at:
                (case / "logs").rename(case / "moved")
                (case / "logs").symlink_to(case / "attacker")
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", swap_then_open)
        try:
            probe.write_lines(str(case / "logs" / "probe.jsonl"), [{"step": 0}])
            written = True
        except OSError as exc:
            written = False
            assert "symbolic link" in exc.strerror, exc.strerror
        finally:
            monkeypatch.undo()
        assert list((case / "attacker").iterdir()) == [], at
        if not (case / "moved").exists():  # fewer open() calls than ``at``: all were tried
            assert written and (case / "logs" / "probe.jsonl").exists()
            break
        assert written == (case / "moved" / "probe.jsonl").exists(), at
    else:
        raise AssertionError("the opener made more than 31 open() calls")


def test_a_log_swapped_for_a_link_while_serving_is_refused_once_and_never_written(
    probe, tmp_path, monkeypatch, capfd
):
    log = tmp_path / "probe.jsonl"
    model, runner = installed(probe, log, monkeypatch, ["r0"], [0, 2])
    target = secret(tmp_path / "target")
    log.unlink()
    log.symlink_to(target)
    for _ in range(3):
        with torch.no_grad():
            model(torch.arange(2), torch.full((2, 8), float("nan")))
        probe.after_forward(runner)
    probe.flush()
    err = capfd.readouterr().err
    assert err.count(str(log)) == 1 and "symbolic link" in err, err
    assert target.read_text() == "root's data\n"


def test_the_warning_is_one_line_whatever_the_path_holds(probe, tmp_path, monkeypatch, capfd):
    evil = tmp_path / "a\nFAKE\x1b[2J"
    evil.symlink_to(tmp_path / "nowhere")
    monkeypatch.setenv("PATCHKIT_PROBE_LOG", str(evil))
    monkeypatch.setattr(probe, "_PROBE", None)
    probe.install(fake_runner(Model(), ["r0"], [0, 2]))
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "a\\nFAKE\\x1b[2J" in err, err


# ----- a tree with an older probe applied -----

OLDER_PROBE = "7fbc4d8"  # the probe that opened its log with a plain open() (followed links)


def older_catalogue(tmp_path: Path) -> Path:
    """The catalogue with the probe module as it was at OLDER_PROBE (git history)."""
    import subprocess

    from tests.conftest import CATALOGUE, REPO

    shown = subprocess.run(
        ["git", "show", f"{OLDER_PROBE}:patches/nan-probe/files/{MODULE}"],
        cwd=REPO, capture_output=True,
    )  # fmt: skip
    if shown.returncode != 0:
        pytest.skip(f"needs this checkout's git history (commit {OLDER_PROBE})")
    root = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, root)
    (root / "nan-probe" / "files" / MODULE).write_bytes(shown.stdout)
    assert shown.stdout.decode() != created_source("nan-probe", MODULE)
    return root


@pytest.mark.slow
def test_a_tree_with_the_older_probe_is_told_so_and_apply_only_brings_the_current_one(tmp_path):
    """A server patched before the log opener was fixed keeps appending through links:
    status said only 'applied', and `apply --only nan-probe` did nothing."""
    older = older_catalogue(tmp_path)
    root = copy_tree("0.26.0", tmp_path / "site")
    env = {"PATCHKIT_PATCHES_DIR": str(older)}
    assert run_cli("apply", "--target", str(root), env=env).exit_code == 0
    default_set = snapshot(root)
    assert run_cli("apply", "--target", str(root), "--only", "nan-probe", env=env).exit_code == 0
    assert (root / MODULE).read_bytes() == (older / "nan-probe" / "files" / MODULE).read_bytes()
    with_older = snapshot(root)

    status = run_cli("status", "--target", str(root), "--json")
    assert status.exit_code == 0, status.output
    report = json.loads(status.stdout)
    [entry] = [p for p in report["patches"] if p["id"] == "nan-probe"]
    assert entry["state"] == "applied"
    assert entry["reason"]["message"] == (
        "applied from an older catalogue: `patchkit apply --only nan-probe` brings the current one"
    )
    assert any(
        "patchkit apply --only nan-probe` replaces it" in w["message"] for w in report["warnings"]
    )
    text = run_cli("status", "--target", str(root))
    assert "applied from an older catalogue" in report_row(text.stdout, "nan-probe")
    assert "warning: nan-probe: the patch file changed since it was applied" in text.stderr

    dry = run_cli("apply", "--target", str(root), "--only", "nan-probe", "--dry-run")
    assert dry.exit_code == 0 and "1 would apply" in dry.stdout.splitlines()[-1], dry.output
    assert snapshot(root) == with_older
    plain = run_cli("apply", "--target", str(root))  # plain apply leaves it as it is
    assert plain.exit_code == 0 and snapshot(root) == with_older, plain.output

    upgrade = run_cli("apply", "--target", str(root), "--only", "nan-probe", "--strict")
    assert upgrade.exit_code == 0, upgrade.output
    assert upgrade.stderr == ""  # the warning is what the run has just fixed
    assert upgrade.stdout.splitlines()[-1] == (
        "apply: 1 applied now; now 5 applied, 1 not-applicable"
    )
    assert "replaced the version applied from an older catalogue" in report_row(
        upgrade.stdout, "nan-probe"
    )
    assert (root / MODULE).read_text() == created_source("nan-probe", MODULE)
    assert status_of(root)["nan-probe"] == "applied"
    again = run_cli("status", "--target", str(root), "--json")
    assert json.loads(again.stdout)["warnings"] == [] and again.stderr == ""
    assert run_cli("revert", "--target", str(root), "--only", "nan-probe").exit_code == 0
    assert snapshot(root) == default_set  # the runner's backup is still the original


def test_the_replacement_of_an_older_probe_is_one_commit_a_failure_changes_nothing(
    tmp_path, monkeypatch
):
    """A failure while the replacement is written leaves the older probe in place, not a
    tree without the probe (what revert-then-apply would leave)."""
    from patchkit.fs.safepath import Root
    from patchkit.patching.state import STATE_FILE

    older = older_catalogue(tmp_path)
    root = copy_tree("0.26.0", tmp_path / "site")
    env = {"PATCHKIT_PATCHES_DIR": str(older)}
    assert run_cli("apply", "--target", str(root), "--only", "nan-probe", env=env).exit_code == 0
    with_older = snapshot(root)
    real_write = Root.write

    def full_at_the_record(self, relpath, *args, **kwargs):
        if relpath == STATE_FILE:  # the module is written by now: the commit point fails
            raise OSError(28, "No space left on device")
        return real_write(self, relpath, *args, **kwargs)

    monkeypatch.setattr(Root, "write", full_at_the_record)
    failed = run_cli("apply", "--target", str(root), "--only", "nan-probe")
    monkeypatch.undo()
    assert failed.exit_code == 1 and "no space left" in failed.stderr, failed.output
    assert snapshot(root) == with_older
