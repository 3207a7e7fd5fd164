"""`patchkit doctor --kernels`: every LoRA kernel this tree launches, compiled for sm_90 and read.

On most GPUs the NaN of vLLM #48590 never fires, so a run cannot prove a
fix. The machine code can: the race is a pattern that ptxas < 13.3 emits
(:mod:`patchkit.doctor.sass`). The scan, in steps, one module each:

1. :mod:`~patchkit.doctor.toolchain`: the Triton, ptxas and
   disassembler to use (and the Triton installed next to the tree);
2. :mod:`~patchkit.doctor.configs`: the calls a model's layers make into
   vLLM's LoRA ops, evaluated by the tree's own host code on an H100, H200
   and H20 (:mod:`~patchkit.doctor.standins`);
3. :mod:`~patchkit.doctor.signatures`: each launch bound by Triton's JIT;
4. :mod:`~patchkit.doctor.kernelbuild`: each distinct launch compiled, its
   SASS read (and cached).

This module puts them together: one :class:`Case` per distinct compile,
naming its kernel and the calls that reach it, and whether this install
makes those calls. Every kernel the tree launches from
``vllm/lora/ops/triton_ops/`` is listed; one that no call reaches is a case
of its own (an ``error``), so a new kernel cannot go unscanned unnoticed.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.doctor import configs, kernelbuild, sass, signatures
from patchkit.doctor.configs import Call, Evaluation, Model
from patchkit.doctor.standins import GPUS, REAL, Gpu, Sandbox
from patchkit.doctor.toolchain import ScanUnavailable, Toolchain, disassembler, toolchain
from patchkit.vllmtree.tree import VllmTree

OPS_DIR = "vllm/lora/ops/triton_ops"
GEMV_ENV = "PATCHKIT_LORA_GEMV"  # matmul-add-lora-linear's GEMV route: on unless "0"
# Where the tree's LoRA kernels live: vLLM's ops, and a patch's module beside the punica
# wrappers (matmul-add-lora-linear's GEMV kernels); pristine wrappers define none.
KERNEL_DIRS = (OPS_DIR, "vllm/lora/punica_wrapper")
FP8_OPS = ("lora_shrink_fp8", "lora_expand_fp8", "fused_moe_lora_fp8")
CALL_SITES = ("vllm/lora", "vllm/model_executor")  # where vLLM would call an op from
MOE_CONFIGS = "vllm/model_executor/layers/fused_moe/configs"  # tuned MoE configs vLLM ships


@dataclass
class Case:
    """One distinct compile of one kernel, and the calls of vLLM that reach it."""

    kernel: str
    family: str  # dense | gemv (the torch path's own kernels) | moe | fp8
    config: dict = field(default_factory=dict)  # block sizes, stages, warps (as launched)
    signature: dict = field(default_factory=dict)  # Triton's, as its JIT bound the launch
    constants: dict = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)  # the calls that reach it
    gpus: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # files vLLM's code read (tuned configs)
    approximate: str = ""  # why vLLM may not build it exactly so; "" when it does
    called: bool = True
    why_not_called: str = ""
    verdict: sass.KernelVerdict = "error"
    hgmma: int = 0
    register_a: int = 0
    hazards: list[sass.Hazard] = field(default_factory=list)
    error: str = ""
    key: str = ""

    def shape(self) -> str:
        """'block M64 N128 K32, 2 stage(s), 4 warps, fp32 input' (empty for an error case)."""
        blocks = " ".join(
            f"{k.replace('BLOCK_SIZE_', '').replace('BLOCK_', '')}{v}"
            for k, v in self.config.items()
            if k.startswith("BLOCK")
        )
        parts = [f"block {blocks}"] if blocks else []
        if self.config.get("num_stages"):
            parts.append(f"{self.config['num_stages']} stage(s), {self.config['num_warps']} warps")
        first = next(iter(self.signature.values()), "")
        if first.startswith("*"):
            parts.append(f"{first[1:]} input")
        return ", ".join(parts)

    def label(self) -> str:
        """'_lora_expand_kernel block M64 N128 K32, ... (the first call reaching it, +5 more)'."""
        more = f", +{len(self.calls) - 1} more" if len(self.calls) > 1 else ""
        reached = f" ({self.calls[0]}{more})" if self.calls else ""
        shape = f" {self.shape()}" if self.shape() else ""
        return f"{self.kernel}{shape}{reached}"


@dataclass
class ScanReport:
    """The scan's result, as objects until the CLI prints it."""

    toolchain: Toolchain | None = None
    disassembler: str = ""
    gpus: list[str] = field(default_factory=list)
    models: list[Model] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)  # every kernel the tree launches
    calls: int = 0
    cases: list[Case] = field(default_factory=list)
    seconds: float = 0.0
    remembered: bool = False  # the same scan's result, from patchkit's cache
    error: str = ""

    def by_kernel(self) -> dict[str, list[Case]]:
        """Cases grouped by kernel, in the order the tree's kernels were found."""
        grouped: dict[str, list[Case]] = {k: [] for k in self.kernels}
        for case in self.cases:
            grouped.setdefault(case.kernel, []).append(case)
        return grouped

    def record(self) -> dict:
        """The scan as patchkit's cache remembers it (:meth:`stored` reads it back)."""
        data = dataclasses.asdict(self)
        for case, stored in zip(self.cases, data["cases"], strict=True):
            stored["hazards"] = [kernelbuild.hazard_record(h) for h in case.hazards]
        return data

    @classmethod
    def stored(cls, data: dict) -> ScanReport:
        report = cls(**{k: v for k, v in data.items() if k not in ("cases", "models", "toolchain")})
        report.toolchain = Toolchain(**data["toolchain"]) if data["toolchain"] else None
        report.models = [Model(**m | {"ranks": tuple(m["ranks"])}) for m in data["models"]]
        report.cases = [_stored_case(c) for c in data["cases"]]
        return report


