"""probe report: read what the nan-probe patch logged."""

from __future__ import annotations

import click

from patchkit.cli import render
from patchkit.cli.options import json_option
from patchkit.cli.outcome import user_errors


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
    render.render_probe_warnings(result)
    if as_json:
        render.emit_json(render.probe_json(result))
    else:
        render.render_probe_report(result)
