"""Plan a run: which patches apply or revert, with which writes, in both directions.

:func:`plan` assesses the selected patches (:mod:`patchkit.patching.assess`)
on the tree as the run would leave it, and returns one :class:`Plan`: per
patch its state before, the action, the file writes; the state entries to drop;
the warnings. Nothing is written here; :mod:`patchkit.patching.operations`
executes the plan. A plan that cannot be carried out safely (a conflict, a
patch under another, an edit without ``--force``) raises PatchkitError, so
nothing is ever half-planned.

Patches stack in series order, as quilt's do: apply assesses patch N on the
result of patches 1..N-1; revert takes them off from the top.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

from patchkit.catalogue.model import Catalogue, Patch
from patchkit.codes import Code, Reason
from patchkit.diffs.hunks import apply_file_patch
from patchkit.errors import HunkMismatch, Refused
from patchkit.patching.assess import (
    Assessment,
    TreeFiles,
    assess_replacement,
    assess_with,
    chain_finding,
    force_refusal,
    newer_than_catalogue,
    remedy,
)
from patchkit.patching.state import STATE_DIR, PatchedFile, State, file_sha256
from patchkit.patching.transaction import FileChange
from patchkit.vllmtree.tree import VllmTree
from patchkit.vocabulary import Action, FileFinding, PatchState

APPLY, REVERT, STATUS = "apply", "revert", "status"


@dataclass(frozen=True)
class RunOptions:
    """What the user asked a run to do (the CLI's options, in one place)."""

    only: tuple[str, ...] = ()
    dry_run: bool = False
    strict: bool = False
    force: bool = False
    clear_caches: bool = False


@dataclass(frozen=True)
class Step:
    """One patch in a plan: its assessment before the run and what the run does to it."""

    assessment: Assessment
    action: Action = Action.NONE
    changes: tuple[FileChange, ...] = ()
    undo: tuple[FileChange, ...] = ()  # an older version taken off first

    @property
    def state_after(self) -> PatchState:
        """The state status will report once the run is done."""
        if self.action in (Action.APPLIED, Action.WOULD_APPLY):
            return PatchState.APPLIED
        if self.action == Action.REVERTED:
            return PatchState.OPT_IN if self.assessment.patch.opt_in else PatchState.NEEDED
        return self.assessment.state


@dataclass(frozen=True)
class Plan:
    """What a run will do, whole: made once by :func:`plan`, never changed after."""

    command: str
    steps: tuple[Step, ...] = ()
    drop: tuple[str, ...] = ()  # state entries that describe nothing any more
    warnings: tuple[Reason, ...] = ()
    notes: tuple[Reason, ...] = ()

    def writes(self) -> list[FileChange]:
        """One write per file, merged in the order the changes were planned (revert: from
        the top of the series down; ``steps`` are in series order for the report)."""
        return merged([c for s in self.in_run_order() for c in (*s.undo, *s.changes)])

    def in_run_order(self) -> list[Step]:
        return list(reversed(self.steps)) if self.command == REVERT else list(self.steps)

    def acting(self, action: Action) -> list[Step]:
        """The steps that do ``action``, in the order the run does them."""
        return [s for s in self.in_run_order() if s.action == action]


@dataclass
class _Draft:
    """A plan while :func:`plan` makes it (steps in series order, each warning once)."""

    command: str
    steps: list[Step] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    warnings: list[Reason] = field(default_factory=list)
    notes: list[Reason] = field(default_factory=list)

    def warn(self, reason: Reason) -> None:
        if reason not in self.warnings:  # e.g. "untested release", once, not per patch
            self.warnings.append(reason)


def once(reasons) -> tuple[Reason, ...]:
    """``reasons`` in order, each once (the same warning from several patches)."""
    return tuple(dict.fromkeys(reasons))


def select(catalogue: Catalogue, only: tuple[str, ...], opt_in: bool = False) -> list[Patch]:
    """The patches named by --only, in series order; without --only every patch except
    the opt-in ones (diagnostics), unless ``opt_in`` (revert takes them off too)."""
    for patch_id in only:
        catalogue.get(patch_id)  # raises on an unknown id
    if only:
        return [p for p in catalogue.patches if p.id in only]
    return [p for p in catalogue.patches if opt_in or not p.opt_in]


def plan(
    command: str, tree: VllmTree, catalogue: Catalogue, state: State, options: RunOptions
) -> Plan:
    """The plan for ``status``, ``apply`` or ``revert`` on this tree and state (``state``
    is read, never changed: the run's executor changes it when it commits)."""
    draft = _Draft(command)
    if command == REVERT:
        _plan_revert(draft, tree, catalogue, state, options)
    else:
        _plan_forward(draft, tree, catalogue, state, options)
    for reason in unknown_warnings(state, catalogue, tree):
        draft.warn(reason)
    if command == APPLY and options.strict and draft.warnings:
        _fail_strict(draft.warnings)
    return Plan(
        command,
        tuple(_with_remedies(draft.steps, tree)),
        tuple(draft.drop),
        tuple(draft.warnings),
        tuple(draft.notes),
    )


def _plan_forward(
    result: _Draft, tree: VllmTree, catalogue: Catalogue, state: State, options: RunOptions
) -> None:
    """Status and apply: each patch on the result of those before it in the series.

    Every catalogue patch gets a step (one row set in status, apply and revert);
    apply acts only on those it selected, and reports the others as they are.
    """
    files = TreeFiles(tree, state, catalogue.ids)
    selected = [p.id for p in select(catalogue, options.only)]  # in series order
    moved: list[Assessment] = []  # changed-upstream patches the run would have to take
    conflict: Assessment | None = None  # the first: refused once the others are planned
    acting = Action.WOULD_APPLY if options.dry_run else Action.APPLIED
    for patch in catalogue.patches:
        try:
            assessment = assess_with(patch, tree, state, catalogue, files)
            if result.command == APPLY and patch.id not in selected:
                result.steps.append(Step(_left_alone(assessment)))
                continue
            if result.command == APPLY and assessment.outdated and patch.id in options.only:
                step = _replace(assessment, tree, files, acting)
                assessment = step.assessment
            else:
                step = Step(assessment)
            _take_findings(result, assessment)
            if result.command == STATUS:
                result.steps.append(_status_step(assessment, files))
                continue
            result.steps.append(step)
            if assessment.state == PatchState.CONFLICT:
                conflict = conflict or assessment
                continue
            if assessment.state == PatchState.CHANGED_UPSTREAM:
                moved.append(assessment)
                continue
            if assessment.state == PatchState.NEEDED:
                _refuse_under_later(patch, assessment, files)
                stack(files, assessment)
                result.steps[-1] = Step(assessment, acting, assessment.changes)
            elif patch.id in options.only and assessment.state != PatchState.APPLIED:
                result.warn(
                    Reason.of(
                        Code.ONLY_NOT_APPLIED,
                        patch=patch.id,
                        state=str(assessment.state),
                        reason=assessment.reason,
                    )
                )
        except Refused:
            if conflict is None:
                raise
            # after a conflict, a patch refused on its own is left out of the others too
    if conflict is not None:
        raise Refused(_conflict_refusal(conflict, tree, catalogue, _acting(result)))
    if moved and result.command == APPLY:
        _refuse_moved(moved, result, tree)
    if result.command == APPLY:
        result.drop = stale_entries(state, catalogue, tree, selected)


def _acting(result: _Draft) -> list[str]:
    """The patches the run would apply, in series order."""
    return [s.assessment.patch.id for s in result.steps if s.action != Action.NONE]


def _conflict_refusal(
    assessment: Assessment, tree: VllmTree, catalogue: Catalogue, fit: list[str]
) -> Reason:
    """apply refuses a conflict, naming the ways on: ``fit``, the patches an ``apply
    --only`` of them would apply (planned on after the conflict, as that run would), and
    ``reinstall`` where reinstalling vLLM makes the files its own again (a pip install);
    on a release newer than the catalogue the words say that it is (``newest``)."""
    return Reason.of(
        Code.REFUSED_CONFLICT,
        patch=assessment.patch.id,
        conflict=assessment.reason,
        version=tree.version,
        newest=newer_than_catalogue(catalogue, tree.parsed_version) or None,
        target=shlex.quote(str(tree.root)),
        fit=fit,
        reinstall=tree.source == "metadata",
        **tree.reinstall_facts,
    )


def _refuse_moved(moved: list[Assessment], result: _Draft, tree: VllmTree) -> None:
    """All or nothing: a run that would take a patch whose code vLLM changed applies
    nothing, and names the `apply --only` that applies the patches that still fit."""
    first = moved[0]
    raise Refused(
        Reason.of(
            Code.REFUSED_CHANGED_UPSTREAM,
            patch=first.patch.id,
            others=[a.patch.id for a in moved[1:]],
            moved=first.reason,
            fit=_acting(result),
            target=shlex.quote(str(tree.root)),
        )
    )


def _replace(assessment: Assessment, tree: VllmTree, files: TreeFiles, acting: Action) -> Step:
    """`apply --only ID` on a patch applied from an older catalogue: the applied version
    off and the current one on, in the run's one commit (an upgrade, as dpkg does it;
    a revert then an apply would leave the tree without it if the second failed)."""
    patch = assessment.patch
    above = later_on_same_files(patch, assessment.files, files)
    if above is not None:
        raise Refused(
            Reason.of(
                Code.REFUSED_REPLACE_UNDER_LATER, patch=patch.id, above=above[0], path=above[1]
            )
        )
    undo = revert_changes(assessment, files, force=False)
    current = assess_replacement(patch, tree, files.without(patch.id, undo))
    if current.state != PatchState.NEEDED:
        raise Refused(
            Reason.of(
                Code.REFUSED_REPLACE_DOES_NOT_APPLY,
                patch=patch.id,
                state=str(current.state),
                reason=current.reason,
            )
        )
    replaced = replace(
        assessment,
        warnings=tuple(w for w in assessment.warnings if w.code != Code.OUTDATED),
        variant=current.variant,
        placements=current.placements,
        reason=Reason.of(Code.REPLACED),
    )
    for change in [*undo, *current.changes]:
        files.overlay(change.path, change.after)
    return Step(replaced, acting, current.changes, tuple(undo))


# The states in which a plain `patchkit apply` refuses to run (apply --only the others).
BLOCKING = (PatchState.CONFLICT, PatchState.CHANGED_UPSTREAM)


def apply_command(states: dict[str, PatchState], opt_in: set[str], patch_id: str) -> str:
    """The apply that would run on a tree in ``states`` and apply ``patch_id``: plain
    `patchkit apply` unless a patch it would take is in a state that makes it refuse, then
    `patchkit apply --only ID`."""
    if any(s in BLOCKING for i, s in states.items() if i not in opt_in) or patch_id in opt_in:
        return f"patchkit apply --only {patch_id}"
    return "patchkit apply"


def _with_remedies(steps: list[Step], tree: VllmTree) -> list[Step]:
    """Each known issue with its remedy, now that every patch's state is known (a command
    that would run on this tree)."""
    states = {s.assessment.patch.id: s.assessment.state for s in steps}
    opt_in = {s.assessment.patch.id for s in steps if s.assessment.patch.opt_in}
    done = []
    for step in steps:
        a = step.assessment
        notices = tuple(
            replace(n, remedy=remedy(n, a, tree, apply_command(states, opt_in, n.fixed_by)))
            for n in a.notices
        )
        done.append(replace(step, assessment=replace(a, notices=notices)))
    return done


def _status_step(assessment: Assessment, files: TreeFiles) -> Step:
    """In status, a needed patch under an applied later one is said to be, not stacked."""
    if assessment.state != PatchState.NEEDED:
        return Step(assessment)
    if assessment.patch.opt_in:  # plain apply never applies it: not "needed"
        return Step(_opt_in(assessment))
    above = later_on_same_files(assessment.patch, assessment.variant.paths, files)
    if above is None:
        stack(files, assessment)  # what apply would see for the next patch
        return Step(assessment)
    under = Reason.of(Code.UNDER_LATER_PATCH, above=above[0], path=above[1])
    return Step(replace(assessment, reason=under))


def _left_alone(assessment: Assessment) -> Assessment:
    """A patch this run did not select: reported as status would name it, never acted on,
    and its findings are not the run's (`--strict` judges what the run does)."""
    if assessment.patch.opt_in and assessment.state == PatchState.NEEDED:
        return _opt_in(assessment)
    return assessment


def _opt_in(assessment: Assessment) -> Assessment:
    """A needed opt-in patch is `opt-in`, in status and in revert alike (one name)."""
    why = Reason.of(Code.OPT_IN, patch=assessment.patch.id)
    return replace(assessment, state=PatchState.OPT_IN, reason=why)


def _refuse_under_later(patch: Patch, assessment: Assessment, files: TreeFiles) -> None:
    above = later_on_same_files(patch, assessment.variant.paths, files)
    if above is not None:
        raise Refused(
            Reason.of(Code.REFUSED_UNDER_LATER, patch=patch.id, above=above[0], path=above[1])
        )


def _plan_revert(
    result: _Draft, tree: VllmTree, catalogue: Catalogue, state: State, options: RunOptions
) -> None:
    """Revert: from the top of the series down, each patch on the files as the ones above
    it leave them (a copy of ``state`` follows them: the caller's is never changed)."""
    unknown = [i for i, stale in unknown_entries(state, catalogue, tree).items() if not stale]
    if unknown and not options.only:
        entry = unknown_line(state, unknown[0], tree)
        raise Refused(Reason.of(Code.REFUSED_UNKNOWN_ENTRY, entry=entry))
    selected = [p.id for p in select(catalogue, options.only, opt_in=True)]
    result.drop = stale_entries(state, catalogue, tree, selected)
    kept = {k: v for k, v in state.patches.items() if k not in result.drop}
    state = State(state.fs, kept, state.vllm_version)
    files = TreeFiles(tree, state, catalogue.ids)
    for patch in reversed(catalogue.patches):
        assessment = assess_with(patch, tree, state, catalogue, files)
        if patch.id not in selected:
            result.steps.insert(0, Step(_left_alone(assessment)))  # as the reverts above leave
            continue
        changes = revert_changes(assessment, files, force=options.force)
        if changes is None and patch.opt_in and assessment.state == PatchState.NEEDED:
            assessment = _opt_in(assessment)  # revert --only nan-probe said "needed" here
        if changes is None:
            result.steps.insert(0, Step(assessment))  # reported in series order, every patch
            if patch.id in options.only:
                result.warn(
                    Reason.of(Code.NOT_APPLIED, patch=patch.id, state=str(assessment.state))
                )
            continue
        above = later_on_same_files(patch, tuple(c.path for c in changes), files)
        if above is not None:
            raise Refused(
                Reason.of(Code.REFUSED_REVERT_UNDER, patch=patch.id, above=above[0], path=above[1])
            )
        for change in changes:
            files.overlay(change.path, change.after)
        state.patches.pop(patch.id, None)  # the copy: the patches above see it gone
        result.steps.insert(0, Step(assessment, Action.REVERTED, tuple(changes)))


def _take_findings(result: _Draft, assessment: Assessment) -> None:
    for reason in assessment.warnings:
        result.warn(reason)
    if assessment.stale_entry:
        result.notes.append(Reason.of(Code.STALE_ENTRY, patch=assessment.patch.id))


def _fail_strict(warnings: list[Reason]) -> None:
    raise Refused(Reason.of(Code.REFUSED_STRICT, first=warnings[0], more=len(warnings) - 1))


# ----- stacking -----


def stack(files: TreeFiles, assessment: Assessment) -> None:
    """Put a needed patch's result in place, so the next patch is assessed on top of it."""
    for change in assessment.changes:
        files.overlay(change.path, change.after)


def merged(changes: list[FileChange]) -> list[FileChange]:
    """One write per file: the first change's before, the last change's after, every patch."""
    by_path: dict[str, FileChange] = {}
    for change in changes:
        first = by_path.get(change.path, change)
        patches = tuple(dict.fromkeys(first.patches + change.patches))
        by_path[change.path] = FileChange(change.path, first.before, change.after, patches)
    return [c for c in by_path.values() if c.before != c.after]


def later_on_same_files(
    patch: Patch, paths: tuple[str, ...], files: TreeFiles
) -> tuple[str, str] | None:
    """(patch id, file) of an applied patch later in the series that touches one of ``paths``.

    A stale state entry (vLLM reinstalled under it) does not count: nothing of it is there.
    A recorded patch this catalogue lacks counts as later than every one it has
    (the chain order puts it there): nothing goes back under it.
    """
    later = files.order[files.order.index(patch.id) + 1 :] if patch.id in files.order else ()
    unknown = sorted(set(files.state.patches) - set(files.order)) if files.state else []
    for other in [*later, *unknown]:
        applied = files.state.patches.get(other)
        for path in (f.path for f in applied.files) if applied else ():
            if path in paths and chain_finding(files, path)[0] != FileFinding.STALE:
                return other, path
    return None


# ----- state entries that describe nothing, and entries of patches this catalogue lacks -----


def entry_is_stale(state: State, patch_id: str, files: TreeFiles) -> bool:
    return all(
        chain_finding(files, f.path)[0] == FileFinding.STALE for f in state.patches[patch_id].files
    )


def unknown_entries(state: State, catalogue: Catalogue, tree: VllmTree) -> dict[str, bool]:
    """Recorded patches this catalogue lacks: id -> whether all its files are stale on disk."""
    files = TreeFiles(tree, state, catalogue.ids)
    return {
        patch_id: entry_is_stale(state, patch_id, files)
        for patch_id in state.patches
        if patch_id not in catalogue.ids
    }


def unknown_warnings(state: State, catalogue: Catalogue, tree: VllmTree) -> list[Reason]:
    entries = unknown_entries(state, catalogue, tree)
    return [unknown_line(state, patch_id, tree) for patch_id, stale in entries.items() if not stale]


def unknown_line(state: State, patch_id: str, tree: VllmTree) -> Reason:
    return Reason.of(
        Code.UNKNOWN_ENTRY,
        state=str(state.path),
        patch=patch_id,
        paths=[f.path for f in state.patches[patch_id].files],
        directory=str(state.directory),
        **tree.reinstall_facts,
    )


def stale_entries(state: State, catalogue: Catalogue, tree: VllmTree, ids: list[str]) -> list[str]:
    """State entries among ``ids`` (and of unknown patches) that describe nothing on disk any more.

    Judged on the files as they are on disk (a fresh view, without planned writes).
    """
    files = TreeFiles(tree, state, catalogue.ids)
    stale = [i for i in ids if i in state.patches and entry_is_stale(state, i, files)]
    unknown = unknown_entries(state, catalogue, tree)
    return stale + [i for i, is_stale in unknown.items() if is_stale]


# ----- what undoes a patch -----


def revert_changes(
    assessment: Assessment, files: TreeFiles, *, force: bool
) -> list[FileChange] | None:
    """The writes that undo one patch; None when it is not applied.

    Per file: one its patch left as it wrote it gets its original back; one
    already back to its original (or a created file that is gone) is left;
    an edited one only with ``--force`` and only to the original of the
    release installed now; one of another release never.
    """
    applied = assessment.entry
    if applied is None or assessment.stale_entry:
        if assessment.state == PatchState.APPLIED:  # applied by hand, or without .patchkit/
            return _reverse_apply(assessment, files)
        return None
    changes = []
    for entry in applied.files:
        kind, _ = chain_finding(files, entry.path)
        if kind == FileFinding.STALE:
            continue
        if kind == FileFinding.FOREIGN:
            raise Refused(
                Reason.of(
                    Code.REFUSED_REVERT_CONFLICT,
                    patch=assessment.patch.id,
                    conflict=assessment.reason,
                )
            )
        if kind == FileFinding.EDITED:
            _check_force(assessment, files, entry.path, force=force)
        changes.append(_restore(entry, files, assessment))
    return changes


def _check_force(assessment: Assessment, files: TreeFiles, path: str, *, force: bool) -> None:
    """An edited file is restored only with --force, and only to its own release's original."""
    patch_id = assessment.patch.id
    if not force:
        raise Refused(Reason.of(Code.REFUSED_EDITED, patch=patch_id, conflict=assessment.reason))
    refusal = force_refusal(files, path)
    if refusal:
        raise Refused(
            Reason.of(
                Code.REFUSED_FORCE,
                patch=patch_id,
                path=str(files.tree.fs.full(path)),
                refusal=refusal,
            )
        )


def _restore(applied: PatchedFile, files: TreeFiles, assessment: Assessment) -> FileChange:
    """The write that puts one file back to before the patch (from its backup, or rebuilt)."""
    current = files.data(applied.path)
    patch_id = assessment.patch.id
    if applied.pre_sha256 is None:
        return FileChange(applied.path, current, None, (patch_id,))  # the patch created it
    original = files.tree.fs.read(f"{STATE_DIR}/{applied.backup}", str(files.state.path))
    if original is not None and file_sha256(original) == applied.pre_sha256:
        return FileChange(applied.path, current, original, (patch_id,))
    rebuilt = _reverse_one(assessment, applied.path, files)
    if rebuilt is None or file_sha256(rebuilt) != applied.pre_sha256:
        raise Refused(
            Reason.of(
                Code.REFUSED_BACKUP_DAMAGED,
                patch=patch_id,
                path=applied.path,
                version=files.state.vllm_version,
                **files.tree.reinstall_facts,
            )
        )
    return FileChange(applied.path, current, rebuilt, (patch_id,))


def _reverse_apply(assessment: Assessment, files: TreeFiles) -> list[FileChange]:
    changes = []
    for path in assessment.variant.paths:
        rebuilt = _reverse_one(assessment, path, files)
        changes.append(FileChange(path, files.data(path), rebuilt, (assessment.patch.id,)))
    return changes


def _reverse_one(assessment: Assessment, path: str, files: TreeFiles) -> bytes | None:
    """The file with the variant's hunks for ``path`` undone; None if they do not match."""
    variant = assessment.variant
    file_patch = next((f for f in variant.files if f.path == path), None) if variant else None
    if file_patch is None:
        return None
    try:
        text, _ = apply_file_patch(files.text(path), file_patch.reversed())
    except HunkMismatch:
        return None
    return None if text is None else text.encode("utf-8", errors="surrogateescape")
