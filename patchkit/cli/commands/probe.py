"""probe report: read what the nan-probe patch logged."""

from __future__ import annotations

import click

from patchkit.cli.options import json_option
from patchkit.cli.outcome import user_errors
from patchkit.cli.probe_words import look_at, verdict
from patchkit.cli.render import counted, emit_json, field_values, message, messages, out, warn
from patchkit.cli.words import say


@click.group("probe", cls=click.Group)
def probe() -> None:
    """Read what the nan-probe patch logged (patchkit apply --only nan-probe)."""


@probe.command("report")
@click.argument("log_file", metavar="FILE", type=click.Path(dir_okay=False))
@json_option
@user_errors
def probe_report(log_file: str, as_json: bool) -> None:
    """Per affected request: the first layer and module where a NaN/Inf appeared, and why.

    FILE is the PATCHKIT_PROBE_LOG the probed server wrote (JSON lines). Reads
    only; no vLLM, no torch. Exit 0 with the report (a last line cut short is
    skipped with a warning), 1 on a line that is not a probe record, 2 when
    FILE does not exist.
    """
    from pathlib import Path

    from patchkit.probe import report

    result = report.report(Path(log_file))
    render_probe_warnings(result)
    if as_json:
        emit_json("probe report", probe_json(result))
    else:
        render_probe_report(result)


# ----- the report -----


def render_probe_report(report) -> None:
    """Per affected request: where it first went bad, the verdict, where to look.

    Request ids (a client's X-Request-Id), adapter and module names come from the
    log: :func:`out` escapes their control characters, as every line's.
    """
    records, steps = counted(report.records, "record"), counted(report.steps, "step")
    out(f"nan-probe log {report.path}: {records} over {steps}")
    for q in report.quarantines:
        out(f"  {say(q.reason())}")
    if report.quarantines_not_listed:
        out(f"  and {counted(report.quarantines_not_listed, 'more quarantine')}")
    if not report.findings:
        out("no request had a NaN or Inf in any probed layer or projection")
    for f in report.findings:
        adapter = f" (adapter {f.adapter})" if f.adapter else ""
        where = f"step {f.step}, layer {f.layer}, {f.module}"
        if f.tensor:  # its adapter's quarantine, not the first bad projection, is the cause
            out(f"  request {f.request}{adapter}: bad from step {f.step}, its adapter quarantined")
        else:
            out(f"  request {f.request}{adapter}: first bad at {where}")
        out(f"      {say(f.reason)}")
        if not f.tensor:
            out(f"      bad in layer {f.layer}: {', '.join(f.bad_modules)}")
    if report.padding_only:
        padding = counted(report.padding_only, "record")
        out(f"{padding} had bad rows in CUDA-graph padding only (no request)")
    out(f"probe report: {counted(len(report.findings), 'affected request')}")


def probe_json(report) -> dict:
    return {
        "ok": True,
        "file": report.path,
        "records": report.records,
        "steps": report.steps,
        "headers": report.headers,
        "padding_only": report.padding_only,
        "affected_requests": [_finding_json(f) for f in report.findings],
        "quarantines": [_quarantine_json(q) for q in report.quarantines],
        "quarantines_not_listed": report.quarantines_not_listed,
        "warnings": messages(report.warnings),
    }


def _finding_json(finding) -> dict:
    """A request's finding: where, the verdict and where to look in words (as they were
    before the reason was added), and ``reason``, the message with its code and facts."""
    found = {}
    for key, value in field_values(finding).items():
        if key == "reason":  # where the verdict and look_at were, in that order
            found |= {"verdict": verdict(value), "look_at": look_at(value)}
        else:
            found[key] = value
    return found | {"reason": message(finding.reason)}


def _quarantine_json(quarantine) -> dict:
    """A quarantine as a message (``probe-quarantine``, its line's words), then its fields."""
    return message(quarantine.reason()) | field_values(quarantine)


def render_probe_warnings(report) -> None:
    """A cut last line the report skipped: on stderr, in text and --json alike."""
    for warning in report.warnings:
        warn(f"warning: {say(warning)}")
