"""split-in-proj-qkvz on vLLM 0.17/0.18: the backport, checked against the real code.

The release matrix proves the decision, apply, compile and revert for every
release. Here:
- everywhere: the patched qwen3_5.py's packed-mapping helper, run from the
  patched file, and the wiring of the switch (read from the patched AST);
- where a Python that can import vLLM 0.17/0.18 is named by
  PATCHKIT_VLLM_PYTHON: tests/split_proof.py runs the real patched modules on
  the CPU (layer construction, LoRA layer choice, dummy and real adapter
  weights per slice, checkpoint loading) and reproduces vLLM #35286 on the
  unpatched layout. The GPU host cannot run these releases (they pin torch
  2.10; the host has 2.11), so this is as far as their real code can run.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, copy_tree, family_releases, patched_text, run_cli

PATCH = "split-in-proj-qkvz"
MODEL = "vllm/model_executor/models/qwen3_5.py"
# 0.17.1 and 0.18.1 ship byte-identical qwen3_5.py to 0.17.0 and 0.18.0.
FAMILIES = family_releases(PATCH)
VLLM_PYTHON = os.environ.get("PATCHKIT_VLLM_PYTHON")


def function_from(source: str, name: str):
    """Compile one top-level function of the patched file on its own and return it."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope: dict = {}
    exec(compile(ast.Module([node], []), MODEL, "exec"), scope)
    return scope[name]


@pytest.mark.parametrize("version", FAMILIES)
def test_packed_mapping_for_lora_names_the_split_modules(version):
    split_packed_mapping = function_from(
        patched_text(version, PATCH, MODEL), "split_packed_mapping"
    )
    base = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }
    before = json.dumps(base)
    split = split_packed_mapping(base)
    assert split == {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
        "in_proj_qkv": ["in_proj_qkv"],
        "in_proj_z": ["in_proj_z"],  # the entry #36976 forgot, #38927 added
    }
    assert json.dumps(base) == before  # the class attribute is not mutated


@pytest.mark.parametrize("version", FAMILIES)
def test_the_switch_is_a_boolean_set_from_the_lora_config(version):
    tree = ast.parse(patched_text(version, PATCH, MODEL))
    source = ast.unparse(tree)
    assert "split_in_proj_qkvz=vllm_config.lora_config is not None" in source
    gdn = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen3_5GatedDeltaNet"
    )
    forward = next(n for n in gdn.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    branches = [ast.unparse(n.test) for n in ast.walk(forward) if isinstance(n, ast.If)]
    assert "self.split_in_proj_qkvz" in branches
    assert not any("hasattr" in b for b in branches)  # a plain attribute, for Dynamo


@pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="set PATCHKIT_VLLM_PYTHON to a Python that can import vLLM 0.17/0.18 "
    "(their dependencies installed) to run the split on the real code; "
    "docs/evidence.md has its output",
)
@pytest.mark.parametrize("version", FAMILIES)
def test_split_runs_on_the_real_vllm_code(version, tmp_path: Path):
    root = copy_tree(version, tmp_path / "site-packages")
    assert run_cli("apply", "--target", str(root), "--only", PATCH).exit_code == 0
    done = subprocess.run(
        [VLLM_PYTHON, str(REPO / "tests" / "split_proof.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT ") :])
    assert result["module"] == str(root / MODEL)
    assert result["split"] == {
        "flag": True,
        "in_proj_qkvz": True,
        "qkv_sizes": [32, 32, 64],
        "z_size": 64,
    }
    assert result["fused"] == {
        "flag": False,
        "has_split_layers": False,
        "qkvz_sizes": [32, 32, 64, 64],
    }
    assert result["lora"]["in_proj_qkv"] == {
        "class": "MergedColumnParallelLinearVariableSliceWithLoRA",
        "slices": [32, 32, 64],
        "slices_ok": [True, True, True],
    }
    assert result["lora"]["in_proj_z"] == {
        "class": "ColumnParallelLinearWithLoRA",
        "slices": [64],
        "slices_ok": [True],
    }
    assert result["load_split"] == {
        "loaded": ["layers.0.in_proj_qkv.weight", "layers.0.in_proj_z.weight"],
        "weights_ok": True,
    }
    assert result["load_fused"] == {"loaded": ["layers.0.in_proj_qkvz.weight"], "weights_ok": True}
    assert "IndexError" in result["fused_lora_error"]  # vLLM #35286 without the split
