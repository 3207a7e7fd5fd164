"""`patchkit doctor`: what in this environment exposes or protects it, without a GPU run.

Reads files and runs `nvidia-smi` and Triton's `ptxas --version`; imports
neither vLLM nor torch nor Triton, so it works in image builds and on
machines without GPUs. Ends with a verdict per known bug. ``--kernels``
also runs the kernel scan (:mod:`patchkit.doctor.kernelscan`, which
imports torch and Triton); the #48590 verdict then rests on its SASS,
provided the scan compiled with the Triton that vLLM here runs.

The report stays objects (assessments, the scan's cases, str-enum
verdicts) until the CLI prints it or turns it into JSON.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from patchkit.caches.compiled import TRITON_CACHE, cache_dirs, cache_entries
from patchkit.catalogue.model import Catalogue, Diagnosis, Patch, Variant, range_text
from patchkit.codes import Code, Reason
from patchkit.doctor import configs, kernelscan
from patchkit.doctor.kernelscan import Case, ScanReport
from patchkit.doctor.standins import GPUS, gpu_named
from patchkit.doctor.toolchain import (
    Toolchain,
    TreeTriton,
    same_triton,
    toolchain,
    tree_triton,
)
from patchkit.errors import PatchkitError
from patchkit.fs.files import read_json_file, write_cache_file
from patchkit.patching import operations
from patchkit.patching.bytecode import bytecode_paths
from patchkit.patching.decide import Assessment, apply_command
from patchkit.vllmtree import model_runner
from patchkit.vllmtree.model_runner import RunnerChoice
from patchkit.vllmtree.tree import VllmTree
from patchkit.vocabulary import PatchState, Verdict

HOPPER = "9.0"


@dataclass(frozen=True)
class DetectedGpu:
    """A GPU nvidia-smi reports (the scan's model of one is patchkit.doctor.standins.Gpu)."""

    name: str
    compute_capability: str


@dataclass(frozen=True)
class OverrideFinding:
    """A tuned-config file that changes what a patch protects."""

    file: str
    problem: Reason


@dataclass(frozen=True)
class OldCache:
    name: str
    path: str
    entries: int


@dataclass(frozen=True)
class BugVerdict:
    """A bug's verdict here: why, as a reason, and the fix (a reason too), or None."""

    bug: str
    status: Verdict
    reason: Reason
    fix: Reason | None = None


@dataclass
class DoctorReport:
    gpus: list[DetectedGpu] = field(default_factory=list)
    gpu_note: Reason | None = None
    toolchain: Toolchain = field(default_factory=Toolchain)
    fixed_from: str | None = None  # the ptxas release that fixes the race
    tree_triton: TreeTriton | None = None  # the Triton installed next to the tree
    tree: VllmTree | None = None
    tree_error: Reason | None = None  # why there is no tree: the error locating it
    patches: list[Assessment] = field(default_factory=list)
    # every override check's findings, and the same per patch id
    tuned_configs: list[OverrideFinding] = field(default_factory=list)
    overrides: dict[str, list[OverrideFinding]] = field(default_factory=dict)
    stale_bytecode: list[Reason] = field(default_factory=list)  # pyc-*
    old_caches: list[OldCache] = field(default_factory=list)
    kernels: ScanReport | None = None  # the --kernels scan, when asked for
    verdicts: list[BugVerdict] = field(default_factory=list)
    runner: RunnerChoice | None = None  # the GPU model runner vLLM picks for the tree

    def states(self) -> dict[str, PatchState]:
        return {a.patch.id: PatchState(a.state) for a in self.patches}

    def vllm_ptxas(self) -> str | None:
        """The version of the ptxas vLLM's Triton compiles with, as far as files tell."""
        theirs = self.tree_triton
        if theirs and theirs.version and not os.environ.get("TRITON_PTXAS_PATH"):
            return theirs.ptxas_version
        return self.toolchain.ptxas_version


# ----- facts -----


def gpus() -> tuple[list[DetectedGpu], Reason | None]:
    """Name and compute capability of each GPU nvidia-smi shows, or why none is known."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], Reason.of(Code.NO_NVIDIA_SMI)
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [], Reason.of(Code.NVIDIA_SMI_FAILED, detail=str(exc))
    found = []
    for line in out.strip().splitlines():
        name, _, capability = line.rpartition(",")
        found.append(DetectedGpu(name.strip(), capability.strip()))
    return found, None if found else Reason.of(Code.NO_GPU_LISTED)


def tuned_configs(folder: str | None) -> list[OverrideFinding]:
    """Expand config files in VLLM_TUNED_CONFIG_FOLDER that matter for num_slices=1."""
    if not folder:
        return []
    found = []
    for path in sorted(Path(folder).glob("*_EXPAND_*.json")):
        try:
            data = read_json_file(path)
        except (OSError, ValueError) as exc:
            found.append(
                OverrideFinding(str(path), Reason.of(Code.TUNED_UNREADABLE, detail=str(exc)))
            )
            continue
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            found.append(OverrideFinding(str(path), Reason.of(Code.TUNED_NOT_NESTED)))
            continue
        for max_loras, by_slices in data.items():
            found += _risky_leaves(path, max_loras, by_slices)
    return found


def _risky_leaves(path: Path, max_loras: str, by_slices: dict) -> list[OverrideFinding]:
    """The findings of one max_loras entry; a block_n or num_stages that is no number is
    one of its own (the file is the user's: a string there raised TypeError, exit 3)."""
    if "1" not in by_slices:
        problem = Reason.of(Code.TUNED_NO_SINGLE_SLICE, max_loras=max_loras)
        return [OverrideFinding(str(path), problem)]
    leaves = leaf_configs(by_slices["1"])
    compared = ("block_n", "num_stages")
    if not all(isinstance(c.get(k, 0), (int, float)) for c in leaves for k in compared):
        detail = (
            f"max_loras {max_loras}: a num_slices=1 config's block_n or num_stages is no number"
        )
        return [OverrideFinding(str(path), Reason.of(Code.TUNED_UNREADABLE, detail=detail))]
    risky = [c for c in leaves if c.get("block_n", 0) > 32 and c.get("num_stages", 2) >= 2]
    if not risky:
        return []
    problem = Reason.of(Code.TUNED_REPLACES_BLOCK_N, max_loras=max_loras, configs=len(risky))
    return [OverrideFinding(str(path), problem)]


def leaf_configs(node) -> list[dict]:
    """The kernel configs (dicts with a block_n) anywhere below ``node``."""
    if isinstance(node, dict) and "block_n" in node:
        return [node]
    if isinstance(node, dict):
        return [leaf for child in node.values() for leaf in leaf_configs(child)]
    return []


OVERRIDE_CHECKS = {"tuned-lora-configs": tuned_configs}


def override_findings(catalogue: Catalogue) -> dict[str, list[OverrideFinding]]:
    """For each patch with an ``[overridden_by]`` check: what its setting does here."""
    found = {}
    for patch in catalogue.patches:
        override = patch.overridden_by
        if override is not None and override.check in OVERRIDE_CHECKS:
            findings = OVERRIDE_CHECKS[override.check](os.environ.get(override.env))
            if findings:
                found[patch.id] = findings
    return found


def stale_bytecode(tree: VllmTree, relpaths: list[str]) -> list[Reason]:
    """.pyc files that do not match their source as Python would check them: each a
    reason (``pyc-*``) naming the .pyc and what is wrong with it."""
    stale = []
    for relpath in relpaths:
        info = tree.fs.lstat(relpath, "doctor")
        if info is None or not stat.S_ISREG(info.st_mode):
            continue
        for pyc_relpath in bytecode_paths(tree.fs, relpath):
            problem = _pyc_problem(tree, relpath, pyc_relpath, info)
            if problem:
                code, facts = problem
                path, source = tree.fs.full(pyc_relpath), tree.fs.full(relpath)
                stale.append(Reason.of(code, path=str(path), source=str(source), **facts))
    return stale


def _pyc_problem(tree: VllmTree, relpath: str, pyc_relpath: str, info) -> tuple | None:
    """Why a .pyc does not match its source, its code and facts; None if it does."""
    try:
        header = (tree.fs.read(pyc_relpath, "doctor") or b"")[:16]
    except PatchkitError as exc:
        return Code.PYC_UNREADABLE, {"error": str(exc)}
    if len(header) < 16:
        return Code.PYC_TRUNCATED, {}
    flags, mtime, size = struct.unpack("<4xIII", header)
    if flags & 1 and not flags & 2:
        return Code.PYC_UNCHECKED_HASH, {}
    if flags & 1:
        source_hash = importlib.util.source_hash(tree.fs.read(relpath, "doctor") or b"")
        return (Code.PYC_HASH_DIFFERS, {}) if header[8:16] != source_hash else None
    if mtime != int(info.st_mtime) & 0xFFFFFFFF or size != info.st_size & 0xFFFFFFFF:
        return Code.PYC_OTHER_SOURCE, {}
    return None


def old_caches(patched_at: float | None) -> list[OldCache]:
    """Compile-cache entries written before the patched files were, except those doctor's
    own kernel scan wrote (:func:`scan_entries`)."""
    if patched_at is None:
        return []
    ours = recorded_scan_entries()
    found = []
    for cache in cache_dirs():
        scanned = ours.get(str(cache.path), {})
        older = [
            name
            for name, mtime in cache_entries(cache)
            if mtime < patched_at and scanned.get(name) != mtime
        ]
        if older:
            found.append(OldCache(cache.name, str(cache.path), len(older)))
    return found


# ----- the Triton cache entries doctor's own kernel scan writes -----
#
# `doctor --kernels` compiles vLLM's LoRA kernels with Triton to read their
# SASS, and Triton keeps what it compiles in its cache. Such an entry is not
# stale code: Triton finds an entry by a hash of the kernel's source, its
# constants and the compile options, so after a patch vLLM reaches one only
# for a kernel and config the patch left as they were, where it is what a
# fresh compile gives. The scan names the entries it added (listed before and
# after, so a vLLM compiling into the same cache meanwhile counts as the
# scan's) in patchkit's cache; an entry still as the scan left it (same name,
# same mtime) is not counted as older than the patch.

SCAN_ENTRIES_FORMAT = 1
MAX_SCAN_ENTRIES = 5_000  # a scan writes a few hundred; the record stays under 1 MiB


def scan_entries_file() -> Path:
    from patchkit.fs.places import cache_root

    return cache_root() / "kernel-scan" / "doctor-cache-entries.json"


def recorded_scan_entries() -> dict[str, dict[str, float]]:
    """{cache path: {entry name: mtime}} of the entries earlier scans wrote; {} if none."""
    try:
        data = read_json_file(scan_entries_file())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != SCAN_ENTRIES_FORMAT:
        return {}
    caches = data.get("caches")
    if not isinstance(caches, dict):
        return {}
    return {
        path: {n: m for n, m in entries.items() if isinstance(m, float)}
        for path, entries in caches.items()
        if isinstance(entries, dict)
    }


def cache_snapshot() -> dict[str, dict[str, float]]:
    """{cache path: {entry name: mtime}} of Triton's cache now (the one the scan writes)."""
    return {
        str(c.path): dict(cache_entries(c))
        for c in cache_dirs()
        if c.name == TRITON_CACHE and c.path is not None
    }


def remember_scan_entries(before: dict[str, dict[str, float]]) -> None:
    """Add the entries that appeared since ``before`` to the record (entries gone are dropped)."""
    after = cache_snapshot()
    record = recorded_scan_entries()
    for path, entries in after.items():
        kept = {n: m for n, m in record.get(path, {}).items() if entries.get(n) == m}
        added = {n: m for n, m in entries.items() if n not in before.get(path, {})}
        merged = {**kept, **added}
        if merged:
            record[path] = dict(list(merged.items())[-MAX_SCAN_ENTRIES:])
    data = {"format": SCAN_ENTRIES_FORMAT, "caches": record}
    try:
        write_cache_file(scan_entries_file(), json.dumps(data).encode())
    except OSError:
        pass  # unwritable: the entries are counted as older than the patch, as before


# ----- verdicts -----


def verdicts(
    report: DoctorReport, version: Version | None, catalogue: Catalogue
) -> list[BugVerdict]:
    """One verdict per bug that the catalogue's patches declare, then the stale-code check."""
    states = report.states()
    undecided = "" if catalogue.is_tested(version) else catalogue.newest_tested
    found = [
        bug_verdict(report, version, states, group, undecided) for group in bug_groups(catalogue)
    ]
    found.append(_stale_verdict(report))
    if report.tree is None:  # no vLLM tree: nothing to judge a bug of vLLM by
        no_tree = Reason.of(Code.VERDICT_NO_TREE)
        return [BugVerdict(v.bug, Verdict.UNKNOWN, no_tree) for v in found]
    return found


def bug_groups(catalogue: Catalogue) -> list[list[Patch]]:
    """The patches of each declared bug, in series order; bugs in order of first mention."""
    groups: dict[tuple[str, ...], list[Patch]] = {}
    for patch in catalogue.patches:
        if patch.diagnosis is not None:
            groups.setdefault(patch.diagnosis.bugs, []).append(patch)
    return list(groups.values())


def bug_verdict(
    report: DoctorReport,
    version: Version | None,
    states: dict[str, PatchState],
    patches: list[Patch],
    undecided: str = "",
) -> BugVerdict:
    """Judge one bug from its patches' declared diagnosis and this machine's facts.

    ``undecided``: the release is not one the catalogue decided (the newest it did). The
    bug's range says nothing about it then; only content does (a patch found upstream or
    not applicable by its evidence, or applied), or this machine's facts; otherwise the
    verdict is unknown, never exposed or not affected by a range.
    """
    d = patches[0].diagnosis
    if version is None:
        return BugVerdict(d.label, Verdict.UNKNOWN, Reason.of(Code.VERDICT_NO_VERSION))
    if undecided and not _decided_by_content(states, patches):
        return _machine_verdict(report, d) or _undecided_verdict(
            report, d, version, states, patches, undecided
        )
    if not d.affected.contains(version, prereleases=True):
        reason = Reason.of(
            Code.VERDICT_OUT_OF_RANGE, version=str(version), affected=range_text(d.affected)
        )
        return BugVerdict(d.label, Verdict.NOT_AFFECTED, reason)
    unaffected = _machine_unaffected(report, d)
    if unaffected:
        return BugVerdict(d.label, Verdict.NOT_AFFECTED, unaffected)
    scan = report.kernels
    if d.kernel_scan and scan is not None and not scan.error:
        mismatch = triton_mismatch(report)
        if not mismatch:
            return _scan_verdict(d, report, states, patches)
        judged = _rule_verdict(d, report, states, patches)
        return dataclasses.replace(judged, reason=_also(judged.reason, mismatch))
    return _rule_verdict(d, report, states, patches)


def _also(reason: Reason, *more: Reason) -> Reason:
    """``reason`` with ``more`` added to what it says after itself (its ``also``)."""
    return Reason.of(
        reason.code, **{**dict(reason.facts), "also": [*reason.get("also", ()), *more]}
    )


CONTENT_DECIDED = (PatchState.UPSTREAM, PatchState.NOT_APPLICABLE, PatchState.APPLIED)


def _decided_by_content(states: dict[str, PatchState], patches: list[Patch]) -> bool:
    """Whether a patch of the bug is upstream or not applicable by its evidence on this
    tree, or applied: facts of the tree, whatever its release."""
    return any(states.get(p.id) in CONTENT_DECIDED for p in patches)


def _machine_verdict(report: DoctorReport, d: Diagnosis) -> BugVerdict | None:
    unaffected = _machine_unaffected(report, d)
    return BugVerdict(d.label, Verdict.NOT_AFFECTED, unaffected) if unaffected else None


def _undecided_verdict(
    report: DoctorReport,
    d: Diagnosis,
    version: Version,
    states: dict[str, PatchState],
    patches: list[Patch],
    newest: str,
) -> BugVerdict:
    """Unknown on a release the catalogue has not decided: what is known, and the command
    that applies a patch still fitting its code (apply --only where plain apply refuses)."""
    fitting = [p for p in patches if states.get(p.id) == PatchState.NEEDED]
    if not fitting:
        moved = [p.id for p in patches if states.get(p.id) == PatchState.CHANGED_UPSTREAM]
        also = [Reason.of(Code.PATCH_MOVED, patch=moved[0])] if moved else []
        reason = Reason.of(Code.VERDICT_UNDECIDED, version=str(version), newest=newest, also=also)
        return BugVerdict(d.label, Verdict.UNKNOWN, reason)
    also = [Reason.of(Code.PATCH_FITS, patch=fitting[0].id)]
    reason = Reason.of(Code.VERDICT_UNDECIDED, version=str(version), newest=newest, also=also)
    fix = apply_command(states, _opt_in(report), fitting[0].id) + _target(report)
    return BugVerdict(d.label, Verdict.UNKNOWN, reason, Reason.of(Code.FIX_COMMAND, command=fix))


def _opt_in(report: DoctorReport) -> set[str]:
    return {a.patch.id for a in report.patches if a.patch.opt_in}


def _rule_verdict(
    d: Diagnosis, report: DoctorReport, states: dict[str, PatchState], patches: list[Patch]
) -> BugVerdict:
    """The bug judged by patch states and settings (no kernel evidence)."""
    upstream = [p.id for p in patches if states.get(p.id) == PatchState.UPSTREAM]
    if upstream:
        reason = Reason.of(Code.VERDICT_UPSTREAM, patch=upstream[0])
        return BugVerdict(d.label, Verdict.NOT_AFFECTED, reason)
    off, overridden, active = [], [], []
    for patch in (p for p in patches if states.get(p.id) == PatchState.APPLIED):
        disabled, replaced = _disabled(patch), _overridden(report, patch)
        if disabled:
            off.append(disabled)
        elif replaced:
            overridden.append(replaced)
        else:
            active.append(patch.diagnosis.protects)
    if active:
        return BugVerdict(
            d.label, Verdict.PROTECTED, Reason.of(Code.VERDICT_PROTECTED, lines=active)
        )
    if overridden:
        return BugVerdict(d.label, Verdict.EXPOSED, overridden[0][0], overridden[0][1])
    conflicts = [p.id for p in patches if states.get(p.id) == PatchState.CONFLICT]
    why = (
        Reason.of(Code.VERDICT_IN_CONFLICT, patches=conflicts, also=off)
        if conflicts
        else Reason.of(Code.VERDICT_NOT_APPLIED, also=off)
    )
    return BugVerdict(d.label, Verdict.EXPOSED, why, _fix(d, report, states, patches))


def _fix(
    d: Diagnosis, report: DoctorReport, states: dict[str, PatchState], patches: list[Patch]
) -> Reason:
    """The bug's fix (`patchkit apply --target T`), unless its patches here are in conflict,
    which apply refuses: then how to see why."""
    conflicts = [p.id for p in patches if states.get(p.id) == PatchState.CONFLICT]
    needed = [p.id for p in patches if states.get(p.id) == PatchState.NEEDED]
    if conflicts and not needed:
        return Reason.of(
            Code.FIX_AFTER_CONFLICT,
            patches=conflicts,
            status=f"patchkit status{_target(report)}",
            command=_with_target(d.fix, report),
        )
    if needed and d.fix == "patchkit apply":  # the apply that runs on this tree
        command = apply_command(states, _opt_in(report), needed[0]) + _target(report)
        return Reason.of(Code.FIX_COMMAND, command=command)
    return Reason.of(Code.FIX_COMMAND, command=_with_target(d.fix, report))


def triton_mismatch(report: DoctorReport) -> Reason | None:
    """Why the scan's evidence is not about the Triton vLLM runs here; None when it is."""
    ours, theirs = report.toolchain, report.tree_triton
    if theirs is None or theirs.version is None or same_triton(ours, theirs):
        return None
    target = f" --target {shlex.quote(str(report.tree.root))}" if report.tree else ""
    return Reason.of(
        Code.SCAN_OTHER_TRITON,
        triton=ours.triton,
        location=ours.location,
        vllm_triton=theirs.version,
        vllm_triton_location=theirs.location,
        python=theirs.python,
        command=f"-m patchkit doctor --kernels{target}",
    )


def _machine_unaffected(report: DoctorReport, d: Diagnosis) -> Reason | None:
    """Why this machine cannot hit the bug (its GPUs, its ptxas); None if it can."""
    cc = d.needs_compute_capability
    if cc and report.gpus and not any(g.compute_capability == cc for g in report.gpus):
        return Reason.of(Code.VERDICT_NO_GPU, compute_capability=cc)
    ptxas = report.vllm_ptxas()
    if d.fixed_by_ptxas and _at_least(ptxas, d.fixed_by_ptxas):
        return Reason.of(Code.VERDICT_PTXAS_FIXED, ptxas=ptxas, fixed_by=d.fixed_by_ptxas)
    return None


def _disabled(patch: Patch) -> Reason | None:
    """Why an applied patch's protection is switched off by its runtime settings; None if not."""
    offs = _switched_off(patch)
    if not offs:
        return None
    settings = [f"{s.env}={v}" for s, v in offs]
    return Reason.of(Code.PATCH_SWITCHED_OFF, patch=patch.id, settings=settings)


def _switched_off(patch: Patch) -> list:
    """(switch, value) for each of the patch's settings that turns it off here."""
    found = [(s, s.turned_off(os.environ)) for s in patch.diagnosis.disabled_by]
    return [(s, value) for s, value in found if value]


def _overridden(report: DoctorReport, patch: Patch) -> tuple[Reason, Reason] | None:
    """(reason, fix) when a setting replaces the patched code path, per the patch's check."""
    override = patch.overridden_by
    if override is None or override.check not in OVERRIDE_CHECKS:
        return None
    found = report.overrides.get(patch.id, [])
    if not found:
        return None
    return (
        Reason.of(
            Code.VERDICT_OVERRIDDEN, env=override.env, patch=patch.id, problem=found[0].problem
        ),
        Reason.of(Code.FIX_OVERRIDE_FILES, env=override.env),
    )


def _at_least(version: str | None, threshold: str) -> bool:
    """Whether ``version``'s major.minor is ``threshold``'s or later (ptxas: '12.8.93');
    False when it is unknown or not a version."""
    try:
        return Version(version or "").release[:2] >= Version(threshold).release[:2]
    except InvalidVersion:
        return False


def _scan_verdict(
    d: Diagnosis, report: DoctorReport, states: dict[str, PatchState], patches: list[Patch]
) -> BugVerdict:
    """The bug judged by the compiled kernels: a hazard this install runs, or none."""
    scan = report.kernels
    tools = scan.toolchain
    compiler = {
        "triton": tools.triton,
        "ptxas_version": tools.ptxas_version,
        "ptxas": tools.ptxas,
        "no_vllm_triton": report.tree_triton is not None and report.tree_triton.version is None,
    }
    runs = [c for c in scan.cases if c.called]
    hazards = [c for c in runs if c.verdict == "hazard"]
    if hazards:
        tuned = [c for c in hazards if c.sources]
        first = (tuned or hazards)[0]
        where = first.hazards[0]
        reason = Reason.of(
            Code.SCAN_HAZARD,
            configs=len(hazards),
            label=first.label(),
            instruction=where.instruction,
            address=where.address,
            wgmma_address=where.wgmma_address,
            **compiler,
        )
        fix = _scan_fix(first, d, report, patches)
        return BugVerdict(d.label, Verdict.EXPOSED, reason, fix)
    idle = [c for c in scan.cases if not c.called and c.verdict == "hazard"]
    also = [
        Reason.of(Code.SCAN_IDLE_HAZARD, label=c.label(), why=c.why_not_called) for c in idle[:1]
    ]
    if not runs:
        why = next((c.why_not_called for c in scan.cases), None)
        return BugVerdict(
            d.label, Verdict.PROTECTED, Reason.of(Code.SCAN_NONE_RUN, why=why, also=also)
        )
    errors = [c for c in runs if c.verdict == "error"]
    if errors:
        also.append(Reason.of(Code.SCAN_ERRORS, configs=len(errors)))
    approximate = [c for c in runs if c.approximate]
    evidence = Reason.of(
        Code.SCAN_CLEAN,
        configs=len(runs),
        **compiler,
        approximate=len(approximate),
        approximate_why=approximate[0].approximate if approximate else None,
        ptxas_keeps_from=(
            d.fixed_by_ptxas
            if d.fixed_by_ptxas and _at_least(tools.ptxas_version, d.fixed_by_ptxas)
            else None
        ),
        replaced_by=_replacing_reason(states, patches) or None,
        also=also,
    )
    patched = any(states.get(p.id) == PatchState.APPLIED for p in patches)
    status = Verdict.PROTECTED if patched else Verdict.NOT_AFFECTED
    return BugVerdict(d.label, Verdict.UNKNOWN if errors else status, evidence)


def _scan_fix(case: Case, d: Diagnosis, report: DoctorReport, patches: list[Patch]) -> Reason:
    states = report.states()
    if case.sources:
        return Reason.of(Code.FIX_RETUNE, file=Path(case.sources[0]).name)
    if any(states.get(p.id) == PatchState.NEEDED for p in patches):
        return _fix(d, report, states, patches)
    switches = [(s.env, p.id) for p in patches for s, _ in _switched_off(p)]
    if not switches and not d.fixed_by_ptxas:
        return _fix(d, report, states, patches)
    return Reason.of(
        Code.FIX_SWITCHES,
        unset=[env for env, _ in switches],
        patches=[patch for _, patch in switches],
        ptxas_from=d.fixed_by_ptxas,
    )


def _replacing_reason(states: dict[str, PatchState], patches: list[Patch]) -> str:
    """The ``protects`` line of an applied, switched-on patch that replaces the dense kernels."""
    for patch in patches:
        diagnosis = patch.diagnosis
        applied = states.get(patch.id) == PatchState.APPLIED
        if diagnosis and diagnosis.replaces_kernels and applied and not _disabled(patch):
            return diagnosis.protects
    return ""


def replaced_here(states: dict[str, PatchState], catalogue: Catalogue) -> str:
    """Why vLLM's dense LoRA kernels do not run here (a patch replaces them), or ''."""
    return _replacing_reason(states, list(catalogue.patches))


def _stale_verdict(report: DoctorReport) -> BugVerdict:
    bug = "stale bytecode or compile caches running unpatched code"
    if report.stale_bytecode or report.old_caches:
        reason = Reason.of(
            Code.VERDICT_STALE, pyc=len(report.stale_bytecode), caches=len(report.old_caches)
        )
        return BugVerdict(bug, Verdict.EXPOSED, reason, _stale_fix(report))
    return BugVerdict(bug, Verdict.NOT_AFFECTED, Reason.of(Code.VERDICT_FRESH))


def _stale_fix(report: DoctorReport) -> Reason:
    """The least that fixes it. `apply --clear-caches` clears the caches on a patched tree
    without touching it (no revert); it rewrites no file, so it removes no bytecode: the
    stale .pyc files are deleted by hand (Python rebuilds them from the source)."""
    command = None
    if report.old_caches:
        command = f"{_apply_command(report)} --clear-caches{_target(report)}"
    return Reason.of(Code.FIX_STALE, pyc=bool(report.stale_bytecode), command=command)


def _apply_command(report: DoctorReport) -> str:
    """`patchkit apply`, limited to the applied patches when another is in conflict (a
    plain apply refuses to run then, and would clear nothing)."""
    states = report.states()
    if not any(state == PatchState.CONFLICT for state in states.values()):
        return "patchkit apply"
    applied = [i for i, state in states.items() if state == PatchState.APPLIED]
    return "patchkit apply" + "".join(f" --only {i}" for i in applied)


def _target(report: DoctorReport) -> str:
    """`` --target T`` for a command doctor suggests: the tree it looked at, whether the user
    named it or patchkit found it (a command without it may patch another vLLM)."""
    return f" --target {shlex.quote(str(report.tree.root))}" if report.tree else ""


def _with_target(fix: str, report: DoctorReport) -> str:
    """A catalogue's fix with ``--target`` added to each patchkit command in it."""
    commands = fix.split(" && ")
    if not all(c.startswith("patchkit ") for c in commands):
        return fix
    return " && ".join(c + _target(report) for c in commands)


# ----- the whole report -----


@dataclass(frozen=True)
class ScanRequest:
    """What ``--kernels`` scans: a model's shapes (``--model``/``--adapter``) or the defaults."""

    model: Path | None = None
    adapters: tuple[Path, ...] = ()

    def models(self) -> list[configs.Model]:
        if self.model is not None:
            return [configs.model_from_dir(self.model, self.adapters)]
        if self.adapters:
            ranks = tuple(sorted({r for a in self.adapters for r in configs.adapter_ranks(a)}))
            return [dataclasses.replace(m, ranks=ranks) for m in configs.DEFAULT_MODELS]
        return list(configs.DEFAULT_MODELS)


def run(
    tree: VllmTree | None,
    tree_error: Reason | None,
    catalogue: Catalogue,
    kernels: ScanRequest | None = None,
) -> DoctorReport:
    report = DoctorReport(tree=tree, tree_error=tree_error)
    report.gpus, report.gpu_note = gpus()
    report.toolchain = toolchain()
    report.fixed_from = next(
        (
            p.diagnosis.fixed_by_ptxas
            for p in catalogue.patches
            if p.diagnosis and p.diagnosis.fixed_by_ptxas
        ),
        None,
    )
    report.overrides = override_findings(catalogue)
    report.tuned_configs = [f for found in report.overrides.values() for f in found]
    if tree is None:
        report.verdicts = verdicts(report, None, catalogue)
        return report
    report.tree_triton = tree_triton(tree.root)
    report.patches = [step.assessment for step in operations.status(tree, catalogue).steps]
    report.runner = model_runner.decide(tree.fs, os.environ.get(model_runner.ENV))
    relpaths = sorted({path for p in catalogue.patches for path in _paths(p, tree)})
    report.stale_bytecode = stale_bytecode(tree, relpaths)
    applied = [
        f for a in report.patches if PatchState(a.state) == PatchState.APPLIED for f in a.files
    ]
    infos = [tree.fs.lstat(f, "doctor") for f in applied]
    mtimes = [info.st_mtime for info in infos if info is not None]
    report.old_caches = old_caches(max(mtimes) if mtimes else None)
    if kernels is not None:
        before = cache_snapshot()
        report.kernels = scan_kernels(tree, report, catalogue, kernels)
        remember_scan_entries(before)
    report.verdicts = verdicts(report, tree.parsed_version, catalogue)
    return report


def scan_kernels(
    tree: VllmTree, report: DoctorReport, catalogue: Catalogue, request: ScanRequest
) -> ScanReport:
    """Run the --kernels scan for this tree, on this machine's Hopper GPUs (else H100/H200/H20)."""
    hopper = [gpu_named(g.name) for g in report.gpus if g.compute_capability == HOPPER]
    replaced = replaced_here(report.states(), catalogue)
    return kernelscan.scan(tree, hopper or GPUS, request.models(), os.environ, replaced)


def _paths(patch, tree: VllmTree) -> tuple[str, ...]:
    entry = patch.expected_for(tree.parsed_version)
    return entry.paths if isinstance(entry, Variant) else ()
