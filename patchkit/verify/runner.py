"""`patchkit verify`: prove on this machine's GPU that the installed vLLM's LoRA path is sound.

It runs against the vLLM that this Python imports, patched or not, and says
which patches are applied. Kernel checks always run; `--e2e` adds the tiny
Qwen3.5 and Qwen3.5-MoE + LoRA serving run (patchkit.verify.e2e), `--model`
the user's own model and adapters against merged references
(patchkit.verify.usermodel); both serve through patchkit.verify.serving, on
`--tensor-parallel-size` GPUs per engine. The verdict is PASSED, FAILED (a
failed check that applies to this install, or an adapter that failed) or
INCONCLUSIVE (an adapter its reference could not decide). torch and vllm
are imported only here, lazily, so the other commands never load them.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.catalogue.model import Catalogue
from patchkit.codes import Code
from patchkit.errors import PatchkitError, UsageProblem
from patchkit.patching import operations
from patchkit.verify.checks import FAILED, INCONCLUSIVE, PASSED, overall
from patchkit.verify.rule import ModelResult
from patchkit.vllmtree.tree import VllmNotFound, VllmTree, locate


@dataclass
class VerifyReport:
    """What verify found: the kernel checks, --e2e's checks, --model's result."""

    environment: dict
    patches: list[dict]
    kernel: list = field(default_factory=list)
    e2e: list = field(default_factory=list)
    model: ModelResult | None = None
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        """FAILED on a failed check that counts (kernel, --e2e, an engine of --model) or a
        failed adapter; else INCONCLUSIVE on a check or adapter that could not be decided;
        else PASSED."""
        kernel_failed = any(not k.ok for k in self.kernel if k.counts)
        found = [FAILED] if kernel_failed else []
        found += [FAILED if c.decided else INCONCLUSIVE for c in self.e2e if not c.ok]
        if self.model is not None:
            found.append(self.model.verdict)
        return overall(found)

    @property
    def ok(self) -> bool:
        return self.verdict == PASSED


class GpuUnavailable(PatchkitError):
    """verify runs on a GPU, and this Python has none it can use: no torch with CUDA
    (``torch``: False), or no GPU visible to it."""

    code = Code.GPU_UNAVAILABLE


class VllmImportFailed(PatchkitError):
    """vLLM's LoRA code (``path``: the tree) raised on import: its ``error``."""

    code = Code.VLLM_IMPORT_FAILED


def require_gpu():
    """torch with a visible CUDA GPU, or a one-line error."""
    try:
        import torch
    except ImportError:
        raise GpuUnavailable(
            "verify needs torch with CUDA: run it with the Python that serves vLLM, which "
            "has it (--e2e also needs pip install 'transformers>=5.17' 'peft>=0.17')",
            torch=False,
        ) from None
    if not torch.cuda.is_available():
        raise GpuUnavailable(
            "verify needs an NVIDIA GPU and none is visible to torch "
            "(torch.cuda.is_available() is False); run it on the GPU server",
            torch=True,
        )
    return torch


def importable_tree() -> VllmTree:
    """The vLLM this Python imports (verify checks what actually runs)."""
    try:
        return locate(None)
    except PatchkitError as exc:
        raise VllmNotFound(
            "verify checks the vLLM this Python imports, and there is none; "
            "run it with the Python that serves vLLM",
            python=sys.executable,
            cause=exc,
        ) from None


def environment(torch, tree: VllmTree) -> dict:
    import importlib.metadata

    major, minor = torch.cuda.get_device_capability()
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    from patchkit.verify.kernelcheck import installed_backend

    return {
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "torch": torch.__version__,
        "triton": triton,
        "vllm": tree.version,
        "vllm_path": str(tree.root),
        "lora_backend": installed_backend(),
    }


# The largest --seed: vLLM seeds numpy with it (vllm.utils.torch_utils.set_random_seed:
# np.random.seed takes 0 to 2**32 - 1), and torch's generators with it plus a few.
MAX_SEED = 2**32 - 1


def check_seed(seed: int) -> None:
    """A seed every generator verify hands it to takes: 0 to MAX_SEED."""
    if not 0 <= seed <= MAX_SEED:
        shown = str(seed) if seed.bit_length() <= 128 else f"of {seed.bit_length()} bits"
        raise UsageProblem(
            f"--seed {shown}: a whole number from 0 to {MAX_SEED} (vLLM seeds numpy with it)"
        )


