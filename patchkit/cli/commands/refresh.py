"""refresh: rewrite a patch's diff from the tree it is applied to (maintainers)."""

from __future__ import annotations

import click

from patchkit.catalogue.load import load_catalogue, recover_interrupted_refresh
from patchkit.cli.options import check_only, json_option, target_options
from patchkit.cli.outcome import outcome, user_errors
from patchkit.cli.render import emit_json, messages, out
from patchkit.cli.words import say
from patchkit.errors import PatchkitError
from patchkit.vllmtree.tree import locate


def check_add(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    """A --add path that is absolute, climbs out or is not under vllm/ is a usage error
    (exit 2), caught before any work."""
    from patchkit.fs.safepath import checked_relpath

    for relpath in value:
        try:
            checked_relpath(relpath, "--add")
        except PatchkitError as exc:
            raise click.BadParameter(str(exc).removeprefix("--add: "), ctx, param) from None
    return value


@click.command("refresh")
@click.argument("patch_id", metavar="ID", required=False)
@target_options
@click.option("--variant", metavar="NAME", help="The variant to write (default: the one applied).")
@click.option(
    "--add",
    multiple=True,
    metavar="PATH",
    callback=check_add,
    help="Also put this file (vllm/...) into the patch; its original comes from --pristine.",
)
@click.option(
    "--pristine",
    metavar="DIR",
    type=click.Path(file_okay=False, exists=True),
    help="A pristine tree of the same release, for --add (default: `patchkit fetch VERSION`).",
)
@click.option(
    "--recover",
    is_flag=True,
    help="Only finish or undo a refresh that was interrupted while writing the catalogue "
    "(every refresh does that first), then stop.",
)
@json_option
@user_errors
def refresh_command(
    patch_id, target, vllm_version, variant, add, pristine, recover, as_json
) -> None:
    """Rewrite patch ID's diff from the tree it is applied to (maintainers; like quilt refresh).

    Apply the patch, edit the patched files in the tree, then refresh: the
    variant's diff is made from the originals patchkit keeps to the files as
    they are, files the patch creates are copied back to patches/ID/files/,
    and the tree's record follows, so status still says applied.

    A refresh killed while it wrote leaves a journal in the catalogue; the
    next refresh (or `refresh --recover` alone) finishes or undoes it and
    says so. No other command writes the catalogue.
    """
    from pathlib import Path

    from patchkit.fs.safepath import checked_relpath
    from patchkit.patching.refresh import refresh

    if recover and (patch_id or add or variant or pristine or target):
        raise click.UsageError("--recover takes no ID and no other option; it only recovers")
    if not recover and not patch_id:
        raise click.UsageError("Missing argument 'ID' (or --recover).")
    if recover:  # series.toml alone: a catalogue that does not load still gets recovered
        recovered = recover_interrupted_refresh()
        if recovered:
            outcome().done([f"refresh: {say(r)}" for r in recovered])
        if as_json:
            emit_json("refresh", recover_json(recovered))
        else:
            render_recover(recovered)
        return
    catalogue = load_catalogue()  # reads only: a usage error comes before any write
    check_only((patch_id,), catalogue)
    for relpath in add:
        checked_relpath(relpath, "--add")
    recovered = []
    if catalogue.interrupted_refresh:  # refresh owns the journal: it finishes or undoes it
        recovered = recover_interrupted_refresh(catalogue.root)
        outcome().done([f"refresh: {say(r)}" for r in recovered])
        catalogue = load_catalogue(catalogue.root)  # as the recovery left it
    tree = locate(target, vllm_version)
    result = refresh(
        tree, catalogue, patch_id, variant, tuple(add), Path(pristine) if pristine else None
    )
    result.recovered[:0] = recovered
    outcome().done([refresh_summary(result)])
    if as_json:
        emit_json("refresh", refresh_json(result))
    else:
        render_refresh(result)


# ----- the report -----


def render_refresh(report) -> None:
    for reason in report.recovered:  # what it finished or undid before it refreshed
        out(f"note: {say(reason)}")
    out(f"refreshed {report.patch_id} (variant {report.variant}): {report.diff}")
    for relpath in report.changed:
        out(f"  diff of {relpath}")
    for path in report.created:
        out(f"  created file copied to {path}")
    for relpath in report.unchanged:
        out(f"  {relpath} is back to its original: left out of the patch")
    out(f"refresh: {_refresh_counts(report)}; review with git diff, then run the tests")


def refresh_summary(report) -> str:
    """One line: what a refresh wrote into the catalogue."""
    return (
        f"refresh: wrote {report.diff} (patch {report.patch_id}, variant {report.variant}): "
        f"{_refresh_counts(report)}"
    )


def _refresh_counts(report) -> str:
    return (
        f"{len(report.changed)} diffed, {len(report.created)} created, "
        f"{len(report.unchanged)} left out"
    )


def refresh_json(report) -> dict:
    return {
        "ok": True,
        "recover": False,
        "patch": report.patch_id,
        "variant": report.variant,
        "diff": str(report.diff),
        "changed": report.changed,
        "unchanged": report.unchanged,
        "created": [str(p) for p in report.created],
        "added": report.added,
        "recovered": messages(report.recovered),
    }


def render_recover(recovered: list) -> None:
    """`refresh --recover`: what it finished or undid, or that there was nothing."""
    for reason in recovered:
        out(f"refresh: {say(reason)}")
    if not recovered:
        out("refresh: no interrupted refresh in the catalogue: nothing to do")


def recover_json(recovered: list) -> dict:
    return {"ok": True, "recover": True, "recovered": messages(recovered)}
