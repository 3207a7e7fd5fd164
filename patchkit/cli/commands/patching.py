"""status, apply and revert: the patches on a tree, and their report (rows, summary, JSON).

One row per catalogue patch in all three, its state in :mod:`patchkit.vocabulary`'s
word, what the run did to it and why (:mod:`patchkit.cli.words`), wrapped at the
line width; then one summary line. The JSON has the same patches and keys in all three.
"""

from __future__ import annotations

from collections import Counter

import click

from patchkit import signals
from patchkit.caches.compiled import CacheResult
from patchkit.catalogue.load import load_catalogue
from patchkit.cli import runner
from patchkit.cli.options import (
    allow_dirty_option,
    caches_option,
    check_only,
    json_option,
    only_option,
    target_options,
)
from patchkit.cli.outcome import outcome, user_errors
from patchkit.cli.render import (
    INDENT,
    counted,
    emit_json,
    message,
    messages,
    out,
    warn,
    wrap,
)
from patchkit.cli.words import said, say
from patchkit.forks import forkmode
from patchkit.patching import operations
from patchkit.patching.assess import Assessment
from patchkit.patching.decide import RunOptions, Step
from patchkit.patching.operations import RunReport
from patchkit.terminal import printable
from patchkit.vllmtree.tree import locate
from patchkit.vocabulary import Action, PatchState


@click.command()
@target_options
@json_option
@user_errors
def status(target: str | None, vllm_version: str | None, as_json: bool) -> None:
    """Show each patch's state on the tree (reads files only)."""
    tree = locate(target, vllm_version)
    result = operations.status(tree, load_catalogue())
    if forkmode.is_fork(tree):
        result = forkmode.annotate_status(tree, result)
    show(result, as_json)


def show(result: operations.RunReport, as_json: bool) -> None:
    """The report of a finished run, written whole: a signal now would only cut it short."""
    if result.changed:
        outcome().done(run_changes(result))
    with signals.swallowed():
        emit_json(result.command, run_json(result)) if as_json else render_run(result)


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


# ----- the report -----

SOURCES = {
    "metadata": "dist-info metadata",
    "git": "git describe",
    "file": "vllm/_version.py",
    "override": "--vllm-version / PATCHKIT_VLLM_VERSION",
    "unknown": "not found",
}
DONE = {
    Action.APPLIED: "applied now",
    Action.REVERTED: "reverted now",
    Action.WOULD_APPLY: "would apply",
}


def render_run(report: RunReport) -> None:
    """status, apply and revert: one row per catalogue patch (the same rows in all three),
    its state, what the run did to it and why, wrapped at :func:`line_width`; then the
    summary, on one line whatever its length (the line scripts and logs look for)."""
    tree = report.tree
    where = printable(str(tree.root))  # exact: a newline in the path shown as \n, not a space
    header = f"vLLM {tree.version} at {where} (version from {SOURCES[tree.source]})"
    for line in wrap("", header, 4):
        out(line)
    if report.runner is not None and report.command == "status":
        for text in runner.lines(report.runner, [s.assessment for s in report.steps]):
            for line in wrap("", text, 4):
                out(line)
    for note in report.notes:
        for line in wrap("note: ", say(note), 4):
            out(line)
    width = max((len(s.assessment.patch.id) for s in report.steps), default=0)
    for step in report.steps:
        _render_step(report, step, width)
    for pyc in report.bytecode_removed:
        out(f"removed bytecode: {pyc}")
    _render_caches(report.caches_removed)
    for warning in report.warnings:
        warn(f"warning: {say(warning)}")
    out(summary(report))


def _render_step(report: RunReport, step: Step, width: int) -> None:
    a = step.assessment
    detail = said(a.reason) or (f"variant {a.variant.name}" if a.variant else "")
    if step.action == Action.REVERTED:
        # the reason described the tree before this run ("`patchkit revert --only X`
        # removes the rest"), advice the run has just followed
        detail = f"variant {a.variant.name}" if a.variant else ""
    if step.action in DONE:
        detail = f"{DONE[step.action]}; {detail}" if detail else DONE[step.action]
    for line in wrap(f"  {a.patch.id:<{width}}  {_state_column(report, step):<15}  ", detail):
        out(line)
    if step.action in (Action.APPLIED, Action.WOULD_APPLY):
        for place in a.placements:
            offset = f" (offset {place.offset:+d} lines)" if place.offset else ""
            out(f"      {place.path}: hunk #{place.hunk} at line {place.line}{offset}")
    for notice in report.notices(step):
        for line in wrap("      known issue: ", say(notice.reason), INDENT):
            out(line)


