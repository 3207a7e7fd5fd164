"""probe report: read what the nan-probe patch logged."""

from __future__ import annotations

import click

from patchkit.cli.options import json_option
from patchkit.cli.outcome import user_errors
from patchkit.cli.render import counted, emit_json, field_values, messages, out, warn
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
    say = out
    records, steps = counted(report.records, "record"), counted(report.steps, "step")
    say(f"nan-probe log {report.path}: {records} over {steps}")
    for q in report.quarantines:
        say(f"  quarantined at load: {q.named()}: {q.cause()}; check it: {q.command()}")
    if report.quarantines_not_listed:
        say(f"  and {counted(report.quarantines_not_listed, 'more quarantine')}")
    if not report.findings:
        say("no request had a NaN or Inf in any probed layer or projection")
    for f in report.findings:
        adapter = f" (adapter {f.adapter})" if f.adapter else ""
        where = f"step {f.step}, layer {f.layer}, {f.module}"
        if f.tensor:  # its adapter's quarantine, not the first bad projection, is the cause
            say(f"  request {f.request}{adapter}: bad from step {f.step}, its adapter quarantined")
        else:
            say(f"  request {f.request}{adapter}: first bad at {where}")
        say(f"      {f.verdict}; look at {f.look_at}")
        if not f.tensor:
            say(f"      bad in layer {f.layer}: {', '.join(f.bad_modules)}")
    if report.padding_only:
        padding = counted(report.padding_only, "record")
        say(f"{padding} had bad rows in CUDA-graph padding only (no request)")
    say(f"probe report: {counted(len(report.findings), 'affected request')}")


def probe_json(report) -> dict:
    return {
        "ok": True,
        "file": report.path,
        "records": report.records,
        "steps": report.steps,
        "headers": report.headers,
        "padding_only": report.padding_only,
        "affected_requests": [field_values(f) for f in report.findings],
        "quarantines": [field_values(q) | {"command": q.command()} for q in report.quarantines],
        "quarantines_not_listed": report.quarantines_not_listed,
        "warnings": messages(report.warnings),
    }


def render_probe_warnings(report) -> None:
    """A cut last line the report skipped: on stderr, in text and --json alike."""
    for warning in report.warnings:
        warn(f"warning: {say(warning)}")
