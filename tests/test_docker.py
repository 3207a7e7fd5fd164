"""docker/Dockerfile's own RUN lines, run against an image-like layout (no Docker engine here).

The "image": a fresh virtual environment standing in for the image's system
Python, whose site-packages holds the real vLLM 0.26.0 wheel's files with
their dist-info and RECORD; patchkit is installed the way the Dockerfile
installs it (pip from the copied build context, dependencies from the index).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, release_tree, snapshot
from tests.dockerfile_runner import ImageRunner, parse, stage

DOCKERFILE = REPO / "docker" / "Dockerfile"
UTILS = "vllm/lora/ops/triton_ops/utils.py"


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> tuple[ImageRunner, Path]:
    root = tmp_path_factory.mktemp("image")
    python = root / "usr" / "local"
    subprocess.run([sys.executable, "-m", "venv", str(python)], check=True)
    site = next(python.glob("lib/python3*/site-packages"))
    pristine = release_tree("0.26.0")
    shutil.copytree(pristine / "vllm", site / "vllm")
    dist_info = next(pristine.glob("vllm-*.dist-info"))
    shutil.copytree(dist_info, site / dist_info.name)
    from tests.kernelscan_helpers import torch_site, triton_site

    (site / "triton.pth").write_text(f"{triton_site()}\n")  # the image's own Triton
    (site / "torch.pth").write_text(f"{torch_site()}\n")  # and torch, as vLLM images have
    runner = ImageRunner(context=REPO, image_root=root, python_bin=python / "bin")
    from tests.kernelscan_helpers import scan_env

    caches = scan_env()  # the kernel scan's Triton and SASS caches, shared with its own tests
    runner.env.update({k: caches[k] for k in ("TRITON_CACHE_DIR", "PATCHKIT_CACHE_DIR")})
    return runner, site


def test_dockerfile_stages():
    stages = parse(DOCKERFILE)
    assert stages[0].base == "vllm/vllm-openai:${VLLM_TAG}"
    runs = [args for kind, args in stage(stages, "patched").instructions if kind == "RUN"]
    assert "patchkit apply --strict" in runs
    assert any("patchkit status --json" in r for r in runs)
    assert any("patchkit doctor --kernels --json" in r for r in runs)
    assert ("RUN", "patchkit verify") in stage(stages, "verify").instructions
    assert stages[-1].base == "patched"  # the default target is the patched image


@pytest.mark.network
def test_build_applies_rebuild_is_a_noop_and_drift_fails(image):
    runner, site = image
    patched = stage(parse(DOCKERFILE), "patched")
    pristine = snapshot(site / "vllm")

    first = runner.build(patched)
    assert [r.returncode for r in first] == [0, 0, 0, 0], first[-1].stderr
    assert re.search(r"expand-block-n\s+applied", first[1].stdout)
    assert re.search(r"matmul-add-lora-linear\s+applied", first[1].stdout)
    status = json.loads((runner.image_root / "etc/patchkit/status.json").read_text())
    assert status["vllm"]["version"] == "0.26.0" and status["vllm"]["source"] == "metadata"
    assert status["vllm"]["path"] == str(site)
    assert {p["id"]: p["state"] for p in status["patches"]} == {
        "expand-block-n": "applied",
        "matmul-add-lora-linear": "applied",
        "split-in-proj-qkvz": "not-applicable",
        "partial-gdn-adapter": "applied",
        "partial-moe-adapter": "applied",
        "nan-probe": "opt-in",  # a diagnostic: the image build leaves it out
    }
    changed = sorted(k for k, v in snapshot(site / "vllm").items() if pristine.get(k) != v)
    assert changed == sorted(
        [
            UTILS.removeprefix("vllm/"),
            "lora/punica_wrapper/punica_gpu.py",
            "lora/punica_wrapper/patchkit_lora_matmul.py",
            "lora/layers/base.py",
            "lora/layers/column_parallel_linear.py",
            "lora/model_manager.py",
            "lora/worker_manager.py",
        ]
    )

    after_first = snapshot(site / "vllm"), (site / ".patchkit/state.json").read_bytes()
    doctor = json.loads((runner.image_root / "etc/patchkit/doctor-kernels.json").read_text())
    assert doctor["kernels"]["cases"] and not doctor["kernels"]["error"]
    nan = next(v for v in doctor["verdicts"] if v["bug"].startswith("vLLM #48590"))
    assert nan["status"] == "protected" and "torch matmuls" in nan["reason"]["message"]

    second = runner.build(patched, only="RUN")  # patchkit itself is reinstalled too
    assert [r.returncode for r in second] == [0, 0, 0, 0]
    assert "apply: nothing to do" in second[1].stdout
    assert (snapshot(site / "vllm"), (site / ".patchkit/state.json").read_bytes()) == after_first

    # A drifted image: revert, then someone's edit to the target file.
    revert = runner.run("patchkit revert")
    assert revert.returncode == 0, revert.stderr
    path = site / UTILS
    path.write_text(path.read_text().replace("else 128,", "else 64,", 1))
    drifted = snapshot(site / "vllm")
    third = runner.build(patched, only="RUN")
    assert third[-1].returncode == 1  # the apply line fails the build
    message = third[-1].stderr.strip()
    assert message.startswith("patchkit: error: expand-block-n: conflict:")
    assert UTILS in message and "nothing was changed" in message and "\n" not in message
    assert snapshot(site / "vllm") == drifted and not (site / ".patchkit").exists()


def test_the_build_context_is_what_the_dockerfile_copies_and_no_pip_override_stays():
    """`docker build .` sent the 900 MB .venv the README's first command makes,
    and ENV PIP_BREAK_SYSTEM_PACKAGES=1 stayed set in the runtime image."""
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln and not ln.startswith("#")]  # fmt: skip
    assert lines[0] == "*"  # everything out, then only what is copied back in
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for kind, args in stage(parse(DOCKERFILE), "patched").instructions:
        if kind == "COPY":
            copied.update(args.split()[:-1])
        assert not (kind == "ENV" and "PIP_BREAK_SYSTEM_PACKAGES" in args), args
    assert allowed == copied