def _stored_case(data: dict) -> Case:
    names = {f.name for f in dataclasses.fields(Case)}
    hazards = [kernelbuild.stored_hazard(h) for h in data["hazards"]]
    return Case(**{k: v for k, v in data.items() if k in names} | {"hazards": hazards})


def scan(
    tree: VllmTree,
    gpus: Iterable[Gpu] = GPUS,
    models: Iterable[Model] = configs.DEFAULT_MODELS,
    environ: Mapping[str, str] | None = None,
    replaced: str = "",
    select: Callable[[Call], bool] | None = None,
) -> ScanReport:
    """Compile and read every kernel launch vLLM's host code makes for ``models``.

    ``replaced`` is why the dense kernels do not run here (an applied patch
    that replaces them), or "". ``select`` limits the calls (tests use it).
    """
    environ = dict(os.environ if environ is None else environ)
    gpus = list(gpus)
    report = ScanReport(gpus=[g.name for g in gpus], models=list(models))
    started = time.monotonic()
    report.toolchain = tools = toolchain()
    key = scan_key(tree, report, environ, replaced) if select is None else None
    remembered = kernelbuild.recall(key) if key else None
    if remembered is not None:
        found = ScanReport.stored(remembered)
        found.remembered, found.seconds = True, round(time.monotonic() - started, 1)
        return found
    try:
        if not tools.triton or not tools.location:
            raise ScanUnavailable("Triton is not installed for this Python")
        disassemble = disassembler(tools.location)
        report.disassembler = Path(disassemble[0]).name
        report.kernels = launched_kernels(tree)
        with signatures.sm90():
            evaluations = _evaluate(tree, gpus, report, environ, select)
            launches = {one.key: one for e in evaluations for one in e.launches}
            readings = kernelbuild.read_all(list(launches.values()), tools, disassemble)
    except ScanUnavailable as exc:
        report.error = str(exc)
        return report
    except ImportError as exc:  # torch or Triton cannot be imported
        report.error = f"the scan needs torch and Triton importable here ({exc})"
        return report
    fp8_called = fp8_call_sites(tree)
    report.cases = _cases(evaluations, launches, readings, environ, replaced, fp8_called)
    report.cases += _unreached(report.kernels, report.cases)
    report.seconds = round(time.monotonic() - started, 1)
    if key:
        kernelbuild.remember(key, report.record())
    return report


