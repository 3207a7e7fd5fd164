"""`patchkit doctor`: what in this environment exposes or protects it, without a GPU run.

Reads files and runs `nvidia-smi` and Triton's `ptxas --version`; imports
neither vLLM nor torch nor Triton, so it works in image builds and on
machines without GPUs. Ends with a verdict per known bug. ``--kernels``
also imports Triton to compile vLLM's LoRA kernels for sm_90
(:mod:`patchkit.kernelscan`); the #48590 verdict then rests on their SASS.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.version import Version

from patchkit import operations
from patchkit.bytecode import bytecode_files
from patchkit.caches import cache_dirs
from patchkit.catalogue import Catalogue, Variant
from patchkit.tree import VllmTree

PTXAS_FIXED = (13, 3)  # ptxas from CUDA 13.3 no longer reuses wgmma A registers early
MATMUL, BLOCK_N, SPLIT = "matmul-add-lora-linear", "expand-block-n", "split-in-proj-qkvz"


@dataclass
class Verdict:
    bug: str
    status: str  # exposed, protected, not affected, unknown (no vLLM found)
    reason: str
    fix: str = ""


@dataclass
class DoctorReport:
    gpus: list[dict] = field(default_factory=list)
    gpu_note: str = ""
    triton: dict = field(default_factory=dict)
    vllm: dict = field(default_factory=dict)
    patches: list[dict] = field(default_factory=list)
    tuned_configs: list[dict] = field(default_factory=list)
    stale_bytecode: list[str] = field(default_factory=list)
    old_caches: list[dict] = field(default_factory=list)
    kernels: dict = field(default_factory=dict)  # the --kernels scan, when asked for
    verdicts: list[Verdict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


# ----- facts -----


def gpus() -> tuple[list[dict], str]:
    """Name and compute capability of each GPU nvidia-smi shows."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi on PATH: GPU not visible here"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"nvidia-smi failed: {exc}"
    found = []
    for line in out.strip().splitlines():
        name, _, capability = line.rpartition(",")
        found.append({"name": name.strip(), "compute_capability": capability.strip()})
    return found, "" if found else "nvidia-smi lists no GPU"


