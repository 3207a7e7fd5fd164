"""`patchkit doctor`: what in this environment exposes or protects it, without a GPU run.

Reads files and runs `nvidia-smi` and Triton's `ptxas --version`; imports
neither vLLM nor torch nor Triton, so it works in image builds and on
machines without GPUs. Ends with a verdict per known bug. ``--kernels``
also imports Triton to compile vLLM's LoRA kernels for sm_90
(:mod:`patchkit.diagnosis.kernelscan`); the #48590 verdict then rests on their SASS.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import stat
import struct
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.version import Version

from patchkit.catalogue.load import Catalogue, Diagnosis, Patch, Variant
from patchkit.diagnosis.kernelscan import leaf_configs
from patchkit.engine import operations
from patchkit.engine.bytecode import bytecode_paths
from patchkit.engine.fsutil import read_json_file
from patchkit.errors import PatchkitError
from patchkit.target.caches import cache_dirs, cache_entries
from patchkit.target.tree import VllmTree


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
    tuned_configs: list[dict] = field(default_factory=list)  # every override check's findings
    overrides: dict[str, list[dict]] = field(default_factory=dict)  # the same, per patch id
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
            data = read_json_file(path)
        except (OSError, ValueError) as exc:
            found.append({"file": str(path), "problem": f"unreadable: {exc}"})
            continue
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            found.append({"file": str(path), "problem": "not a {max_loras: {num_slices: ...}}"})
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
                for c in leaf_configs(by_slices["1"])
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


OVERRIDE_CHECKS = {"tuned-lora-configs": tuned_configs}


def override_findings(catalogue: Catalogue) -> dict[str, list[dict]]:
    """For each patch with an ``[overridden_by]`` check: what its setting does here."""
    found = {}
    for patch in catalogue.patches:
        override = patch.overridden_by
        if override is not None and override.check in OVERRIDE_CHECKS:
            findings = OVERRIDE_CHECKS[override.check](os.environ.get(override.env))
            if findings:
                found[patch.id] = findings
    return found


def stale_bytecode(tree: VllmTree, relpaths: list[str]) -> list[str]:
    """.pyc files that do not match their source as Python would check them."""
    stale = []
    for relpath in relpaths:
        info = tree.fs.lstat(relpath, "doctor")
        if info is None or not stat.S_ISREG(info.st_mode):
            continue
        for pyc_relpath in bytecode_paths(tree.fs, relpath):
            pyc = tree.fs.full(pyc_relpath)
            try:
                header = (tree.fs.read(pyc_relpath, "doctor") or b"")[:16]
            except PatchkitError as exc:
                stale.append(f"{pyc} (unreadable: {exc})")
                continue
            if len(header) < 16:
                stale.append(f"{pyc} (truncated)")
                continue
            flags, mtime, size = struct.unpack("<4xIII", header)
            if flags & 1 and not flags & 2:
                stale.append(f"{pyc} (hash-based, unchecked: never re-validated)")
            elif flags & 1:
                source_hash = importlib.util.source_hash(tree.fs.read(relpath, "doctor") or b"")
                if header[8:16] != source_hash:
                    stale.append(f"{pyc} (hash differs from source)")
            elif mtime != int(info.st_mtime) & 0xFFFFFFFF or size != info.st_size & 0xFFFFFFFF:
                stale.append(f"{pyc} (built from another version of the source)")
    return stale


def old_caches(patched_at: float | None) -> list[dict]:
    """Compile-cache entries written before the patched files were."""
    if patched_at is None:
        return []
    found = []
    for cache in cache_dirs():
        older = [name for name, mtime in cache_entries(cache) if mtime < patched_at]
        if older:
            found.append({"name": cache.name, "path": str(cache.path), "entries": len(older)})
    return found


# ----- verdicts -----


def verdicts(report: DoctorReport, version: Version | None, catalogue: Catalogue) -> list[Verdict]:
    """One verdict per bug that the catalogue's patches declare, then the stale-code check."""
    states = {p["id"]: p["state"] for p in report.patches}
    found = [bug_verdict(report, version, states, group) for group in bug_groups(catalogue)]
    found.append(_stale_verdict(report))
    if "error" in report.vllm:  # no vLLM tree: nothing to judge a bug of vLLM by
        return [Verdict(v.bug, "unknown", "no vLLM found to judge by") for v in found]
    return found