@dataclass
class Request:
    """What `patchkit verify` was asked to do (the CLI's options)."""

    e2e: bool = False
    seed: int | None = None
    keep: Path | None = None
    model: Path | None = None
    loras: list = field(default_factory=list)
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    workdir: Path | None = None
    reference: str | None = None  # --reference: merged, peft, or None (verify picks)
    # the CLI's words of an adapter check finding's message (verify is below the CLI)
    finding_words: Callable = str


def run(catalogue: Catalogue, request: Request, say=lambda line: None) -> VerifyReport:
    """Usage first, then the GPU (its absence is the likelier error), then the importable vLLM.

    Everything --model can refuse (its config, the prompt lengths, the disk
    the merged references need) is decided before any GPU work.
    """
    started = time.monotonic()
    seed = random.SystemRandom().randrange(2**31) if request.seed is None else request.seed
    setup = None
    if request.model is not None:
        from patchkit.verify import modelchecks, references, usermodel

        setup = usermodel.prepare(
            request.model,
            request.loras,
            request.tensor_parallel_size,
            request.max_model_len,
            seed,
            request.reference,
        )
        # The adapters are read and the disk is said here, not after the kernel
        # checks and --e2e's minutes on the GPU: a bad adapter fails first.
        if request.reference != "peft":
            base = references.reference_base(_model_keep(request), request.workdir)
            setup["plans"] = references.plan_references(request.model, setup["adapters"], base, say)
    torch = require_gpu()
    from patchkit.verify.serving import check_tensor_parallel

    check_tensor_parallel(request.tensor_parallel_size, torch.cuda.device_count())
    tree = importable_tree()
    if setup is not None:  # before any GPU work: what the adapters' files already say
        setup["admission"] = modelchecks.admission_checks(
            setup["adapters"], request.model, tree, request.finding_words
        )
    patches = [
        {
            "id": s.assessment.patch.id,
            "state": str(s.assessment.state),
            "variant": s.assessment.variant.name if s.assessment.variant else None,
        }
        for s in operations.status(tree, catalogue).steps
    ]
    try:
        from patchkit.verify import kernelcheck

        env = {
            **environment(torch, tree),
            "seed": seed,
            "tensor_parallel_size": request.tensor_parallel_size,
        }
        report = VerifyReport(env, patches)
        report.kernel = kernelcheck.trigger_cases(seed) + kernelcheck.wrapper_cases(seed)
    except ImportError as exc:
        raise VllmImportFailed(
            f"cannot import vLLM's LoRA code from {tree.root}: {exc}",
            path=tree.root,
            error=str(exc),
        ) from None
    gpu = gpu_memory(torch, request.tensor_parallel_size)
    if request.e2e:
        report.e2e = _run_e2e(seed, request, gpu, say)
    if setup is not None:
        from patchkit.verify import usermodel

        report.model = usermodel.run_model(
            request.model, setup, request.workdir, _model_keep(request), gpu, say
        )
    report.seconds = time.monotonic() - started
    return report


def _model_keep(request: Request) -> Path | None:
    """Where --model's files go under --keep (--e2e's go in --keep itself)."""
    return request.keep / "model" if request.keep is not None else None


def gpu_memory(torch, tp: int) -> tuple[int, int]:
    """Total memory of one GPU and the least free on the GPUs the engines use."""
    free = [torch.cuda.mem_get_info(i) for i in range(tp)]
    return min(t for _, t in free), min(f for f, _ in free)


def _run_e2e(seed: int, request: Request, gpu: tuple[int, int], say) -> list:
    from patchkit.verify import e2e

    tp = request.tensor_parallel_size
    if request.keep is not None:
        request.keep.mkdir(parents=True, exist_ok=True)
        return e2e.run_e2e(request.keep, seed, tp, gpu, say)
    made = request.workdir is not None and not request.workdir.exists()
    if made:  # --workdir may be new (created here) or empty
        request.workdir.mkdir(parents=True)
    try:
        with tempfile.TemporaryDirectory(prefix="patchkit-e2e-", dir=request.workdir) as workdir:
            return e2e.run_e2e(Path(workdir), seed, tp, gpu, say)
    finally:
        if made:
            shutil.rmtree(request.workdir, ignore_errors=True)
