"""list, status, apply and revert: the catalogue, and the patches on a tree."""

from __future__ import annotations

import click

from patchkit import signals
from patchkit.catalogue.load import load_catalogue
from patchkit.cli import render
from patchkit.cli.options import (
    allow_dirty_option,
    caches_option,
    check_only,
    json_option,
    noted_catalogue,
    only_option,
    target_options,
)
from patchkit.cli.outcome import outcome, user_errors
from patchkit.forks import forkmode
from patchkit.patching import operations
from patchkit.patching.decide import RunOptions
from patchkit.vllmtree.tree import locate


@click.command("list")
@click.option(
    "-v", "--verbose", is_flag=True, help="Every patch's full text, as `show ID` prints it."
)
@json_option
@user_errors
def list_patches(verbose: bool, as_json: bool) -> None:
    """Print the patch catalogue: per patch its releases and what it fixes."""
    catalogue = noted_catalogue()
    if as_json:
        render.emit_json(render.catalogue_json(catalogue))
    else:
        render.render_catalogue(catalogue, verbose)


@click.command("show")
@click.argument("patch_id", metavar="ID")
@json_option
@user_errors
def show_patch(patch_id: str, as_json: bool) -> None:
    """Print one patch in full: why, variants, decisions, known issues, upstream, remove-when."""
    catalogue = noted_catalogue()
    check_only((patch_id,), catalogue, param_hint="ID")
    if as_json:
        render.emit_json(render.catalogue_json(catalogue, only=patch_id))
    else:
        render.render_patch(catalogue.get(patch_id), catalogue)


@click.command()
@target_options
@json_option
@user_errors
def status(target: str | None, vllm_version: str | None, as_json: bool) -> None:
    """Show each patch's state on the tree (reads files only)."""
    tree = locate(target, vllm_version)
    result = operations.status(tree, load_catalogue())
    if forkmode.is_fork(tree):
        forkmode.annotate_status(tree, result)
    show(result, as_json)


def show(result: operations.RunReport, as_json: bool) -> None:
    """The report of a finished run, written whole: a signal now would only cut it short."""
    if result.changed:
        outcome().done(render.run_changes(result))
    with signals.swallowed():
        render.emit_json(render.run_json(result)) if as_json else render.render_run(result)


@click.command()
@target_options
@only_option
@click.option("--dry-run", is_flag=True, help="Check everything, write nothing.")
@click.option("--strict", is_flag=True, help="Treat every warning as a failure.")
@caches_option
@click.option(
    "--branch",
    metavar="NAME",
    help="Fork mode: branch for the patch commits (patchkit/vllm-VERSION).",
)
@allow_dirty_option
@json_option
@user_errors
def apply(
    target, vllm_version, only, dry_run, strict, clear_caches, branch, allow_dirty, as_json
) -> None:
    """Apply the patches this vLLM needs (idempotent; all or nothing).

    On a vLLM git checkout each applied patch becomes a commit on a branch.
    """
    catalogue = load_catalogue()
    options = RunOptions(check_only(only, catalogue), dry_run, strict, False, clear_caches)
    tree = locate(target, vllm_version)
    if forkmode.is_fork(tree):
        result = forkmode.apply(tree, catalogue, options, branch, allow_dirty)
    else:
        result = operations.apply(tree, catalogue, options)
    show(result, as_json)


@click.command()
@target_options
@only_option
@click.option("--force", is_flag=True, help="Restore originals even over later edits.")
@caches_option
@allow_dirty_option
@json_option
@user_errors
def revert(target, vllm_version, only, force, clear_caches, allow_dirty, as_json) -> None:
    """Undo applied patches; the tree becomes byte-identical to before.

    On a vLLM git checkout each reverted patch gets a revert commit.
    """
    catalogue = load_catalogue()
    options = RunOptions(check_only(only, catalogue), force=force, clear_caches=clear_caches)
    tree = locate(target, vllm_version)
    if forkmode.is_fork(tree):
        result = forkmode.revert(tree, catalogue, options, allow_dirty)
    else:
        result = operations.revert(tree, catalogue, options)
    show(result, as_json)
