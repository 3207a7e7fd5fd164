"""A Triton wheel and the tests' CPU torch for a child patchkit that scans kernels.

Triton is downloaded once into the tests' cache (keyed by its version) and
put on the child's PYTHONPATH, with its own Triton cache and patchkit
readings beside it. Used by the doctor --kernels, advice and Docker tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO, TEST_CACHE, cache_lock

TRITON = "3.7.1"


def triton_site(version: str = TRITON) -> Path:
    """Triton ``version`` installed (--target) into the tests' cache; downloaded on first use."""
    site = TEST_CACHE / f"triton-{version}-cp{sys.version_info[0]}{sys.version_info[1]}"
    with cache_lock(site.name):  # another pytest process may be installing it
        if not (site / "triton" / "__init__.py").is_file():
            _install_triton(version, site)
    return site


def _install_triton(version: str, site: Path) -> None:
    with tempfile.TemporaryDirectory(dir=TEST_CACHE, prefix=".triton-") as tmp:
        pip = [sys.executable, "-m", "pip", "-q"]
        download = ["download", "--no-deps", "--only-binary", ":all:", "-d", tmp]
        subprocess.run([*pip, *download, f"triton=={version}"], check=True)
        wheel = next(Path(tmp).glob("triton-*.whl"))
        target = Path(tmp) / "site"
        subprocess.run(
            [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
            check=True,
        )
        os.replace(target, site)


TORCH_PACKAGES = ("torch", "torchgen", "functorch", "filelock", "typing_extensions", "sympy",
                  "mpmath", "networkx", "jinja2", "markupsafe", "fsspec")  # fmt: skip


def torch_site() -> Path:
    """The tests' CPU torch and what it imports, linked into one directory for a .pth.

    The scan runs vLLM's launchers on meta tensors, so it needs torch, as every
    vLLM environment has; an image-like test venv gets it through this. One directory
    per environment (its prefix's hash): the cache outlives the virtual environment that
    made its links, and a link left by a removed one must not stand for this one's.
    """
    prefix = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    site = TEST_CACHE / f"torch-site-cp{sys.version_info[0]}{sys.version_info[1]}-{prefix}"
    with cache_lock(site.name):  # two processes must not make the same link
        _link_torch(site)
    return site


def _link_torch(site: Path) -> None:
    import importlib.util

    site.mkdir(parents=True, exist_ok=True)
    for name in TORCH_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        source = origin.parent if origin.name == "__init__.py" else origin
        link = site / source.name
        if link.is_symlink() and Path(os.readlink(link)) != source:
            link.unlink()  # made by an environment since replaced at the same prefix
        if not link.is_symlink():
            link.symlink_to(source)


def scan_env(version: str = TRITON) -> dict:
    """A child patchkit that imports Triton ``version``; caches kept per Triton version."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TRITON_"))}
    env.pop("PATCHKIT_LORA_BACKEND", None)
    env["PYTHONPATH"] = f"{triton_site(version)}{os.pathsep}{REPO}"
    env["TRITON_CACHE_DIR"] = str(TEST_CACHE / f"triton-{version}-cache")
    env["PATCHKIT_CACHE_DIR"] = str(TEST_CACHE / f"triton-{version}-readings")  # scans, SASS
    return env


def small_moe_model(directory: Path, dtype: str, adapter_config: dict) -> tuple[Path, Path]:
    """A model directory (config.json of a small MoE: hidden 1024, 64 experts top 4) and an
    adapter directory holding ``adapter_config``, for scans of a model's own shapes."""
    model, adapter = directory / "model", directory / "adapter"
    model.mkdir()
    adapter.mkdir()
    text = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 128, "num_experts": 64, "num_experts_per_tok": 4,
            "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512}  # fmt: skip
    (model / "config.json").write_text(json.dumps({"text_config": text, "torch_dtype": dtype}))
    (adapter / "adapter_config.json").write_text(json.dumps(adapter_config))
    return model, adapter
