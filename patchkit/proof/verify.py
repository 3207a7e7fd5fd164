"""`patchkit verify`: prove on this machine's GPU that the installed vLLM's LoRA path is sound.

It runs against the vLLM that this Python imports, patched or not, and says
which patches are applied. Kernel checks always run; `--e2e` adds the tiny
Qwen3.5 + LoRA serving run (patchkit.proof.e2e). Exit 1 on any failed check that
applies to this install. torch and vllm are imported only here, lazily, so
the other commands never load them.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patchkit.catalogue.model import Catalogue
from patchkit.engine import operations
from patchkit.errors import PatchkitError
from patchkit.target.tree import VllmTree, locate


@dataclass
class VerifyReport:
    environment: dict
    patches: list[dict]
    kernel: list = field(default_factory=list)
    e2e: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        kernel_ok = all(k.ok for k in self.kernel if k.counts)
        return kernel_ok and all(c.ok for c in self.e2e)

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "environment": self.environment,
            "patches": self.patches,
            "kernel_checks": [asdict(k) for k in self.kernel],
            "e2e_checks": [asdict(c) for c in self.e2e],
            "seconds": round(self.seconds, 1),
        }


def require_gpu():
    """torch with a visible CUDA GPU, or a one-line error."""
    try:
        import torch
    except ImportError:
        raise PatchkitError(
            "verify needs torch with CUDA (install patchkit[gpu] next to vLLM)"
        ) from None
    if not torch.cuda.is_available():
        raise PatchkitError(
            "verify needs an NVIDIA GPU and none is visible to torch "
            "(torch.cuda.is_available() is False); run it on the GPU server"
        )
    return torch


def importable_tree() -> VllmTree:
    """The vLLM this Python imports (verify checks what actually runs)."""
    try:
        return locate(None)
    except PatchkitError:
        raise PatchkitError(
            "verify checks the vLLM this Python imports, and there is none; "
            "run it with the Python that serves vLLM"
        ) from None


def environment(torch, tree: VllmTree) -> dict:
    import importlib.metadata

    major, minor = torch.cuda.get_device_capability()
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    from patchkit.proof.kernelcheck import installed_backend

    return {
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "torch": torch.__version__,
        "triton": triton,
        "vllm": tree.version,
        "vllm_path": str(tree.root),
        "lora_backend": installed_backend(),
    }


def run(catalogue: Catalogue, e2e: bool, seed: int | None, keep: Path | None) -> VerifyReport:
    """The GPU comes first (its absence is the likelier error), then the importable vLLM."""
    started = time.monotonic()
    torch = require_gpu()
    tree = importable_tree()
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    patches = [
        {
            "id": s.assessment.patch.id,
            "state": str(s.assessment.state),
            "variant": s.assessment.variant.name if s.assessment.variant else None,
        }
        for s in operations.status(tree, catalogue).steps
    ]
    try:
        from patchkit.proof import kernelcheck

        env = {**environment(torch, tree), "seed": seed}
        report = VerifyReport(env, patches)
        report.kernel = kernelcheck.trigger_cases(seed) + kernelcheck.wrapper_cases(seed)
    except ImportError as exc:
        raise PatchkitError(f"cannot import vLLM's LoRA code from {tree.root}: {exc}") from None
    if e2e:
        report.e2e = _run_e2e(seed, keep)
    report.seconds = time.monotonic() - started
    return report


def _run_e2e(seed: int, keep: Path | None) -> list:
    from patchkit.proof import e2e

    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        return e2e.run_e2e(keep, seed)
    with tempfile.TemporaryDirectory(prefix="patchkit-e2e-") as workdir:
        return e2e.run_e2e(Path(workdir), seed)
