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
