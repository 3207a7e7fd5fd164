"""Carry out a plan: lock the tree, roll back an interrupted run, write all of it or none.

:mod:`patchkit.patching.decide` plans; this module executes. Nothing is
written until the whole plan exists: a conflict, or any warning under
``--strict``, stops the run with the tree untouched. While a run holds the
tree's lock, Ctrl-C and SIGTERM are held (:mod:`patchkit.signals`):
they take effect when the run has finished the step it was in, never between
a write and its state entry. What comes after the commit (stale bytecode, backups,
tidying ``.patchkit/``, caches) can only warn: once the tree has changed, no
later failure may make the run look as if it had changed nothing.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone

from patchkit import signals
from patchkit.caches import compiled
from patchkit.catalogue.model import Catalogue
from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, Refused, os_error_line
from patchkit.patching import bytecode
from patchkit.patching.assess import KnownIssue
from patchkit.patching.decide import (
    APPLY,
    REVERT,
    STATUS,
    Plan,
    RunOptions,
    Step,
    once,
    plan,
    select,
)
from patchkit.patching.state import (
    STATE_DIR,
    AppliedPatch,
    PatchedFile,
    State,
    backup_path,
    file_sha256,
    load_state,
    sweep,
    tidy,
)
from patchkit.patching.transaction import (
    LockUnavailable,
    TreeLock,
    after_recovery,
    commit,
    interrupted,
    lock_unavailable,
    recover,
)
from patchkit.vllmtree import model_runner
from patchkit.vllmtree.model_runner import RunnerChoice
from patchkit.vllmtree.tree import VllmTree
from patchkit.vocabulary import Action

__all__ = ["RunOptions", "RunReport", "apply", "revert", "select", "status"]


@dataclass
class RunReport:
    """What a run found and did: the plan (a value, as planned) plus what happened around
    it: what the run had to say before and after its commit (``later``, ``notes``)."""

    command: str
    tree: VllmTree
    plan: Plan
    options: RunOptions = field(default_factory=RunOptions)
    bytecode_removed: list[str] = field(default_factory=list)
    caches_removed: list[compiled.CacheResult] = field(default_factory=list)
    notes: list[Reason] = field(default_factory=list)
    later: list[Reason] = field(default_factory=list)  # warnings the plan could not know
    wrote: bool = False  # the run committed its writes to the tree
    recovered: bool = False  # it rolled an interrupted run back first
    runner: RunnerChoice | None = None  # the GPU model runner vLLM picks on the tree

    def __post_init__(self) -> None:
        if self.runner is None and self.tree.fs is not None:
            self.runner = model_runner.decide(self.tree.fs, os.environ.get(model_runner.ENV))

    @property
    def changed(self) -> bool:
        """Whether the run changed anything on disk (the tree, bytecode, caches)."""
        cleared = any(c.removed for c in self.caches_removed)
        return self.wrote or self.recovered or bool(self.bytecode_removed) or cleared

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.plan.steps

    @property
    def warnings(self) -> tuple[Reason, ...]:
        """The plan's warnings, then the run's own, each once."""
        return once([*self.plan.warnings, *self.later])

    def warn(self, reason: Reason) -> None:
        self.later.append(reason)

    def notices(self, step: Step) -> list[KnownIssue]:
        """The known issues to show under one patch: none on revert, none that a patch
        applied by the end of this run fixes."""
        if self.command == REVERT:
            return []
        fixed = {s.assessment.patch.id for s in self.steps if s.state_after == "applied"}
        return [n for n in step.assessment.notices if n.fixed_by not in fixed]


def state_of(tree: VllmTree, catalogue: Catalogue) -> State:
    """The tree's state, each entry checked against the diffs of the patch it names."""
    return load_state(tree.fs, catalogue.file_kinds)


