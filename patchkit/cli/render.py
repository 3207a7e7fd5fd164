"""Render reports for people (aligned text) and for machines (--json)."""

from __future__ import annotations

import json

import click

from patchkit.catalogue.load import Catalogue
from patchkit.engine.operations import RunReport

SOURCES = {
    "metadata": "dist-info metadata",
    "git": "git describe",
    "file": "vllm/_version.py",
    "override": "--vllm-version / PATCHKIT_VLLM_VERSION",
    "unknown": "not found",
}


def emit_json(data: dict) -> None:
    click.echo(json.dumps(data, indent=2))


def render_run(report: RunReport) -> None:
    tree = report.tree
    click.echo(f"vLLM {tree.version} at {tree.root} (version from {SOURCES[tree.source]})")
    for note in report.notes:
        click.echo(f"note: {note}")
    width = max((len(o.assessment.patch.id) for o in report.outcomes), default=0)
    for outcome in report.outcomes:
        a = outcome.assessment
        detail = a.reason or (f"variant {a.variant.name}" if a.variant else "")
        click.echo(f"  {a.patch.id:<{width}}  {outcome.action:<15}  {detail}")
        for place in a.placements if outcome.action in ("applied", "would-apply") else []:
            offset = f" (offset {place.offset:+d} lines)" if place.offset else ""
            click.echo(f"      {place.path}: hunk #{place.hunk} at line {place.line}{offset}")
    for pyc in report.bytecode_removed:
        click.echo(f"removed bytecode: {pyc}")
    for cache in report.caches_removed:
        if cache["state"] == "cleared":
            click.echo(
                f"cleared {cache['name']}: {cache['path']} "
                f"({cache['files']} files, {cache['bytes']} bytes)"
            )
        elif cache["state"] == "absent":
            click.echo(f"no {cache['name']} at {cache['path']}: nothing to clear")
        else:
            click.echo(f"left {cache['name']} alone: {cache['reason']}", err=True)
    if report.dry_run:
        click.echo("dry run: nothing was written")
    for notice in report.notices:
        click.echo(f"known issue: {notice}", err=True)
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)


def render_catalogue(catalogue: Catalogue) -> None:
    for patch in catalogue.patches:
        click.echo(f"{patch.id}: {patch.title}")
        click.echo(f"    why: {' '.join(patch.why.split())}")
        for variant in patch.variants:
            click.echo(f"    {variant.versions}  variant {variant.name} ({variant.diff_path.name})")
        for decision in patch.decisions:
            click.echo(f"    {decision.versions}  {decision.state}: {decision.reason}")
        click.echo(f"    upstream: {', '.join(patch.upstream)}")
        click.echo(f"    remove when: {' '.join(patch.remove_when.split())}")
    click.echo(f"tested releases: {', '.join(catalogue.tested_releases)}")


def catalogue_json(catalogue: Catalogue) -> dict:
    return {
        "tested_releases": list(catalogue.tested_releases),
        "patches": [
            {
                "id": p.id,
                "title": p.title,
                "why": p.why,
                "upstream": list(p.upstream),
                "remove_when": p.remove_when,
                "runtime_gate": p.runtime_gate or None,
                "covers": p.covers or None,
                "overridden_by": (
                    {
                        "env": p.overridden_by.env,
                        "versions": str(p.overridden_by.versions),
                        "detail": p.overridden_by.detail,
                    }
                    if p.overridden_by
                    else None
                ),
                "variants": [
                    {"name": v.name, "diff": v.diff_path.name, "versions": str(v.versions)}
                    for v in p.variants
                ],
                "decisions": [
                    {"state": d.state, "versions": str(d.versions), "reason": d.reason}
                    for d in p.decisions
                ],
            }
            for p in catalogue.patches
        ],
    }


# ----- doctor -----