def scan_key(tree: VllmTree, report: ScanReport, environ: Mapping[str, str], replaced: str) -> str:
    """Everything a scan's result depends on: the vLLM code it runs, the files that code
    reads (tuned configs), the settings, GPUs, shapes, toolchain and patchkit's own code."""
    digest = hashlib.sha256()
    for path in _inputs(tree, environ):
        name = path.relative_to(tree.root) if path.is_relative_to(tree.root) else path
        digest.update(str(name).encode())  # a copy of the tree is the same scan
        try:
            digest.update(path.read_bytes() if path.suffix == ".py" else _stamp(path))
        except OSError:
            digest.update(b"-")
    settings = {
        k: v for k, v in environ.items() if k.startswith(("VLLM_", "TRITON_")) or k == GEMV_ENV
    }
    models = [dataclasses.asdict(m) for m in report.models]
    facts = [report.gpus, models, settings, replaced, dataclasses.asdict(report.toolchain)]
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()


def _inputs(tree: VllmTree, environ: Mapping[str, str]) -> list[Path]:
    """The files a scan reads or runs, sorted: vLLM's modules, config folders, patchkit's."""
    roots = [tree.path(r.replace(".", "/")) for r in REAL]
    found = [p.with_suffix(".py") for p in roots if p.with_suffix(".py").is_file()]
    found += [f for p in roots if p.is_dir() for f in p.rglob("*.py")]
    folders = [tree.path(MOE_CONFIGS), Path(environ.get("VLLM_TUNED_CONFIG_FOLDER") or "/-")]
    found += [f for folder in folders if folder.is_dir() for f in folder.iterdir()]
    found += list(Path(__file__).parent.glob("*.py"))
    return sorted(found)


def _stamp(path: Path) -> bytes:
    info = path.stat()
    return f"{info.st_size}:{info.st_mtime_ns}".encode()


def _evaluate(tree, gpus, report, environ, select) -> list[Evaluation]:
    """Every call on every GPU; one sandbox per setting that vLLM reads on import."""
    calls = configs.calls(report.models, _settings(tree))
    calls = [c for c in calls if select is None or select(c)]
    report.calls = len(calls)
    boxes: dict[tuple, Sandbox] = {}
    found = []
    for call in calls:
        settings = {**environ, **call.environment}
        on_import = configs.import_settings(settings)
        if on_import not in boxes:
            boxes[on_import] = Sandbox(tree.root, gpus[0], settings)
        found += _on_every_gpu(boxes[on_import], call, gpus, environ)
    return [e for e in found if not e.absent]


def _on_every_gpu(box: Sandbox, call: Call, gpus: list[Gpu], environ) -> list[Evaluation]:
    """One call's evaluation per GPU. The torch path's GEMV host code picks by shapes
    alone (it reads no device property), so it runs once and stands for every GPU
    unless it leaned on a stand-in: its 1,836 calls (every row count, rank and slice
    count) would otherwise triple the scan's time for the same launches."""
    first = configs.evaluate(box, call, gpus[0], environ)
    if call.family == "gemv" and not first.approximate and not first.error:
        return [first] + [dataclasses.replace(first, gpu=gpu) for gpu in gpus[1:]]
    return [first] + [configs.evaluate(box, call, gpu, environ) for gpu in gpus[1:]]


def _settings(tree: VllmTree) -> list[str]:
    """The settings this release knows (its envs.py names them)."""
    text = tree.path("vllm/envs.py").read_text(encoding="utf-8", errors="replace")
    wanted = {
        "default": "",
        "batch-invariant": configs.INVARIANT,
        "dual-stream": configs.DUAL_STREAM,
        "dual-stream-no-pdl": configs.NO_PDL,
    }
    return [name for name, variable in wanted.items() if variable in text]