@contextmanager
def _locked(tree: VllmTree, catalogue: Catalogue, notes: list[Reason]):
    """Lock the tree, hold signals, roll back an interrupted run, yield the state; tidy.

    A run refused before it wrote leaves ``.patchkit/`` as it found it, an interrupted
    run's leftovers included (its exit says nothing changed): those are swept just before
    the first write (:func:`_execute`) or by tidying after a run that succeeded. Only a
    roll-back, which stands and is said, is tidied after a refusal too.
    """
    with TreeLock(tree.fs) as lock, signals.held():
        try:
            notes.extend(recover(tree.fs, catalogue.file_kinds, tree.reinstall_facts))
            yield state_of(tree, catalogue)
        except BaseException:
            if notes:
                tidy(tree.fs, lock)
            raise
        tidy(tree.fs, lock)


def status(tree: VllmTree, catalogue: Catalogue) -> RunReport:
    """Assess every patch; reads files only."""
    state = state_of(tree, catalogue)
    report = RunReport(STATUS, tree, plan(STATUS, tree, catalogue, state, DEFAULTS))
    if catalogue.interrupted_note:
        report.warn(catalogue.interrupted_note)
    if interrupted(tree.fs):
        report.warn(Reason.of(Code.INTERRUPTED_RUN))
    return report


DEFAULTS = RunOptions()


def apply(
    tree: VllmTree, catalogue: Catalogue, options: RunOptions = DEFAULTS, prepare=None
) -> RunReport:
    """Apply what the plan says. ``prepare(plan)`` runs under the lock before any write
    (fork mode switches branch there); if it raises, nothing is written."""
    return _run(APPLY, tree, catalogue, options, prepare)


def revert(
    tree: VllmTree, catalogue: Catalogue, options: RunOptions = DEFAULTS, prepare=None
) -> RunReport:
    return _run(REVERT, tree, catalogue, options, prepare)


def _run(
    command: str, tree: VllmTree, catalogue: Catalogue, options: RunOptions, prepare
) -> RunReport:
    select(catalogue, options.only)  # an unknown id fails before anything else
    if options.dry_run:
        return _dry_run(command, tree, catalogue, options)
    if catalogue.interrupted_note:  # its diffs may be half one refresh's, half before it
        raise Refused(
            Reason.of(
                Code.REFUSED_HALF_WRITTEN_CATALOGUE,
                journal=catalogue.interrupted_note,
                command=command,
            )
        )
    notes: list[Reason] = []  # what rolling an interrupted run back did
    report = None
    try:
        with _locked(tree, catalogue, notes) as state:
            report = RunReport(command, tree, plan(command, tree, catalogue, state, options))
            report.options = options
            report.recovered = bool(notes)  # recover() says what it did, if anything
            if prepare is not None:
                prepare(report.plan)
            _execute(report, state)
    except LockUnavailable as exc:
        report = _read_only(command, tree, catalogue, options, exc)
    except (OSError, PatchkitError) as exc:  # after the commit: tidying .patchkit/, unlocking
        if report is None or not report.wrote:
            if notes:  # the roll-back of an interrupted run stands: the error must say so
                raise after_recovery(exc, notes, "accessing") from None
            raise
        report.warn(_after_commit(exc, "tidying up"))
    report.notes[:0] = [*notes, *report.plan.notes]
    if options.clear_caches:
        _clear_caches(report)
    return report


def _clear_caches(report: RunReport) -> None:
    """Clear the caches, or say why not: never an error, the run's work stands either way."""
    try:
        report.caches_removed = compiled.clear_caches(report.tree.root)
    except (OSError, PatchkitError) as exc:  # e.g. the working directory was deleted
        report.warn(Reason.of(Code.CACHES_LEFT_ALONE, why=_reason(exc, "the caches")))


def _after_commit(exc: Exception, doing: str, patch: str | None = None) -> Reason:
    """A failure after the tree changed: ``doing`` is "tidying up" or "removing the backups"
    (of ``patch``)."""
    return Reason.of(Code.AFTER_COMMIT, doing=doing, patch=patch, why=_reason(exc))


