"""Every tested release, from its real PyPI wheel: decision, apply, compile, re-apply, revert.

The expected decisions below are written out by hand from the surveyed facts
(shared VLLM-RELEASES.md, re-checked against the wheels), not derived from the
catalogue, so a wrong catalogue entry fails here.
"""

from __future__ import annotations

import ast
import json
import py_compile
from pathlib import Path

import pytest

from tests.conftest import RELEASES, copy_tree, run_cli, snapshot

EXPAND_BLOCK_N = {
    **{v: ("needed", "block-k-16") for v in ("0.17.0", "0.17.1")},
    **{
        v: ("needed", "block-k-32")
        for v in (
            "0.18.0",
            "0.18.1",
            "0.19.0",
            "0.19.1",
            "0.20.0",
            "0.20.1",
            "0.20.2",
            "0.21.0",
            "0.22.0",
            "0.22.1",
            "0.23.0",
            "0.24.0",
            "0.25.0",
            "0.25.1",
            "0.26.0",
            "0.27.0",
            "0.27.1",
            "0.28.0",
            "0.29.0",
            "0.30.0",
            "0.31.0",
            "0.32.0",
        )
    },  # fmt: skip
    "0.33.0": ("upstream", None),
}
MATMUL_ADD_LORA_LINEAR = {
    **{v: ("needed", "torch-ops") for v in EXPAND_BLOCK_N if v != "0.33.0"},
    "0.33.0": ("upstream", None),
}
SPLIT_IN_PROJ_QKVZ = {
    **{v: ("needed", "backport-36976") for v in ("0.17.0", "0.17.1", "0.18.0", "0.18.1")},
    **{v: ("upstream", None) for v in ("0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2")},
    **{v: ("not-applicable", None) for v in EXPAND_BLOCK_N if v >= "0.21.0"},
}
# 0.17-0.20 have no expand_packed_lora (separate in_proj_qkv / in_proj_z modules);
# 0.21-0.28 fail on any partial adapter (#47639); 0.29-0.33 carry #47640, which
# still sends an in_proj_z-only adapter to the wrong slices (#57851).
PARTIAL_GDN_ADAPTER = {
    **{v: ("not-applicable", None) for v in EXPAND_BLOCK_N if v < "0.21.0"},
    **{v: ("needed", "backport-47640") for v in EXPAND_BLOCK_N if "0.21.0" <= v < "0.29.0"},
    **{v: ("needed", "coverage-after") for v in EXPAND_BLOCK_N if v >= "0.29.0"},
}
# Every release's _stack_moe_lora_weights (3D expert LoRA, from 0.17.0 on) asserts
# both <experts>.base_layer (gate_up_proj) and <experts> (down_proj): an adapter
# on one expert parameter cannot load anywhere. From 0.32 PEFTHelper matches
# rank/alpha patterns against <experts> as down_proj, so the name comes too.
PARTIAL_MOE_ADAPTER = {
    **{v: ("needed", "single-parameter") for v in EXPAND_BLOCK_N if v < "0.32.0"},
    **{v: ("needed", "single-parameter-patterns") for v in ("0.32.0", "0.33.0")},
}
# Opt-in: status says so until `apply --only nan-probe`; its two hooks in
# gpu_model_runner.py apply to every release (the runner's lines are unchanged
# since 0.17), so it stacks on the default set everywhere.
NAN_PROBE = {v: ("opt-in", "runner-hooks") for v in EXPAND_BLOCK_N}
EXPECTED = {
    "expand-block-n": EXPAND_BLOCK_N,
    "matmul-add-lora-linear": MATMUL_ADD_LORA_LINEAR,
    "split-in-proj-qkvz": SPLIT_IN_PROJ_QKVZ,
    "partial-gdn-adapter": PARTIAL_GDN_ADAPTER,
    "partial-moe-adapter": PARTIAL_MOE_ADAPTER,
    "nan-probe": NAN_PROBE,
}
NAN_PROBE_FILES = ["vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/patchkit_nan_probe.py"]
# Known upstream bugs `status` must mention (notices, not warnings), in series order.
NOTICES = {
    v: [
        number
        for number, holds in (
            ("#38927", v in ("0.19.0", "0.19.1")),
            ("#47639", "0.21.0" <= v < "0.29.0"),
            ("#57851", v in ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")),
            ("#48460", True),
        )
        if holds
    ]
    for v in EXPAND_BLOCK_N
}
# Their patches' notices (partial-gdn-adapter, partial-moe-adapter) go once applied.
FIXED_BY_APPLY = {"#47639", "#57851", "#48460"}


def test_every_listed_release_is_in_the_expectations():
    for table in EXPECTED.values():
        assert sorted(RELEASES) == sorted(table)
    assert len(RELEASES) == 25


def status_json(root: Path) -> dict:
    result = run_cli("status", "--target", str(root), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_release(version: str, tmp_path: Path):
    root = copy_tree(version, tmp_path / "site-packages")
    pristine = snapshot(root)

    status = status_json(root)
    assert status["vllm"] == {"version": version, "path": str(root), "source": "metadata"}
    states = {p["id"]: (p["state"], p["variant"]) for p in status["patches"]}
    for patch_id, table in EXPECTED.items():
        assert states[patch_id] == table[version]
    assert status["warnings"] == []
    assert_notices(status["notices"], NOTICES[version])

    dry = run_cli("apply", "--target", str(root), "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert snapshot(root) == pristine

    applied = run_cli("apply", "--target", str(root), "--json")
    assert applied.exit_code == 0, applied.output
    report = json.loads(applied.stdout)
    changed = sorted(k for k, v in snapshot(root).items() if pristine.get(k) != v)
    touched = sorted(f for p in report["patches"] if p["action"] == "applied" for f in p["files"])
    needed = [i for i, (state, _) in states.items() if state == "needed"]
    assert sorted(p["id"] for p in report["patches"] if p["action"] == "applied") == sorted(needed)
    assert [c for c in changed if not c.startswith(".patchkit/")] == touched
    for relpath in touched:
        py_compile.compile(str(root / relpath), doraise=True, cfile=str(tmp_path / "check.pyc"))

    after_apply = snapshot(root)
    again = run_cli("apply", "--target", str(root), "--json")
    assert again.exit_code == 0, again.output
    assert {p["action"] for p in json.loads(again.stdout)["patches"]} == {"none"}
    assert snapshot(root) == after_apply
    patched = status_json(root)
    done = {"applied", "upstream", "not-applicable"}
    assert {p["state"] for p in patched["patches"] if p["id"] != "nan-probe"} <= done
    left = [n for n in NOTICES[version] if n not in FIXED_BY_APPLY]
    assert_notices(patched["notices"], left)

    stack_nan_probe(root, tmp_path, after_apply)
    reverted = run_cli("revert", "--target", str(root))
    assert reverted.exit_code == 0, reverted.output
    assert snapshot(root) == pristine


def assert_notices(notices: list[str], numbers: list[str]) -> None:
    """One notice per expected bug number, in order."""
    assert len(notices) == len(numbers), notices
    for notice, number in zip(notices, numbers, strict=True):
        assert number in notice, (number, notice)


def stack_nan_probe(root: Path, tmp_path: Path, default_set: dict) -> None:
    """`apply --only nan-probe` on the default set: its two files, compiled; then
    `revert --only nan-probe` gives the default set back byte for byte, and the probe
    goes on again for the plain revert after it."""
    probe = run_cli("apply", "--target", str(root), "--only", "nan-probe", "--json")
    assert probe.exit_code == 0, probe.output
    [step] = json.loads(probe.stdout)["patches"]
    assert (step["id"], step["action"], sorted(step["files"])) == (
        "nan-probe", "applied", NAN_PROBE_FILES
    )  # fmt: skip
    changed = sorted(k for k, v in snapshot(root).items() if default_set.get(k) != v)
    assert [c for c in changed if not c.startswith(".patchkit/")] == NAN_PROBE_FILES
    for relpath in NAN_PROBE_FILES:
        py_compile.compile(str(root / relpath), doraise=True, cfile=str(tmp_path / "check.pyc"))
    assert {p["id"]: p["state"] for p in status_json(root)["patches"]}["nan-probe"] == "applied"
    assert run_cli("revert", "--target", str(root), "--only", "nan-probe").exit_code == 0
    assert snapshot(root) == default_set
    assert run_cli("apply", "--target", str(root), "--only", "nan-probe").exit_code == 0


def expand_block_n_expression(source: str) -> ast.expr:
    """The "block_n" value of the single/multi-slice expand default config."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "block_n"
                    and "num_slices" in ast.unparse(value)
                ):
                    return value
    raise AssertionError("no expand block_n entry found")


class FakePlatform:
    def __init__(self, cuda: bool, capability: int | None):
        self.cuda, self.capability = cuda, capability

    def is_cuda(self) -> bool:
        return self.cuda

    def is_device_capability(self, capability: int) -> bool:
        return self.capability == capability


@pytest.mark.parametrize("version", ["0.17.0", "0.26.0", "0.32.0"])
def test_patched_block_n_is_32_on_sm90_only(version: str, tmp_path: Path):
    """Evaluate the patched expression from the real patched file on fake platforms."""
    root = copy_tree(version, tmp_path / "site-packages")
    relpath = "vllm/lora/ops/triton_ops/utils.py"
    before = expand_block_n_expression((root / relpath).read_text())
    assert run_cli("apply", "--target", str(root)).exit_code == 0
    after = compile(
        ast.Expression(expand_block_n_expression((root / relpath).read_text())), "", "eval"
    )
    cases = {
        (True, 90): (32, 64),  # Hopper: single slice 32, several slices unchanged
        (True, 100): (128, 64),  # Blackwell
        (True, 80): (128, 64),  # Ampere
        (False, 90): (128, 64),  # ROCm gfx90a reports 9.0 too
        (False, None): (128, 64),  # CPU
    }
    for (cuda, capability), (single, multi) in cases.items():
        scope = {"current_platform": FakePlatform(cuda, capability)}
        assert eval(after, {**scope, "num_slices": 1}) == single
        assert eval(after, {**scope, "num_slices": 2}) == multi
    unpatched = compile(ast.Expression(before), "", "eval")
    assert eval(unpatched, {"num_slices": 1}) == 128
