"""`patchkit doctor --kernels` on real wheels: known answers from compiled kernels (issue 11).

Triton 3.7.1 (ptxas 12.8.93, what vLLM 0.27-0.32 get) is downloaded once
into the tests' cache, next to the release trees, and put on the child's
PYTHONPATH; the test venv itself has no Triton, which is also what the
"Triton is not importable" test needs. No GPU is used: the kernels are
compiled for sm_90 and their SASS is read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, TEST_CACHE, copy_tree, run_cli

TRITON = "3.7.1"
NAN_BUG = "vLLM #48590"


def triton_site() -> Path:
    """Triton 3.7.1 installed (--target) into the tests' cache; downloaded on first use."""
    site = TEST_CACHE / f"triton-{TRITON}-cp{sys.version_info[0]}{sys.version_info[1]}"
    if (site / "triton" / "__init__.py").is_file():
        return site
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TEST_CACHE, prefix=".triton-") as tmp:
        pip = [sys.executable, "-m", "pip", "-q"]
        subprocess.run(
            [
                *pip,
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                tmp,
                f"triton=={TRITON}",
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("triton-*.whl"))
        target = Path(tmp) / "site"
        subprocess.run(
            [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
            check=True,
        )
        os.replace(target, site)
    return site


@pytest.fixture(scope="module")
def scan_env(tmp_path_factory) -> dict:
    """The environment of a child patchkit that can import Triton; one kernel cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TRITON_"))}
    env.pop("PATCHKIT_LORA_BACKEND", None)
    env["PYTHONPATH"] = f"{triton_site()}{os.pathsep}{REPO}"
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env["PATCHKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("patchkit-cache"))  # SASS cache
    return env


def doctor_kernels(tree: Path, env: dict, **extra: str) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "patchkit.cli.main",
            "doctor",
            "--kernels",
            "--json",
            "--target",
            str(tree),
        ],
        capture_output=True,
        text=True,
        env={**env, **extra},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert not report["kernels"].get("error"), report["kernels"]
    return report


def nan_verdict(report: dict) -> dict:
    return next(v for v in report["verdicts"] if v["bug"].startswith(NAN_BUG))


def single_slice_fp32_expand(report: dict, path: str = "add") -> dict:
    return next(
        c
        for c in report["kernels"]["cases"]
        if c["op"] == "expand"
        and c["slices"] == 1
        and c["input_dtype"] == "fp32"
        and c["model_dtype"] == "bf16"
        and c["path"] == path
        and c["source"] == "get_lora_op_configs"
    )


@pytest.mark.parametrize("version", ["0.26.0", "0.30.0"])
def test_unpatched_default_has_the_hazard_and_expand_block_n_removes_it(
    scan_env, tmp_path, version
):
    tree = copy_tree(version, tmp_path / "t")
    before = doctor_kernels(tree, scan_env)
    case = single_slice_fp32_expand(before)
    assert case["config"]["BLOCK_N"] == 128 and case["config"]["num_stages"] == 2
    assert case["verdict"] == "hazard" and case["called"] and case["register_a"] > 0
    assert all(h["instruction"] and h["address"].startswith("0x") for h in case["hazards"])
    verdict = nan_verdict(before)
    assert verdict["status"] == "exposed" and "kernel scan" in verdict["reason"]
    assert verdict["fix"] == "patchkit apply"

    assert run_cli("apply", "--target", str(tree), "--only", "expand-block-n").exit_code == 0
    after = doctor_kernels(tree, scan_env)
    assert single_slice_fp32_expand(after)["config"]["BLOCK_N"] == 32  # the patched code's
    assert [c["label"] for c in after["kernels"]["cases"] if c["verdict"] == "hazard"] == []
    assert nan_verdict(after)["status"] == "protected"
    assert "no overwrite" in nan_verdict(after)["reason"]


def test_0330_ships_one_stage_and_is_clean(scan_env):
    from tests.conftest import release_tree

    report = doctor_kernels(release_tree("0.33.0"), scan_env)
    case = single_slice_fp32_expand(report)
    assert case["config"]["num_stages"] == 1 and case["verdict"] == "clean"
    assert not [c for c in report["kernels"]["cases"] if c["verdict"] == "hazard"]
    assert nan_verdict(report)["status"] == "not affected"


def test_the_torch_path_runs_no_triton_lora_kernel(scan_env, tmp_path):
    tree = copy_tree("0.26.0", tmp_path / "t")
    assert (
        run_cli("apply", "--target", str(tree), "--only", "matmul-add-lora-linear").exit_code == 0
    )
    report = doctor_kernels(tree, scan_env)
    assert single_slice_fp32_expand(report)["verdict"] == "hazard"  # compiled, but not run
    assert not any(c["called"] for c in report["kernels"]["cases"])
    verdict = nan_verdict(report)
    assert verdict["status"] == "protected" and "torch matmuls" in verdict["reason"]
    triton_backend = doctor_kernels(tree, scan_env, PATCHKIT_LORA_BACKEND="triton")
    assert nan_verdict(triton_backend)["status"] == "exposed"


def test_a_tuned_config_that_brings_block_n_128_back_is_named(scan_env, tmp_path):
    tree = copy_tree("0.26.0", tmp_path / "t")
    assert run_cli("apply", "--target", str(tree), "--only", "expand-block-n").exit_code == 0
    folder = tmp_path / "tuned"
    folder.mkdir()
    leaf = {"block_m": 64, "block_n": 128, "block_k": 32, "num_warps": 4, "num_stages": 2}
    config = {"4": {"1": {"16": {"64": {"5120": leaf}}}}}
    (folder / "NVIDIA_H200_EXPAND_TRUE.json").write_text(json.dumps(config))
    report = doctor_kernels(tree, scan_env, VLLM_TUNED_CONFIG_FOLDER=str(folder))
    tuned = [c for c in report["kernels"]["cases"] if c["source"].startswith("tuned")]
    assert [c["verdict"] for c in tuned] == ["hazard"]
    verdict = nan_verdict(report)
    assert verdict["status"] == "exposed" and "NVIDIA_H200_EXPAND_TRUE.json" in verdict["fix"]


def test_triton_ptxas_path_is_the_ptxas_the_scan_uses(scan_env, tmp_path):
    ptxas = tmp_path / "ptxas-copy"
    shutil.copy2(triton_site() / "triton/backends/nvidia/bin/ptxas", ptxas)
    report = doctor_kernels(
        copy_tree("0.26.0", tmp_path / "t"), scan_env, TRITON_PTXAS_PATH=str(ptxas)
    )
    assert report["kernels"]["ptxas"] == str(ptxas)
    assert report["kernels"]["ptxas_version"] == "12.8.93"


def test_without_triton_the_scan_says_so_in_one_line_and_doctor_runs_on(tree_0260):
    result = run_cli("doctor", "--kernels", "--target", str(tree_0260))
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("kernel scan")]
    assert lines == [lines[0]] and "Triton is not importable" in lines[0]
    assert "[exposed] vLLM #48590" in result.stdout  # judged by the version rules instead
