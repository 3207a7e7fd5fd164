"""canary: ask a running vLLM server whether each model and adapter answers sanely.

httpx and prometheus_client are imported only when the command runs, so no
other command needs them.
"""

from __future__ import annotations

import click

from patchkit.cli import exits, render
from patchkit.cli.options import json_option
from patchkit.cli.outcome import fail, user_errors


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
    render.emit_canary(result, as_json, api_key)
    if not result.ok:
        fail(server.scrub(result.summary(), api_key), exits.FAILURE, False)
