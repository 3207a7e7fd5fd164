"""Bytecode of touched modules is removed; --clear-caches empties vLLM's and Triton's caches."""

from __future__ import annotations

import json
import py_compile
from pathlib import Path

from tests.conftest import run_cli

UTILS = "vllm/lora/ops/triton_ops/utils.py"


def test_apply_and_revert_remove_stale_bytecode(slim_tree_0260: Path):
    source = slim_tree_0260 / UTILS
    pycache = source.parent / "__pycache__"
    stale = [pycache / "utils.cpython-312.pyc", pycache / "utils.cpython-311.pyc"]
    other = pycache / "lora_expand_op.cpython-312.pyc"
    for pyc in (*stale, other):
        py_compile.compile(
            str(source),
            cfile=str(pyc),
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
    result = run_cli("apply", "--target", str(slim_tree_0260), "--json")
    report = json.loads(result.stdout)
    assert sorted(report["bytecode_removed"]) == sorted(str(p) for p in stale)
    assert not any(p.exists() for p in stale) and other.exists()

    py_compile.compile(str(source), cfile=str(stale[0]))
    reverted = run_cli("revert", "--target", str(slim_tree_0260))
    assert f"removed bytecode: {stale[0]}" in reverted.stdout
    assert not stale[0].exists()


def test_clear_caches_reports_and_removes(slim_tree_0260: Path, tmp_path: Path):
    vllm_root, triton = tmp_path / "vllm-cache", tmp_path / "triton-cache"
    compiled = (
        vllm_root / "torch_compile_cache" / "0123abcdef" / "rank_0_0" / "backbone" / "graph.py"
    )
    kernel = triton / ("A2" * 26) / "kernel.cubin"  # Triton's base32 key layout
    for path in (compiled, kernel):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"0123456789")
    env = {"VLLM_CACHE_ROOT": str(vllm_root), "TRITON_CACHE_DIR": str(triton)}
    result = run_cli("apply", "--target", str(slim_tree_0260), "--clear-caches", "--json", env=env)
    caches = json.loads(result.stdout)["caches_removed"]
    assert [(c["files"], c["bytes"]) for c in caches] == [(1, 10), (1, 10)]
    assert not compiled.exists() and not kernel.exists()
    assert (vllm_root).exists()  # only the compile cache inside it goes
