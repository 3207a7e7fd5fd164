"""canary: ask a running vLLM server whether each model and adapter answers sanely.

httpx and prometheus_client are imported only when the command runs, so no
other command needs them.
"""

from __future__ import annotations

import click

from patchkit.cli import exits, render
from patchkit.cli.options import json_option
from patchkit.cli.outcome import fail, user_errors
from patchkit.cli.words import say


def check_url(ctx, param, value: str) -> str:
    """http(s), a host and a valid port: a malformed URL ('http://[::1') raised
    httpx.InvalidURL inside the run (exit 3), a port past 65535 read as 'refused'."""
    from urllib.parse import urlsplit

    if not value.strip().lower().startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} must start with http:// or https://")
    if not value.strip().isprintable():  # httpx.InvalidURL inside the run: exit 3
        raise click.BadParameter(f"{value!r} holds a control character; no URL does")
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018 -- raises ValueError when out of range or not a number
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not a URL ({exc})") from None
    if not parts.hostname:
        raise click.BadParameter(f"{value!r} names no host")
    return value


def check_finite(ctx, param, value: float) -> float:
    """FloatRange lets NaN through (every comparison is false): a deadline never reached."""
    import math

    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds")
    return value


@click.command("canary")
@click.option(
    "--url",
    metavar="URL",
    required=True,
    callback=check_url,
    help="Server root, e.g. http://localhost:8000 (a trailing /v1 is accepted).",
)
@click.option(
    "--api-key",
    metavar="KEY",
    envvar="VLLM_API_KEY",
    help="The server's API key (or VLLM_API_KEY).",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="ID",
    help="Check only this model or adapter (repeatable). Default: all that GET /v1/models lists.",
)
@click.option(
    "--prompt-tokens",
    metavar="N",
    type=click.IntRange(16, 100_000),
    default=2000,
    show_default=True,
    help="About this many prompt tokens per model (16-100000).",
)
@click.option(
    "--timeout",
    metavar="S",
    type=click.FloatRange(1, 600),
    default=60.0,
    show_default=True,
    callback=check_finite,
    help="Seconds for the whole run.",
)
@click.option(
    "--record",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Save every HTTP exchange (path, bodies, status; no headers) as JSON files here.",
)
@json_option
@user_errors
def canary_command(url, api_key, models, prompt_tokens, timeout, record, as_json) -> None:
    """Ask a running vLLM server whether each model and LoRA adapter answers sanely.

    One long greedy prompt per model; NaN log-probabilities, runs of token id 0
    ('!!!!') or a rise of vllm:corrupted_requests_total fail it. Exit 0 when all
    are sane, 1 otherwise or when the server cannot be reached.
    """
    from pathlib import Path

    from patchkit.canary import check, server  # httpx, prometheus_client: only here

    result = check.run(
        url, api_key, models, prompt_tokens, timeout, Path(record) if record else None
    )
    emit(result, as_json, api_key)
    if not result.ok:
        fail(server.scrub(say(result.outcome()), api_key), exits.FAILURE, False)


# ----- the report -----

MODEL_NAME = 80  # characters of a model's name in the per-model lines


def emit(report, as_json: bool, api_key: str | None) -> None:
    """The report as text or JSON. Model names, evidence and answers come from the
    server: every text line is escaped and cut to fields.LINE, and the API key is
    scrubbed from every line and from the document."""
    from patchkit.canary import fields, server

    if as_json:
        data = render.document("canary", canary_json(report))
        render.out_lines(server.scrub(render.json_text(data), api_key))
        return
    for line in canary_lines(report):
        render.out(fields.one_line(server.scrub(line, api_key), fields.LINE))


def canary_lines(report) -> list[str]:
    """The text report: a line per model, the counter, the verdict and the next steps
    (as they are: :func:`emit` scrubs and escapes them)."""
    from patchkit.canary import fields, metrics, prompt

    version = f"vLLM {report.version}" if report.version else "server"
    lines = [
        f"{version} at {report.url}: {render.counted(len(report.models), 'model')}, "
        f"prompt ~{report.prompt_tokens} tokens, {prompt.NEW_TOKENS} new, greedy "
        f"({report.seconds:.1f} s)"
    ]
    listed = report.models + report.parents
    name = {id(v): fields.one_line(v.model, MODEL_NAME) for v in listed}
    width = max(map(len, name.values()), default=0)
    for v in report.models:
        lines.append(f"  {_label(v):<11} {name[id(v)]:<{width}}  {v.kind:<7}  {_detail(v)}")
    for v in report.parents:  # asked only to compare an adapter named alone with it
        lines.append(
            f"  {_label(v):<11} {name[id(v)]:<{width}}  {v.kind:<7}  asked to compare its "
            f"adapters with: {_detail(v)}"
        )
    if report.recheck:
        r = report.recheck
        again = f"again after the bad adapter: {_detail(r)}"
        recheck_name = fields.one_line(r.model, MODEL_NAME)
        lines.append(f"  {_label(r):<11} {recheck_name:<{width}}  {again}")
    counter = report.counter
    if counter.get("present"):
        lines.append(f"{metrics.COUNTER}: {counter['before']:g} -> {counter['after']:g}")
    lines += [f"note: {say(note)}" for note in report.notes]
    if report.ok:
        return lines + [f"OK: {say(report.outcome())}"]
    lines.append(f"FAILED: {say(report.outcome())}")
    steps = enumerate(report.next_steps(), start=1)
    return lines + [f"  {number}. {say(step)}" for number, step in steps]


def _label(v) -> str:
    return {"ok": "ok", "bad": "BAD (NaN)"}.get(v.verdict, v.verdict.upper())


def _detail(v) -> str:
    facts = []
    if v.prompt_tokens is not None:
        facts.append(f"{v.prompt_tokens} prompt tokens")
    if v.completion_tokens is not None:
        facts.append(f"{v.completion_tokens} new")
    if v.verdict == "bad" and v.text is not None:
        facts.append(f"text {v.text[:24]!r}")
    facts.append(f"{v.seconds:.1f} s")
    return "; ".join([say(e) for e in v.evidence] + [", ".join(facts)])


def canary_json(report) -> dict:
    """The document's keys after format and command: every message through
    render.message (its code, its words, its facts)."""
    from patchkit.canary import prompt

    return {
        "ok": report.ok,
        "exit_code": exits.OK if report.ok else exits.FAILURE,
        "error": render.message(report.error()),
        "url": report.url,
        "vllm_version": report.version,
        "prompt_tokens": report.prompt_tokens,
        "new_tokens": prompt.NEW_TOKENS,
        "models": [_model_json(v) for v in report.models],
        "recheck": _model_json(report.recheck) if report.recheck else None,
        "parents": [_model_json(v) for v in report.parents],
        "corrupted_requests": report.counter,
        "notes": render.messages(report.notes),
        "skipped": len(report.skipped),  # the first few are named in notes
        "next_steps": render.messages(report.next_steps()),
        "seconds": round(report.seconds, 2),
    }


def _model_json(v) -> dict:
    return {"kind": v.kind} | render.field_values(v) | {"evidence": render.messages(v.evidence)}