def bug_groups(catalogue: Catalogue) -> list[list[Patch]]:
    """The patches of each declared bug, in series order; bugs in order of first mention."""
    groups: dict[tuple[str, ...], list[Patch]] = {}
    for patch in catalogue.patches:
        if patch.diagnosis is not None:
            groups.setdefault(patch.diagnosis.bugs, []).append(patch)
    return list(groups.values())


def bug_verdict(
    report: DoctorReport, version: Version | None, states: dict, patches: list[Patch]
) -> Verdict:
    """Judge one bug from its patches' declared diagnosis and this machine's facts."""
    d = patches[0].diagnosis
    if version is None:
        return Verdict(d.label, "unknown", "no vLLM version to judge by")
    if not d.affected.contains(version, prereleases=True):
        return Verdict(d.label, "not affected", f"vLLM {version} is not in {d.affected}")
    unaffected = _machine_unaffected(report, d)
    if unaffected:
        return Verdict(d.label, "not affected", unaffected)
    if d.kernel_scan and report.kernels and not report.kernels.get("error"):
        return _scan_verdict(d, report, states, patches)
    upstream = [p.id for p in patches if states.get(p.id) == "upstream"]
    if upstream:
        return Verdict(d.label, "not affected", f"fixed in this vLLM ({upstream[0]}: upstream)")
    off, overridden, active = [], [], []
    for patch in (p for p in patches if states.get(p.id) == "applied"):
        disabled, replaced = _disabled(patch), _overridden(report, patch)
        if disabled:
            off.append(disabled)
        elif replaced:
            overridden.append(replaced)
        else:
            active.append(patch.diagnosis.protects)
    if active:
        return Verdict(d.label, "protected", "; ".join(active))
    if overridden:
        return Verdict(d.label, "exposed", overridden[0][0], overridden[0][1])
    conflicts = [p.id for p in patches if states.get(p.id) == "conflict"]
    why = f"{', '.join(conflicts)} in conflict" if conflicts else "no patch for it is applied"
    return Verdict(d.label, "exposed", "; ".join([why, *off]), d.fix)


def _machine_unaffected(report: DoctorReport, d: Diagnosis) -> str:
    """Why this machine cannot hit the bug (its GPUs, its ptxas); '' if it can."""
    cc = d.needs_compute_capability
    if cc and report.gpus and not any(g["compute_capability"] == cc for g in report.gpus):
        return f"no GPU of compute capability {cc} here"
    ptxas = report.triton.get("ptxas_version")
    if d.fixed_by_ptxas and _at_least(ptxas, d.fixed_by_ptxas):
        return f"Triton's ptxas {ptxas} is {d.fixed_by_ptxas} or newer"
    return ""


def _disabled(patch: Patch) -> str:
    """Why an applied patch's protection is switched off by its runtime settings; '' if not."""
    offs = _switched_off(patch)
    return f"{patch.id} is off ({', '.join(f'{s.env}={v}' for s, v in offs)})" if offs else ""


def _switched_off(patch: Patch) -> list:
    """(switch, value) for each of the patch's settings that turns it off here."""
    found = [(s, s.turned_off(os.environ)) for s in patch.diagnosis.disabled_by]
    return [(s, value) for s, value in found if value]


def _overridden(report: DoctorReport, patch: Patch) -> tuple[str, str] | None:
    """(reason, fix) when a setting replaces the patched code path, per the patch's check."""
    override = patch.overridden_by
    if override is None or override.check not in OVERRIDE_CHECKS:
        return None
    found = report.overrides.get(patch.id, [])
    if not found:
        return None
    return (
        f"{override.env} replaces what {patch.id} patched: {found[0]['problem']}",
        f"fix or remove the {override.env} files listed above",
    )


def _at_least(version: str | None, threshold: str) -> bool:
    try:
        have = tuple(int(p) for p in (version or "").split(".")[:2])
        return have >= tuple(int(p) for p in threshold.split(".")[:2])
    except ValueError:
        return False