def _state_column(report: RunReport, step: Step) -> str:
    """The patch's state: after the run, or, for a dry run that wrote nothing, as it is now
    (the detail says what the run would do: "would apply")."""
    return str(step.assessment.state if report.options.dry_run else step.state_after)


def run_changes(report: RunReport) -> list[str]:
    """What a run that changed the tree did, and what went wrong after: the lines that go to
    stderr when stdout cannot take the report."""
    left_alone = [
        f"left {c.name} alone: {say(c.reason)}"
        for c in report.caches_removed
        if c.state not in ("cleared", "absent")
    ]
    warnings = [f"warning: {say(w)}" for w in report.warnings]
    return [summary(report), *warnings, *left_alone]


def _render_caches(caches: list[CacheResult]) -> None:
    for cache in caches:
        if cache.state == "cleared":
            out(
                f"cleared {cache.name}: {cache.path} "
                f"({counted(cache.files, 'file')}, {counted(cache.bytes, 'byte')})"
            )
        elif cache.state == "absent":
            out(f"no {cache.name} at {cache.path}: nothing to clear")
        else:
            warn(f"left {cache.name} alone: {say(cache.reason)}")


def summary(report: RunReport) -> str:
    """One line: what the run did, and the state of every patch it looked at after it."""
    states = Counter(s.state_after for s in report.steps)
    now = ", ".join(f"{states[state]} {state}" for state in PatchState if states[state])
    if report.command == "status":
        return f"status: {now}"
    actions = Counter(DONE[s.action] for s in report.steps if s.action in DONE)
    did = ", ".join(f"{n} {what}" for what, n in actions.items()) or "nothing to do"
    removed = len(report.bytecode_removed)
    pyc = f"; {removed} bytecode files removed" if removed else ""
    if report.options.dry_run:  # the states are those the run would leave, not the tree's
        return f"{report.command}: {did}; nothing was written; it would leave {now}"
    return f"{report.command}: {did}{pyc}; now {now}"


def run_json(report: RunReport) -> dict:
    """--json of status, apply and revert (after the contract's first keys): the same keys
    and the same patches in all three; each patch's state after the run and what the run
    did to it (status: nothing)."""
    notices: dict[str, object] = {}  # each known issue once, by its words
    for step in report.steps:
        for notice in report.notices(step):
            notices.setdefault(say(notice.reason), notice.reason)
    return {
        "ok": True,
        "vllm": report.tree.describe(),
        "patches": [_step_json(report, s) for s in report.steps],
        "warnings": messages(report.warnings),
        "notices": messages(notices.values()),
        "notes": messages(report.notes),
        "summary": summary(report),
        "dry_run": report.options.dry_run,
        "bytecode_removed": report.bytecode_removed,
        "caches_removed": [_cache_json(c) for c in report.caches_removed],
    } | (
        {"runner": runner.as_json(report.runner, [s.assessment for s in report.steps])}
        if report.runner is not None
        else {}
    )


def _cache_json(cache: CacheResult) -> dict:
    return {
        "name": cache.name,
        "path": cache.path,
        "state": cache.state,
        "removed": cache.removed,
        "files": cache.files,
        "bytes": cache.bytes,
        "reason": message(cache.reason),
    }


def _step_json(report: RunReport, step: Step) -> dict:
    data = _assessment_json(step.assessment)
    data["notices"] = messages(n.reason for n in report.notices(step))
    data["state"] = _state_column(report, step)
    data["state_before"] = str(step.assessment.state)
    data["action"] = str(step.action)
    if report.options.dry_run:
        data["would_leave"] = str(step.state_after)
    shown = step.action in (Action.APPLIED, Action.WOULD_APPLY)
    data["hunks"] = [_placement_json(p) for p in step.assessment.placements] if shown else []
    return data


def _assessment_json(a: Assessment) -> dict:
    return {
        "id": a.patch.id,
        "state": str(a.state),
        "reason": message(a.reason),
        "variant": a.variant.name if a.variant else None,
        "files": list(a.files),
        "warnings": messages(a.warnings),
        "notices": messages(n.reason for n in a.notices),
    }


def _placement_json(place) -> dict:
    return {"file": place.path, "hunk": place.hunk, "line": place.line, "offset": place.offset}