def triton_facts() -> dict:
    """Triton's version and the ptxas it compiles sm_90 with (TRITON_PTXAS_PATH or bundled)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = None
    ptxas, source = os.environ.get("TRITON_PTXAS_PATH"), "TRITON_PTXAS_PATH"
    spec = importlib.util.find_spec("triton") if not ptxas else None
    if spec is not None and spec.submodule_search_locations:
        base = Path(next(iter(spec.submodule_search_locations)))
        ptxas, source = str(base / "backends" / "nvidia" / "bin" / "ptxas"), "bundled"
    return {
        "version": version,
        "ptxas": ptxas,
        "ptxas_source": source if ptxas else None,
        "ptxas_version": ptxas_version(ptxas) if ptxas else None,
    }


def ptxas_version(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+), V([\d.]+)", out.stdout)
    return match.group(2) if match else None


def tuned_configs(folder: str | None) -> list[dict]:
    """Expand config files in VLLM_TUNED_CONFIG_FOLDER that matter for num_slices=1."""
    if not folder:
        return []
    found = []
    for path in sorted(Path(folder).glob("*_EXPAND_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            found.append({"file": str(path), "problem": f"unreadable: {exc}"})
            continue
        for max_loras, by_slices in data.items():
            if "1" not in by_slices:
                found.append(
                    {
                        "file": str(path),
                        "problem": (
                            f"max_loras {max_loras} has no num_slices '1' entry: "
                            "single-slice expand raises KeyError"
                        ),
                    }
                )
                continue
            risky = [
                c
                for c in _leaves(by_slices["1"])
                if c.get("block_n", 0) > 32 and c.get("num_stages", 2) >= 2
            ]
            if risky:
                found.append(
                    {
                        "file": str(path),
                        "problem": (
                            f"max_loras {max_loras}: {len(risky)} num_slices=1 configs with "
                            "block_n > 32 and num_stages >= 2 replace the patched block_n 32"
                        ),
                    }
                )
    return found


def _leaves(node) -> list[dict]:
    if isinstance(node, dict) and "block_n" in node:
        return [node]
    if isinstance(node, dict):
        return [leaf for child in node.values() for leaf in _leaves(child)]
    return []


def stale_bytecode(tree: VllmTree, relpaths: list[str]) -> list[str]:
    """.pyc files that do not match their source as Python would check them."""
    stale = []
    for relpath in relpaths:
        source = tree.path(relpath)
        if not source.is_file():
            continue
        stat = source.stat()
        for pyc in bytecode_files(tree.root, relpath):
            header = pyc.read_bytes()[:16]
            if len(header) < 16:
                stale.append(f"{pyc} (truncated)")
                continue
            flags, mtime, size = struct.unpack("<4xIII", header)
            if flags & 1 and not flags & 2:
                stale.append(f"{pyc} (hash-based, unchecked: never re-validated)")
            elif flags & 1:
                source_hash = importlib.util.source_hash(source.read_bytes())
                if header[8:16] != source_hash:
                    stale.append(f"{pyc} (hash differs from source)")
            elif mtime != int(stat.st_mtime) & 0xFFFFFFFF or size != stat.st_size & 0xFFFFFFFF:
                stale.append(f"{pyc} (built from another version of the source)")
    return stale


def old_caches(patched_at: float | None) -> list[dict]:
    """Compile-cache entries written before the patched files were."""
    if patched_at is None:
        return []
    found = []
    for cache in cache_dirs():
        if cache.path is None or not cache.path.is_dir():
            continue
        older = [e for e in cache.path.iterdir() if e.stat().st_mtime < patched_at]
        if older:
            found.append({"name": cache.name, "path": str(cache.path), "entries": len(older)})
    return found


# ----- verdicts -----


def verdicts(report: DoctorReport, version: Version | None) -> list[Verdict]:
    states = {p["id"]: p["state"] for p in report.patches}
    found = [
        _nan_verdict(report, states),
        _split_verdict(states, version),
        _partial_adapter_verdict(version),
        _stale_verdict(report),
    ]
    if "error" in report.vllm:  # no vLLM tree: nothing to judge a bug of vLLM by
        return [Verdict(v.bug, "unknown", "no vLLM found to judge by") for v in found]
    return found


def _nan_verdict(report: DoctorReport, states: dict) -> Verdict:
    bug = "vLLM #48590: NaN from LoRA expand on sm_90, output '!!!!!!'"
    fix = "patchkit apply"
    hopper = [g for g in report.gpus if g["compute_capability"] == "9.0"]
    ptxas = report.triton.get("ptxas_version")
    if report.gpus and not hopper:
        return Verdict(bug, "not affected", "no sm_90 GPU here (the bug needs Hopper's wgmma)")
    if report.kernels and not report.kernels.get("error"):
        return _nan_verdict_from_scan(bug, report, states)
    if _fixed_ptxas(ptxas):
        return Verdict(bug, "not affected", f"Triton's ptxas {ptxas} is 13.3 or newer")
    if states.get(BLOCK_N) == "upstream":
        return Verdict(bug, "not affected", "fixed in this vLLM (num_stages 1 on sm_90)")
    where = "an sm_90 GPU" if hopper else "an sm_90 GPU, if this runs on one"
    backend = os.environ.get("PATCHKIT_LORA_BACKEND", "torch").strip().lower() or "torch"
    if states.get(MATMUL) == "applied" and backend == "torch":
        return Verdict(bug, "protected", "LoRA runs as torch matmuls (matmul-add-lora-linear)")
    if states.get(BLOCK_N) == "applied" and not report.tuned_configs:
        return Verdict(bug, "protected", "expand uses block_n 32 on sm_90 (expand-block-n)")
    if states.get(BLOCK_N) == "applied":
        return Verdict(
            bug,
            "exposed",
            "a tuned expand config replaces the patched block_n 32",
            "remove the VLLM_TUNED_CONFIG_FOLDER files listed above, or unset "
            "PATCHKIT_LORA_BACKEND=triton",
        )
    return Verdict(
        bug,
        "exposed",
        f"Triton LoRA kernels with ptxas {ptxas or 'unknown'} < 13.3 on {where}",
        fix,
    )


def _nan_verdict_from_scan(bug: str, report: DoctorReport, states: dict) -> Verdict:
    """#48590 judged by the compiled kernels: a hazard this install runs, or none."""
    scan = report.kernels
    ptxas = f"ptxas {scan['ptxas_version']} ({scan['ptxas']})"
    cases = scan["cases"]
    called = [c for c in cases if c["called"] and c["verdict"] == "hazard"]
    errors = [c for c in cases if c["called"] and c["verdict"] == "error"]
    if called:
        tuned = [c for c in called if c["source"].startswith("tuned")]
        first = (tuned or called)[0]
        where = first["hazards"][0]
        return Verdict(
            bug,
            "exposed",
            f"kernel scan: {len(called)} config(s) this install runs overwrite the A registers "
            f"of an in-flight wgmma, e.g. {first['label']}: {where['instruction']} at "
            f"{where['address']} (HGMMA at {where['wgmma']}); {ptxas}",
            _scan_fix(first, states),
        )
    idle = [c for c in cases if not c["called"] and c["verdict"] == "hazard"]
    also = (
        f"; hazard only in configs not run here, e.g. {idle[0]['label']} "
        f"({idle[0]['why_not_called']})"
        if idle
        else ""
    )
    unknown = f"; {len(errors)} config(s) failed to compile (see the scan)" if errors else ""
    runs = sum(1 for c in cases if c["called"])
    if runs == 0:
        reason = next((c["why_not_called"] for c in cases), "no Triton LoRA kernel runs")
        return Verdict(bug, "protected", f"kernel scan: {reason}{also}")
    evidence = f"kernel scan: no overwrite in the {runs} config(s) this install runs, {ptxas}"
    if _fixed_ptxas(scan["ptxas_version"]):
        evidence += f" (a ptxas from {'.'.join(map(str, PTXAS_FIXED))} on keeps wgmma registers)"
    patched = any(states.get(p) == "applied" for p in (BLOCK_N, MATMUL))
    status = "protected" if patched else "not affected"
    return Verdict(bug, "unknown" if errors else status, evidence + also + unknown)