def render_doctor(report, echo, verbose: bool = False) -> None:
    """doctor's report as text: facts, the kernel scan (one line per kernel and verdict,
    or per config with ``verbose``), then one verdict per bug."""
    for g in report.gpus:
        echo(f"GPU: {g.name} (compute capability {g.compute_capability})")
    if not report.gpus:
        echo(f"GPU: {report.gpu_note}")
    t = report.toolchain
    where = f" ({t.ptxas_source}: {t.ptxas})" if t.ptxas else ""
    fixed = f"; fixed from {report.fixed_from}" if report.fixed_from else ""
    located = f" ({t.location})" if t.location else ""
    echo(
        f"Triton {t.triton or 'not installed'}{located}; "
        f"ptxas for sm_90: {t.ptxas_version or 'unknown'}{where}{fixed}"
    )
    if report.tree is None:
        echo(f"vLLM: {report.tree_error}")
    else:
        _render_tree(report, echo)
    for c in report.tuned_configs:
        echo(f"tuned config {c.file}: {c.problem}")
    for pyc in report.stale_bytecode:
        echo(f"stale bytecode: {pyc}")
    for c in report.old_caches:
        echo(f"{c.name} {c.path}: {c.entries} entries older than the patch")
    if report.kernels is not None:
        render_kernels(report.kernels, echo, verbose)
    echo("")
    for v in report.verdicts:
        echo(f"[{v.status}] {v.bug}")
        echo(f"    {v.reason}" + (f"; fix: {v.fix}" if v.fix and v.status == "exposed" else ""))


def _render_tree(report, echo) -> None:
    tree, theirs = report.tree, report.tree_triton
    echo(f"vLLM {tree.version} at {tree.root}")
    if theirs is not None and theirs.version:
        ptxas = f", ptxas {theirs.ptxas_version}" if theirs.ptxas_version else ""
        echo(f"Triton next to vLLM: {theirs.version} ({theirs.location}{ptxas})")
    elif theirs is not None:
        echo(f"Triton next to vLLM: none (no triton-*.dist-info in {tree.root})")
    width = max((len(a.patch.id) for a in report.patches), default=0)
    for a in report.patches:
        echo(f"  {a.patch.id:<{width}}  {a.state}")


def render_kernels(scan, echo, verbose: bool = False) -> None:
    """The scan: a header, then per kernel one line per verdict (``verbose``: per config)."""
    if scan.error:
        echo(f"kernel scan: {scan.error}")
        return
    t = scan.toolchain
    gpus = ", ".join(name.replace("NVIDIA ", "") for name in scan.gpus)
    echo(
        f"kernel scan (sm_90; Triton {t.triton}, ptxas {t.ptxas_version}, {scan.disassembler}; "
        f"{len(scan.cases)} configs of {len(scan.by_kernel())} kernels from {scan.calls} calls "
        f"on {gpus}; {'remembered, ' if scan.remembered else ''}{scan.seconds} s):"
    )
    for kernel, cases in scan.by_kernel().items():
        lines = [_case_line(c) for c in cases] if verbose else _kernel_lines(kernel, cases)
        for line in lines:
            echo(f"  {line}")


def _kernel_lines(kernel: str, cases: list) -> list[str]:
    """One line per verdict of a kernel: what runs here, what does not, errors, approximations."""
    runs = [c for c in cases if c.called and c.verdict != "error"]
    idle = [c for c in cases if not c.called and c.verdict != "error"]
    errors = [c for c in cases if c.verdict == "error"]
    lines = []
    hazards = [c for c in runs if c.verdict == "hazard"]
    if hazards:
        lines.append(
            f"{kernel}: hazard in {len(hazards)} of {len(runs)} configs this install runs "
            f"(first: {_first_hazard(hazards[0])})"
        )
    elif runs:
        lines.append(f"{kernel}: no overwrite in the {len(runs)} configs this install runs")
    if idle:
        idle_hazards = [c for c in idle if c.verdict == "hazard"]
        found = f"hazard in {len(idle_hazards)} of" if idle_hazards else "no overwrite in"
        lines.append(
            f"{kernel}: {found} {len(idle)} configs not run here ({idle[0].why_not_called})"
        )
    if errors:
        lines.append(f"{kernel}: error in {len(errors)} config(s) (first: {errors[0].error})")
    approximate = [c for c in cases if c.approximate]
    if approximate:
        lines.append(
            f"{kernel}: {len(approximate)} config(s) approximate ({approximate[0].approximate})"
        )
    return lines


def _first_hazard(case) -> str:
    hazard = case.hazards[0]
    return f"{case.shape()}, {case.calls[0]}: {hazard['instruction']} at {hazard['address']}"


def _case_line(case) -> str:
    runs = "runs here" if case.called else f"not run: {case.why_not_called}"
    detail = case.error or (
        f"{len(case.hazards)} overwrite(s), first {case.hazards[0]['instruction']} "
        f"at {case.hazards[0]['address']}"
        if case.hazards
        else ""
    )
    approximate = f"; approximate: {case.approximate}" if case.approximate else ""
    return (
        f"[{case.verdict}] {case.label()}; {runs}" + (f"; {detail}" if detail else "") + approximate
    )