def _cases(evaluations, launches, readings, environ, replaced, fp8_called) -> list[Case]:
    """One case per distinct launch (and one per distinct failure), with what reaches it."""
    cases: dict[str, Case] = {}
    exact: set[str] = set()  # cases that some evaluation reached without a stand-in
    for ev in evaluations:
        for launch in ev.launches:
            case = cases.get(launch.key) or _new_case(launch, ev, readings[launch.key])
            cases[launch.key] = case
            _reached(case, ev, environ, replaced, fp8_called)
            case.sources = sorted(set(case.sources) | set(ev.read.get(launch.key, ())))
            leaned = ev.leaned.get(launch.key)
            if not leaned:
                exact.add(launch.key)
            elif launch.key not in exact and not case.approximate:
                case.approximate = _approximation(leaned)
        if ev.error:
            key = f"error:{ev.call.entry}:{ev.error}"
            case = cases.setdefault(key, _error_case(ev, key))
            _reached(case, ev, environ, replaced, fp8_called)
            case.sources = sorted(set(case.sources) | set(ev.files))
    for key in exact:
        cases[key].approximate = ""
    return sorted(cases.values(), key=lambda c: (c.family, c.kernel, c.verdict != "hazard"))


def _new_case(launch, ev: Evaluation, reading) -> Case:
    return Case(
        kernel=launch.kernel,
        family=ev.call.family,
        config=launch.config(),
        signature=launch.signature(),
        constants=launch.constants(),
        key=launch.key,
        verdict=reading.verdict,
        hgmma=reading.hgmma,
        register_a=reading.register_a,
        hazards=reading.hazards,
        error=reading.error,
        called=False,
    )


def _error_case(ev: Evaluation, key: str) -> Case:
    whose = "vLLM's own code raises" if ev.vllm_raises else "the scan could not follow vLLM"
    return Case(
        kernel=ev.call.entry,
        family=ev.call.family,
        verdict="error",
        key=key,
        called=False,
        error=f"{whose}: {ev.error}",
    )


def _reached(case: Case, ev: Evaluation, environ, replaced: str, fp8_called: bool) -> None:
    """Add one evaluation's call to a case, and whether that call runs here."""
    label = ev.call.label()
    if label not in case.calls:
        case.calls.append(label)
    if ev.gpu.name not in case.gpus:
        case.gpus.append(ev.gpu.name)
    runs, why = configs.runs_here(ev.call, environ)
    if ev.call.family == "dense" and replaced:
        runs, why = False, replaced
    if ev.call.family == "gemv" and not replaced:
        runs, why = False, "the torch LoRA path (matmul-add-lora-linear) is off here"
    elif ev.call.family == "gemv" and environ.get(GEMV_ENV, "").strip() == "0":
        runs, why = False, f"the torch path's GEMV route is off here ({GEMV_ENV}=0)"
    if ev.call.family == "fp8" and not fp8_called:
        runs, why = False, "no vLLM code calls the fp8 LoRA ops in this release"
    if runs:
        case.called, case.why_not_called = True, ""
    elif not case.called and not case.why_not_called:
        case.why_not_called = why


def _approximation(leaned: list[str]) -> str:
    used = ", ".join(leaned[:3]) + (" ..." if len(leaned) > 3 else "")
    return f"vLLM's host code used {used}, which the scan only stands in for"


def _unreached(kernels: list[str], cases: list[Case]) -> list[Case]:
    """An error case for each kernel the tree launches that no call of the scan reached."""
    reached = {c.kernel for c in cases}
    return [
        Case(
            kernel=k,
            family="?",
            verdict="error",
            called=False,
            key=f"unreached:{k}",
            error=f"the tree launches {k}, but no call of the scan reaches it",
        )
        for k in kernels
        if k not in reached
    ]


def launched_kernels(tree: VllmTree) -> list[str]:
    """The @triton.jit kernels of the tree's LoRA code that it launches (``k[grid](``)."""
    jit, launched = [], set()
    paths = [
        p for d in KERNEL_DIRS if tree.path(d).is_dir() for p in sorted(tree.path(d).glob("*.py"))
    ]
    for path in paths:
        module = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(module):
            if isinstance(node, ast.FunctionDef) and any(
                "triton.jit" in ast.unparse(d) for d in node.decorator_list
            ):
                jit.append(node.name)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                if isinstance(node.func.value, ast.Name):
                    launched.add(node.func.value.id)
    return [name for name in jit if name in launched]


def fp8_call_sites(tree: VllmTree) -> bool:
    """Whether any vLLM code outside the ops package calls an fp8 LoRA op."""
    ops_dir = tree.path(OPS_DIR)
    for top in CALL_SITES:
        for path in tree.path(top).rglob("*.py"):
            if ops_dir in path.parents:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if any(name in text for name in FP8_OPS):
                return True
    return False