def _fixed_ptxas(version: str | None) -> bool:
    try:
        return tuple(int(p) for p in (version or "").split(".")[:2]) >= PTXAS_FIXED
    except ValueError:
        return False


def _scan_fix(case: dict, states: dict) -> str:
    if case["source"].startswith("tuned"):
        return f"remove or retune {case['source'][len('tuned: ') :]} (block_n 32 or num_stages 1)"
    if states.get(BLOCK_N) == "needed" or states.get(MATMUL) == "needed":
        return "patchkit apply"
    return (
        "PATCHKIT_LORA_BACKEND=torch (matmul-add-lora-linear), or TRITON_PTXAS_PATH "
        "pointing at a ptxas >= 13.3"
    )


def called_here(states: dict):
    """Which scanned kernel configs this install runs, from its patches and environment."""
    backend = os.environ.get("PATCHKIT_LORA_BACKEND", "torch").strip().lower() or "torch"
    torch_path = states.get(MATMUL) == "applied" and backend == "torch"
    dual = os.environ.get("VLLM_LORA_ENABLE_DUAL_STREAM", "0").strip() not in ("", "0")
    no_pdl = os.environ.get("VLLM_LORA_DISABLE_PDL", "0").strip() not in ("", "0")

    def called(case) -> tuple[bool, str]:
        if torch_path:
            return False, "the torch path replaces the Triton LoRA ops (matmul-add-lora-linear)"
        if case.path == "dual-stream" and not (dual and not no_pdl):
            return False, "dual-stream LoRA with PDL is off (VLLM_LORA_ENABLE_DUAL_STREAM)"
        if case.path == "dual-stream-no-pdl" and not (dual and no_pdl):
            return False, "dual-stream LoRA without PDL is off (VLLM_LORA_DISABLE_PDL)"
        return True, ""

    return called


def _split_verdict(states: dict, version: Version | None) -> Verdict:
    bug = "vLLM #35286: Qwen3.5/3.6 with --enable-lora fails at start (in_proj_qkvz)"
    state = states.get(SPLIT)
    if version is None and not states:
        return Verdict(bug, "unknown", "no vLLM found to judge by")
    if state == "applied":
        return Verdict(bug, "protected", "in_proj_qkvz is split under LoRA (split-in-proj-qkvz)")
    if state == "needed":
        return Verdict(
            bug, "exposed", "this vLLM fuses in_proj_qkvz with no LoRA handling", "patchkit apply"
        )
    if state in ("upstream", "not-applicable"):
        return Verdict(bug, "not affected", f"{SPLIT} is {state} for vLLM {version}")
    return Verdict(
        bug,
        "exposed" if state == "conflict" else "not affected",
        f"{SPLIT} is {state or 'not in the catalogue'}",
    )


def _partial_adapter_verdict(version: Version | None) -> Verdict:
    bug = "vLLM #47639 / #57851: adapter with only in_proj_qkv or only in_proj_z crashes"
    fix = "ship adapters that target both in_proj_qkv and in_proj_z (patchkit cannot fix this)"
    if version is None:
        return Verdict(bug, "unknown", "no vLLM version to judge by")
    if version < Version("0.21.0"):
        return Verdict(bug, "not affected", "this vLLM keeps in_proj_qkv and in_proj_z apart")
    if version < Version("0.29.0"):
        return Verdict(bug, "exposed", "expand_packed_lora fails for either module alone", fix)
    return Verdict(bug, "exposed", "an in_proj_z-only adapter still raises (PR #57851 open)", fix)