def _scan_verdict(
    d: Diagnosis, report: DoctorReport, states: dict, patches: list[Patch]
) -> Verdict:
    """The bug judged by the compiled kernels: a hazard this install runs, or none."""
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
            d.label,
            "exposed",
            f"kernel scan: {len(called)} config(s) this install runs overwrite the A registers "
            f"of an in-flight wgmma, e.g. {first['label']}: {where['instruction']} at "
            f"{where['address']} (HGMMA at {where['wgmma']}); {ptxas}",
            _scan_fix(first, d, states, patches),
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
        return Verdict(d.label, "protected", f"kernel scan: {reason}{also}")
    evidence = f"kernel scan: no overwrite in the {runs} config(s) this install runs, {ptxas}"
    if d.fixed_by_ptxas and _at_least(scan["ptxas_version"], d.fixed_by_ptxas):
        evidence += f" (a ptxas from {d.fixed_by_ptxas} on keeps wgmma registers)"
    patched = any(states.get(p.id) == "applied" for p in patches)
    status = "protected" if patched else "not affected"
    return Verdict(d.label, "unknown" if errors else status, evidence + also + unknown)


def _scan_fix(case: dict, d: Diagnosis, states: dict, patches: list[Patch]) -> str:
    if case["source"].startswith("tuned"):
        return f"remove or retune {case['source'][len('tuned: ') :]} (block_n 32 or num_stages 1)"
    overrides = [p.overridden_by.env for p in patches if p.overridden_by]
    if any(os.environ.get(env) for env in overrides):
        return f"the config comes from {overrides[0]}: retune it (block_n 32 or 1 stage)"
    if any(states.get(p.id) == "needed" for p in patches):
        return d.fix
    switches = [f"{s.env} unset ({p.id})" for p in patches for s, _ in _switched_off(p)]
    ptxas = (
        f"TRITON_PTXAS_PATH pointing at a ptxas >= {d.fixed_by_ptxas}" if d.fixed_by_ptxas else ""
    )
    return ", or ".join(filter(None, [*switches, ptxas])) or d.fix


def called_here(states: dict, catalogue: Catalogue):
    """Which scanned kernel configs this install runs, from its patches and environment."""
    from patchkit.diagnosis.kernelscan import path_runs

    replacing = [
        p for p in catalogue.patches
        if p.diagnosis and p.diagnosis.replaces_kernels and states.get(p.id) == "applied"
        and not _disabled(p)
    ]  # fmt: skip

    def called(case) -> tuple[bool, str]:
        if replacing:
            return False, replacing[0].diagnosis.protects
        return path_runs(case.path)

    return called


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
    report.triton["fixed_from"] = next(
        (p.diagnosis.fixed_by_ptxas for p in catalogue.patches
         if p.diagnosis and p.diagnosis.fixed_by_ptxas), None,
    )  # fmt: skip
    report.overrides = override_findings(catalogue)
    report.tuned_configs = [f for found in report.overrides.values() for f in found]
    if tree is None:
        report.vllm = {"error": tree_error}
        report.verdicts = verdicts(report, None, catalogue)
        return report
    report.vllm = tree.describe()
    status = operations.status(tree, catalogue)
    report.patches = [
        {k: s.assessment.to_json()[k] for k in ("id", "state", "variant", "files")}
        for s in status.steps
    ]
    relpaths = sorted({path for p in catalogue.patches for path in _paths(p, tree)})
    report.stale_bytecode = stale_bytecode(tree, relpaths)
    applied = [f for p in report.patches if p["state"] == "applied" for f in p["files"]]
    infos = [tree.fs.lstat(f, "doctor") for f in applied]
    mtimes = [info.st_mtime for info in infos if info is not None]
    report.old_caches = old_caches(max(mtimes) if mtimes else None)
    if kernels:
        report.kernels = scan_kernels(tree, report, catalogue)
    report.verdicts = verdicts(report, tree.parsed_version, catalogue)
    return report


def scan_kernels(tree: VllmTree, report: DoctorReport, catalogue: Catalogue) -> dict:
    """Run the --kernels scan for this tree, as this machine's GPU (or an H200) would."""
    from patchkit.diagnosis import kernelscan

    states = {p["id"]: p["state"] for p in report.patches}
    hopper = [g["name"] for g in report.gpus if g["compute_capability"] == "9.0"]
    called = called_here(states, catalogue)
    result = kernelscan.scan(tree, hopper[0] if hopper else "NVIDIA H200", called)
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
        f"Triton {t.get('version') or 'not installed'}; ptxas for sm_90: {ptxas}{where}"
        + (f"; fixed from {t['fixed_from']}" if t.get("fixed_from") else "")
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
