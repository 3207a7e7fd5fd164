"""The options several commands share, and the checks that make a bad value a usage error.

A callback that raises ``click.BadParameter`` ends the run with exit 2 before
any work, as every other usage error does.
"""

from __future__ import annotations

import click

from patchkit.errors import PatchkitError
from patchkit.identity import is_version
from patchkit.patching.decide import select

TARGET_HELP = (
    "Directory that contains vllm/ (site-packages, dist-packages or a vLLM checkout). "
    "Default: the vLLM importable by this Python (found without importing it)."
)


def check_target(ctx, param, value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise click.BadParameter("is empty; pass the directory that contains vllm/", ctx, param)
    return value


def check_version(ctx, param, value: str | None) -> str | None:
    if value is not None and not is_version(value):
        raise click.BadParameter(f"{value!r} is not a PEP 440 version (e.g. 0.26.0)")
    return value


def check_only(only: tuple[str, ...], catalogue, param_hint: str = "--only") -> tuple[str, ...]:
    """An unknown --only id (or `show ID`) is a usage error (exit 2), caught before any work."""
    try:
        select(catalogue, only)
    except PatchkitError as exc:
        raise click.BadParameter(str(exc), param_hint=param_hint) from None
    return only


def noted_catalogue():
    """The catalogue, for a command that only reads it (list, show, doctor, verify): a
    refresh interrupted while writing it is said on stderr, never acted on (refresh
    finishes or undoes it; status, apply and revert say it in their own reports)."""
    from patchkit.catalogue.load import load_catalogue
    from patchkit.cli import render
    from patchkit.cli.words import say

    catalogue = load_catalogue()
    if catalogue.interrupted_note:
        render.warn(f"warning: {say(catalogue.interrupted_note)}")
    return catalogue


def target_options(func):
    func = click.option(
        "--target",
        metavar="PATH",
        type=click.Path(file_okay=False),
        callback=check_target,
        help=TARGET_HELP,
    )(func)
    func = click.option(
        "--vllm-version",
        metavar="V",
        envvar="PATCHKIT_VLLM_VERSION",
        callback=check_version,
        help="Override the detected vLLM version (odd builds); also PATCHKIT_VLLM_VERSION.",
    )(func)
    return func


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
only_option = click.option(
    "--only", multiple=True, metavar="ID", help="Limit to this patch (repeatable)."
)
allow_dirty_option = click.option(
    "--allow-dirty", is_flag=True, help="Fork mode: work on a checkout with uncommitted changes."
)
caches_option = click.option(
    "--clear-caches",
    is_flag=True,
    help="Also clear vLLM's torch.compile cache and Triton's kernel cache.",
)