def _stale_verdict(report: DoctorReport) -> Verdict:
    bug = "stale bytecode or compile caches running unpatched code"
    if report.stale_bytecode or report.old_caches:
        return Verdict(
            bug,
            "exposed",
            f"{len(report.stale_bytecode)} stale .pyc, "
            f"{len(report.old_caches)} caches older than the patch",
            "patchkit revert && patchkit apply --clear-caches",
        )
    return Verdict(bug, "not affected", "bytecode matches its source; no older caches")


# ----- the whole report -----


def run(
    tree: VllmTree | None, tree_error: str, catalogue: Catalogue, kernels: bool = False
) -> DoctorReport:
    report = DoctorReport()
    report.gpus, report.gpu_note = gpus()
    report.triton = triton_facts()
    report.tuned_configs = tuned_configs(os.environ.get("VLLM_TUNED_CONFIG_FOLDER"))
    if tree is None:
        report.vllm = {"error": tree_error}
        report.verdicts = verdicts(report, None)
        return report
    report.vllm = tree.describe()
    status = operations.status(tree, catalogue)
    report.patches = [
        {k: o.to_json()[k] for k in ("id", "state", "variant", "files")} for o in status.outcomes
    ]
    relpaths = sorted({path for p in catalogue.patches for path in _paths(p, tree)})
    report.stale_bytecode = stale_bytecode(tree, relpaths)
    applied = [f for p in report.patches if p["state"] == "applied" for f in p["files"]]
    mtimes = [tree.path(f).stat().st_mtime for f in applied if tree.path(f).exists()]
    report.old_caches = old_caches(max(mtimes) if mtimes else None)
    if kernels:
        report.kernels = scan_kernels(tree, report)
    report.verdicts = verdicts(report, tree.parsed_version)
    return report


def scan_kernels(tree: VllmTree, report: DoctorReport) -> dict:
    """Run the --kernels scan for this tree, as this machine's GPU (or an H200) would."""
    from patchkit import kernelscan

    states = {p["id"]: p["state"] for p in report.patches}
    hopper = [g["name"] for g in report.gpus if g["compute_capability"] == "9.0"]
    result = kernelscan.scan(tree, hopper[0] if hopper else "NVIDIA H200", called_here(states))
    return result.to_json()


def _paths(patch, tree: VllmTree) -> tuple[str, ...]:
    entry = patch.expected_for(tree.parsed_version)
    return entry.paths if isinstance(entry, Variant) else ()


def render(report: DoctorReport, echo) -> None:
    if report.gpus:
        for g in report.gpus:
            echo(f"GPU: {g['name']} (compute capability {g['compute_capability']})")
    else:
        echo(f"GPU: {report.gpu_note}")
    t = report.triton
    ptxas = t.get("ptxas_version") or "unknown"
    where = f" ({t['ptxas_source']}: {t['ptxas']})" if t.get("ptxas") else ""
    echo(
        f"Triton {t.get('version') or 'not installed'}; ptxas for sm_90: {ptxas}{where}; "
        f"fixed from {'.'.join(map(str, PTXAS_FIXED))}"
    )
    if "error" in report.vllm:
        echo(f"vLLM: {report.vllm['error']}")
    else:
        echo(f"vLLM {report.vllm['version']} at {report.vllm['path']}")
        for p in report.patches:
            echo(f"  {p['id']:<24}{p['state']}")
    for c in report.tuned_configs:
        echo(f"tuned config {c['file']}: {c['problem']}")
    for pyc in report.stale_bytecode:
        echo(f"stale bytecode: {pyc}")
    for c in report.old_caches:
        echo(f"{c['name']} {c['path']}: {c['entries']} entries older than the patch")
    render_kernels(report.kernels, echo)
    echo("")
    for v in report.verdicts:
        echo(f"[{v.status}] {v.bug}")
        echo(f"    {v.reason}" + (f"; fix: {v.fix}" if v.fix and v.status == "exposed" else ""))


def render_kernels(scan: dict, echo) -> None:
    if not scan:
        return
    if scan.get("error"):
        echo(f"kernel scan: {scan['error']}")
        return
    echo(
        f"kernel scan (sm_90, Triton {scan['triton']}, ptxas {scan['ptxas_version']}, "
        f"{scan['disassembler']}; {len(scan['cases'])} configs in {scan['seconds']} s):"
    )
    for case in scan["cases"]:
        runs = "runs here" if case["called"] else f"not run: {case['why_not_called']}"
        detail = case["error"] or (
            f"{len(case['hazards'])} overwrite(s), first {case['hazards'][0]['instruction']} "
            f"at {case['hazards'][0]['address']}"
            if case["hazards"]
            else ""
        )
        echo(f"  [{case['verdict']}] {case['label']}; {runs}" + (f"; {detail}" if detail else ""))
