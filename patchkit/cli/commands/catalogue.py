"""list and show: the catalogue, per patch the releases it covers and what it fixes.

The releases are said in the states' words (`upstream`, `not-applicable`, as status
says them), in runs of releases; `show ID` (and `list -v`) print a patch's whole entry.
"""

from __future__ import annotations

import click
from packaging.version import Version

from patchkit.catalogue.model import Catalogue, Variant, range_text
from patchkit.cli.options import check_only, json_option, noted_catalogue
from patchkit.cli.outcome import user_errors
from patchkit.cli.render import (
    COLUMN,
    INDENT,
    counted,
    emit_json,
    line_width,
    out,
    wrap,
    wrap_blocks,
)


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
        emit_json("list", catalogue_json(catalogue))
    else:
        render_catalogue(catalogue, verbose)


@click.command("show")
@click.argument("patch_id", metavar="ID")
@json_option
@user_errors
def show_patch(patch_id: str, as_json: bool) -> None:
    """Print one patch in full: why, variants, decisions, known issues, upstream, remove-when."""
    catalogue = noted_catalogue()
    check_only((patch_id,), catalogue, param_hint="ID")
    if as_json:
        emit_json("show", catalogue_json(catalogue, only=patch_id))
    else:
        render_patch(catalogue.get(patch_id), catalogue)


# ----- the report -----


def render_catalogue(catalogue: Catalogue, verbose: bool = False) -> None:
    """`list`: per patch, its id and the releases it covers in the states' words, then what
    it fixes at column 4 (two lines, three where the releases are longer than the line: they
    continue under themselves, a run of releases never split); ``verbose`` (`list -v`): each
    patch's full text, as `show ID` prints it."""
    for patch in catalogue.patches:
        if verbose:
            render_patch(patch, catalogue)
            continue
        for line in wrap_runs(f"{patch.id}: ", coverage_runs(patch, catalogue)):
            out(line)
        for line in wrap("    ", patch.title):
            out(line)
    if verbose:
        for line in wrap("tested releases: ", ", ".join(catalogue.tested_releases), 4):
            out(line)
        return
    span = f"{counted(len(catalogue.tested_releases), 'tested release')}, {catalogue.tested_span}"
    more = "`patchkit show ID` prints a patch's why, upstream links and remove-when"
    for line in wrap("", f"{span}; {more} (`patchkit list -v`: every patch's)", 4):
        out(line)


def render_patch(patch, catalogue: Catalogue) -> None:
    """`show ID` (and `list -v`): the whole entry, every field wrapped at :func:`line_width`."""

    def field(label: str, text: str) -> None:
        for line in wrap_blocks(f"    {label}: ", text):
            out(line)

    for line in wrap(f"{patch.id}: ", patch.title, 4):
        out(line)
    field("releases", coverage(patch, catalogue))
    if patch.opt_in:
        field(
            "opt-in",
            f"plain `patchkit apply` never applies it; after it, `patchkit apply --only "
            f"{patch.id}` adds it (alone it applies only itself), `revert` takes it off",
        )
    field("why", patch.why)
    for variant in patch.variants:
        for line in wrap(f"    {range_text(variant.versions)}  ", f"variant {variant.name} "
                         f"({variant.diff_path.name})", INDENT):  # fmt: skip
            out(line)
    for decision in patch.decisions:
        field(f"{range_text(decision.versions)}  {decision.state}", decision.reason)
    for notice in patch.notices:
        field(f"{range_text(notice.versions)}  known issue", notice.message)
    field("upstream", ", ".join(patch.upstream))
    field("remove when", patch.remove_when)


def wrap_runs(first: str, runs: list[str]) -> list[str]:
    """``first`` then ``runs`` joined by ", " and filled to :func:`line_width`, breaking only
    between runs; the next lines under where the runs start (at INDENT when that leaves too
    little room), so they never read as the title below them."""
    width = line_width()
    column = len(first) if width - len(first) >= COLUMN else INDENT
    pieces = [run + "," for run in runs[:-1]] + runs[-1:]
    if not pieces:
        return [first.rstrip()]
    lines = [first + pieces[0]]
    for piece in pieces[1:]:
        if len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.append(" " * column + piece)
    return lines


def coverage(patch, catalogue: Catalogue) -> str:
    """The tested releases a patch covers, in runs of one word: "applies to 0.17.0-0.32.0
    (2 variants), upstream 0.33.0"; `upstream` and `not-applicable` as status says them, an
    opt-in patch's runs marked `opt-in`."""
    return ", ".join(coverage_runs(patch, catalogue))


def coverage_runs(patch, catalogue: Catalogue) -> list[str]:
    """:func:`coverage`'s runs, each a word and its releases ("upstream 0.33.0-0.34.0"), an
    opt-in patch's first run "opt-in"."""
    runs: list[list] = []  # [word, first, last, variant names]
    for release in catalogue.tested_releases:
        entry = patch.expected_for(Version(release))
        if isinstance(entry, Variant):
            word, name = "applies to", entry.name
        else:
            word, name = (entry.state if entry else "not covered"), None
        if runs and runs[-1][0] == word:
            runs[-1][2] = release
        else:
            runs.append([word, release, release, []])
        if name and name not in runs[-1][3]:
            runs[-1][3].append(name)
    parts = []
    for word, first, last, names in runs:
        span = first if first == last else f"{first}-{last}"
        variants = f" ({counted(len(names), 'variant')})" if len(names) > 1 else ""
        parts.append(f"{word} {span}{variants}")
    return (["opt-in"] if patch.opt_in else []) + parts


def catalogue_json(catalogue: Catalogue, only: str | None = None) -> dict:
    """`list --json` (every patch, in full) and `show ID --json` (``only`` that one)."""
    return {
        "ok": True,
        "tested_releases": list(catalogue.tested_releases),
        "patches": [
            {
                "id": p.id,
                "title": p.title,
                "opt_in": p.opt_in,
                "why": p.why,
                "upstream": list(p.upstream),
                "remove_when": p.remove_when,
                "runtime_gate": p.runtime_gate or None,
                "covers": p.covers or None,
                "overridden_by": (
                    {
                        "env": p.overridden_by.env,
                        "versions": range_text(p.overridden_by.versions),
                        "detail": p.overridden_by.detail,
                    }
                    if p.overridden_by
                    else None
                ),
                "variants": [
                    {"name": v.name, "diff": v.diff_path.name, "versions": range_text(v.versions)}
                    for v in p.variants
                ],
                "decisions": [
                    {"state": d.state, "versions": range_text(d.versions), "reason": d.reason}
                    for d in p.decisions
                ],
            }
            for p in catalogue.patches
            if only is None or p.id == only
        ],
    }
