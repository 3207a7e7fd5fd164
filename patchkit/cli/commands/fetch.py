"""fetch: a release's pristine tree from its PyPI wheel."""

from __future__ import annotations

import sys

import click

from patchkit.cli.options import json_option
from patchkit.cli.outcome import outcome, user_errors
from patchkit.cli.render import emit_json, out


@click.command("fetch")
@click.argument("version")
@click.option(
    "--dest",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Unpack here instead of the cache.",
)
@click.option(
    "--trust-ranges",
    is_flag=True,
    help="Read only the Python files by range requests (about 8 MB of 300), checked "
    "against the wheel's RECORD but not the index's sha256: trusts the host.",
)
@json_option
@user_errors
def fetch_command(version: str, dest: str | None, trust_ranges: bool, as_json: bool) -> None:
    """Fetch vLLM VERSION's Python files from its wheel and print the directory of the tree.

    Downloads the whole wheel from the index pip is configured with, checks it
    against the index's sha256 as pip does, and unpacks the Python files; on a
    terminal a line says what was read.
    """
    from patchkit.releases.fetch import fetch

    progress = not as_json and sys.stderr.isatty()
    path = fetch(version, dest, progress=progress, trust_ranges=trust_ranges)
    outcome().done([f"fetch: vLLM {version} is at {path}"])
    emit_json("fetch", {"ok": True, "path": str(path)}) if as_json else out(str(path))