def _reason(exc: Exception, where: str = "the tree") -> str:
    if isinstance(exc, OSError):
        return os_error_line(exc, "accessing", path=where)
    return str(exc)


def _execute(report: RunReport, state: State) -> None:
    """Commit the plan's writes and state entries in one transaction, then remove stale bytecode."""
    planned = report.plan
    applied = planned.acting(Action.APPLIED)
    reverted = planned.acting(Action.REVERTED)
    if not (applied or reverted or planned.drop):
        return
    # an interrupted run's leftovers, before the state forgets what it reverts: their
    # backups are kept until the commit, to restore from should it fail
    sweep(state)
    for patch_id in [*planned.drop, *(s.assessment.patch.id for s in reverted)]:
        state.patches.pop(patch_id, None)
    backups = _record_applied(report.tree, state, applied)
    writes = planned.writes()
    commit(state, writes, backups)
    report.wrote = True
    for patch_id in [*(s.assessment.patch.id for s in reverted), *planned.drop]:
        if patch_id not in state.patches:
            try:
                state.fs.remove_tree(f"{STATE_DIR}/backups/{patch_id}", "state")
            except (OSError, PatchkitError) as exc:
                report.warn(_after_commit(exc, "removing the backups", patch_id))
    report.notes.extend(Reason.of(Code.DROPPED_STALE_ENTRY, patch=i) for i in planned.drop)
    removed, problems = bytecode.remove_bytecode(state.fs, [c.path for c in writes])
    report.bytecode_removed = removed
    for problem in problems:
        report.warn(problem)


def _record_applied(tree: VllmTree, state: State, steps: list[Step]) -> dict[str, bytes]:
    """Add an entry per applied patch to ``state``; return the backups to write.

    A backup that already holds the bytes (a patch replaced in place keeps its
    original) is not written again: a failed commit removes what it wrote.
    """
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    backups = {}
    for step in steps:
        patch_id, entries = step.assessment.patch.id, []
        for change in step.changes:
            backup = backup_path(patch_id, change.path) if change.before is not None else None
            kept = step.undo and backup and state.fs.read(f"{STATE_DIR}/{backup}", "state")
            if backup is not None and kept != change.before:
                backups[backup] = change.before
            before, after = file_sha256(change.before), file_sha256(change.after)
            entries.append(PatchedFile(change.path, before, after, backup))
        variant = step.assessment.variant
        state.patches[patch_id] = AppliedPatch(patch_id, variant.sha256, variant.name, now, entries)
    if steps:
        state.vllm_version = tree.version
    return backups


def _dry_run(command: str, tree: VllmTree, catalogue: Catalogue, options: RunOptions) -> RunReport:
    """Plan without the lock and write nothing (not the lock either); where the run could
    not make its lock, end as it would on that tree (:func:`_without_writing`)."""
    state = state_of(tree, catalogue)
    report = RunReport(command, tree, plan(command, tree, catalogue, state, options), options)
    if catalogue.interrupted_note:
        report.warn(catalogue.interrupted_note)
    if interrupted(tree.fs):
        report.warn(Reason.of(Code.INTERRUPTED_RUN_DRY))
    unwritable = lock_unavailable(tree.fs)
    if unwritable is not None:
        _without_writing(report, unwritable)
    return report


def _read_only(
    command: str, tree: VllmTree, catalogue: Catalogue, options: RunOptions, exc: LockUnavailable
) -> RunReport:
    state = state_of(tree, catalogue)
    report = RunReport(command, tree, plan(command, tree, catalogue, state, options), options)
    _without_writing(report, exc)
    return report


def _without_writing(report: RunReport, exc: LockUnavailable) -> None:
    """On a tree patchkit cannot write, succeed only if the run would write nothing."""
    acting = [s for s in report.steps if s.action != Action.NONE]
    if interrupted(report.tree.fs) or acting or report.plan.drop:
        raise Refused(Reason.of(Code.REFUSED_READ_ONLY, cause=exc.reason)) from None
    report.notes.append(Reason.of(Code.NOT_WRITABLE))
