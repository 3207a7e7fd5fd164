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
from patchkit.diffs.hunks import apply_file_patch
from patchkit.errors import HunkMismatch, PatchkitError
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


@dataclass
class Step:
    """One patch in a plan: its assessment before the run and what the run does to it."""

    assessment: Assessment
    action: Action = Action.NONE
    changes: list[FileChange] = field(default_factory=list)
    undo: list[FileChange] = field(default_factory=list)  # an older version taken off first
    note: str = ""  # why a patch asked for with --only is left as it is

    @property
    def state_after(self) -> PatchState:
        """The state status will report once the run is done."""
        if self.action in (Action.APPLIED, Action.WOULD_APPLY):
            return PatchState.APPLIED
        if self.action == Action.REVERTED:
            return PatchState.OPT_IN if self.assessment.patch.opt_in else PatchState.NEEDED
        return self.assessment.state


@dataclass
class Plan:
    command: str
    steps: list[Step] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)  # state entries that describe nothing any more
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def writes(self) -> list[FileChange]:
        """One write per file, merged in the order the changes were planned (revert: from
        the top of the series down; ``steps`` are in series order for the report)."""
        return merged([c for s in self.in_run_order() for c in (*s.undo, *s.changes)])

    def in_run_order(self) -> list[Step]:
        return list(reversed(self.steps)) if self.command == REVERT else self.steps

    def acting(self, action: Action) -> list[Step]:
        """The steps that do ``action``, in the order the run does them."""
        return [s for s in self.in_run_order() if s.action == action]

    def warn(self, line: str) -> None:
        if line not in self.warnings:  # e.g. "untested release", once, not per patch
            self.warnings.append(line)


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
    """The plan for ``status``, ``apply`` or ``revert`` on this tree and state."""
    result = Plan(command)
    if command == REVERT:
        _plan_revert(result, tree, catalogue, state, options)
    else:
        _plan_forward(result, tree, catalogue, state, options)
    for line in unknown_warnings(state, catalogue, tree):
        result.warn(line)
    _say_remedies(result, tree)
    if command == APPLY and options.strict and result.warnings:
        _fail_strict(result.warnings)
    return result


def _plan_forward(
    result: Plan, tree: VllmTree, catalogue: Catalogue, state: State, options: RunOptions
) -> None:
    """Status and apply: each patch on the result of those before it in the series.

    Every catalogue patch gets a step (one row set in status, apply and revert);
    apply acts only on those it selected, and reports the others as they are.
    """
    files = TreeFiles(tree, state, catalogue.ids)
    selected = [p.id for p in select(catalogue, options.only)]  # in series order
    moved: list[Assessment] = []  # changed-upstream patches the run would have to take
    for patch in catalogue.patches:
        assessment = assess_with(patch, tree, state, catalogue, files)
        step = Step(assessment)
        result.steps.append(step)
        if result.command == APPLY and patch.id not in selected:
            _left_alone(assessment)
            continue
        if result.command == APPLY and assessment.outdated and patch.id in options.only:
            _replace(step, tree, files, options)
        _take_findings(result, assessment)
        if result.command == STATUS:
            _status_step(step, files)
            continue
        if assessment.state == PatchState.CONFLICT:
            raise PatchkitError(
                f"{patch.id}: conflict: {assessment.reason}; nothing was changed "
                f"{_after_conflict(tree, catalogue)}"
            )
        if assessment.state == PatchState.CHANGED_UPSTREAM:
            moved.append(assessment)
            continue
        if assessment.state == PatchState.NEEDED:
            _refuse_under_later(patch, assessment, files)
            stack(files, assessment)
            step.action = Action.WOULD_APPLY if options.dry_run else Action.APPLIED
            step.changes = assessment.changes
        elif patch.id in options.only and assessment.state != PatchState.APPLIED:
            result.warn(
                f"{patch.id} was asked for with --only but is not applied: "
                f"{assessment.state} ({assessment.reason})"
            )
    if moved and result.command == APPLY:
        _refuse_moved(moved, result, tree)
    if result.command == APPLY:
        result.drop = stale_entries(state, catalogue, tree, selected)


def _refuse_moved(moved: list[Assessment], result: Plan, tree: VllmTree) -> None:
    """All or nothing: a run that would take a patch whose code vLLM changed applies
    nothing, and names the `apply --only` that applies the patches that still fit."""
    first = moved[0]
    others = f" (and {', '.join(a.patch.id for a in moved[1:])})" if moved[1:] else ""
    fit = [s.assessment.patch.id for s in result.steps if s.action != Action.NONE]
    target = f"--target {shlex.quote(str(tree.root))}"
    rest = (
        f"`patchkit apply {' '.join(f'--only {i}' for i in fit)} {target}` applies the "
        "patches that fit"
        if fit
        else f"no other patch it would take is needed here; `patchkit doctor {target}` says "
        "which known bugs stay unknown on this release until a patchkit that has decided it"
    )
    raise PatchkitError(
        f"{first.patch.id}: {PatchState.CHANGED_UPSTREAM}{others}: {first.reason}; nothing "
        f"was changed; {rest}"
    )


def _replace(step: Step, tree: VllmTree, files: TreeFiles, options: RunOptions) -> None:
    """`apply --only ID` on a patch applied from an older catalogue: the applied version
    off and the current one on, in the run's one commit (an upgrade, as dpkg does it;
    a revert then an apply would leave the tree without it if the second failed)."""
    assessment = step.assessment
    patch = assessment.patch
    above = later_on_same_files(patch, assessment.files, files)
    if above is not None:
        raise PatchkitError(
            f"{patch.id}: applied from an older catalogue, and {above[0]}, later in the "
            f"series, is applied on {above[1]}: revert it first (patchkit revert --only "
            f"{above[0]}); nothing was changed"
        )
    undo = revert_changes(assessment, files, force=False)
    current = assess_replacement(patch, tree, files.without(patch.id, undo))
    if current.state != PatchState.NEEDED:
        raise PatchkitError(
            f"{patch.id}: applied from an older catalogue, and the current one does not "
            f"apply to the original files ({current.state}: {current.reason}); nothing was "
            "changed"
        )
    assessment.warnings.remove(assessment.outdated)
    assessment.variant, assessment.placements = current.variant, current.placements
    assessment.reason = "replaced the version applied from an older catalogue"
    step.undo, step.changes = undo, current.changes
    step.action = Action.WOULD_APPLY if options.dry_run else Action.APPLIED
    for change in [*undo, *current.changes]:
        files.overlay(change.path, change.after)


def _after_conflict(tree: VllmTree, catalogue: Catalogue) -> str:
    """What to do next when apply refuses a conflict; on a release newer than the
    catalogue, that it is, and the three ways on."""
    newest = newer_than_catalogue(catalogue, tree.parsed_version)
    if not newest:
        return "(apply the others with --only)"
    target = f"--target {shlex.quote(str(tree.root))}"
    return (
        f"(vLLM {tree.version} is newer than every release this catalogue was tested on, "
        f"the newest {newest}: a newer patchkit may cover it; `patchkit status {target}` "
        f"shows which patches fit, `patchkit apply --only ID {target}` applies one at your "
        "own risk; CONTRIBUTING.md, 'A new vLLM release', says how to add the release)"
    )


# The states in which a plain `patchkit apply` refuses to run (apply --only the others).
BLOCKING = (PatchState.CONFLICT, PatchState.CHANGED_UPSTREAM)


def apply_command(states: dict[str, PatchState], opt_in: set[str], patch_id: str) -> str:
    """The apply that would run on a tree in ``states`` and apply ``patch_id``: plain
    `patchkit apply` unless a patch it would take is in a state that makes it refuse, then
    `patchkit apply --only ID`."""
    if any(s in BLOCKING for i, s in states.items() if i not in opt_in) or patch_id in opt_in:
        return f"patchkit apply --only {patch_id}"
    return "patchkit apply"


def _say_remedies(result: Plan, tree: VllmTree) -> None:
    """Each known issue's remedy, now that every patch's state is known (a command that
    would run on this tree)."""
    states = {s.assessment.patch.id: s.assessment.state for s in result.steps}
    opt_in = {s.assessment.patch.id for s in result.steps if s.assessment.patch.opt_in}
    for step in result.steps:
        a = step.assessment
        a.notices = [
            replace(n, remedy=remedy(n, a, tree, apply_command(states, opt_in, n.fixed_by)))
            for n in a.notices
        ]


def _status_step(step: Step, files: TreeFiles) -> None:
    """In status, a needed patch under an applied later one is said to be, not stacked."""
    assessment = step.assessment
    if assessment.state != PatchState.NEEDED:
        return
    if assessment.patch.opt_in:  # plain apply never applies it: not "needed"
        _say_opt_in(assessment)
        return
    above = later_on_same_files(assessment.patch, assessment.variant.paths, files)
    if above is None:
        stack(files, assessment)  # what apply would see for the next patch
    else:
        assessment.reason = (
            f"{above[0]}, later in the series, is applied on {above[1]}: revert it "
            "first (patches stack in series order)"
        )


def _left_alone(assessment: Assessment) -> None:
    """A patch this run did not select: reported as status would name it, never acted on,
    and its findings are not the run's (`--strict` judges what the run does)."""
    if assessment.patch.opt_in and assessment.state == PatchState.NEEDED:
        _say_opt_in(assessment)


def _say_opt_in(assessment: Assessment) -> None:
    """A needed opt-in patch is `opt-in`, in status and in revert alike (one name)."""
    assessment.state = PatchState.OPT_IN
    assessment.reason = (
        f"not applied; a diagnostic: after `patchkit apply`, `patchkit apply --only "
        f"{assessment.patch.id}` adds it (alone, it applies only itself)"
    )


def _refuse_under_later(patch: Patch, assessment: Assessment, files: TreeFiles) -> None:
    above = later_on_same_files(patch, assessment.variant.paths, files)
    if above is not None:
        raise PatchkitError(
            f"{patch.id}: {above[0]}, later in the series, is applied and also changes "
            f"{above[1]}; patches stack in series order, so revert it first "
            f"(patchkit revert --only {above[0]}), then apply both; nothing was changed"
        )


def _plan_revert(
    result: Plan, tree: VllmTree, catalogue: Catalogue, state: State, options: RunOptions
) -> None:
    """Revert: from the top of the series down, each patch on the files as the ones above
    it leave them."""
    unknown = [i for i, stale in unknown_entries(state, catalogue, tree).items() if not stale]
    if unknown and not options.only:
        raise PatchkitError(f"{unknown_line(state, unknown[0])}; nothing was changed")
    selected = [p.id for p in select(catalogue, options.only, opt_in=True)]
    result.drop = stale_entries(state, catalogue, tree, selected)
    for patch_id in result.drop:
        state.patches.pop(patch_id, None)
    files = TreeFiles(tree, state, catalogue.ids)
    for patch in reversed(catalogue.patches):
        assessment = assess_with(patch, tree, state, catalogue, files)
        step = Step(assessment)
        result.steps.insert(0, step)  # reported in series order, every patch
        if patch.id not in selected:
            _left_alone(assessment)  # as the reverts above it leave the files
            continue
        changes = revert_changes(assessment, files, force=options.force)
        if changes is None and patch.opt_in and assessment.state == PatchState.NEEDED:
            _say_opt_in(assessment)  # revert --only nan-probe said "needed" here
        if changes is None:
            if patch.id in options.only:
                result.warn(f"{patch.id} is not applied ({assessment.state})")
            continue
        above = later_on_same_files(patch, tuple(c.path for c in changes), files)
        if above is not None:
            raise PatchkitError(
                f"{patch.id}: {above[0]} is applied on top of it in {above[1]}; revert "
                f"{above[0]} first (patchkit revert --only {above[0]} --only {patch.id}); "
                "nothing was changed"
            )
        for change in changes:
            files.overlay(change.path, change.after)
        state.patches.pop(patch.id, None)
        step.action, step.changes = Action.REVERTED, changes


def _take_findings(result: Plan, assessment: Assessment) -> None:
    for line in assessment.warnings:
        result.warn(line)
    if assessment.stale_entry:
        result.notes.append(
            f"{assessment.patch.id}: state.json's record of it no longer matches the files "
            "(vLLM was reinstalled); the next apply or revert drops it"
        )


def _fail_strict(warnings: list[str]) -> None:
    n = len(warnings) - 1
    more = f" (and {n} more warning{'s' if n != 1 else ''})" if n > 0 else ""
    raise PatchkitError(f"--strict: {warnings[0]}{more}; nothing was changed")


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


def unknown_warnings(state: State, catalogue: Catalogue, tree: VllmTree) -> list[str]:
    entries = unknown_entries(state, catalogue, tree)
    return [unknown_line(state, patch_id) for patch_id, stale in entries.items() if not stale]


def unknown_line(state: State, patch_id: str) -> str:
    paths = ", ".join(f.path for f in state.patches[patch_id].files)
    return (
        f"{state.path} records patch {patch_id!r}, which this patchkit does not know; its "
        f"files ({paths}) still hold what it wrote and were left alone: revert it with the "
        "patchkit that applied it, or reinstall vLLM (pip install --force-reinstall "
        f"--no-deps vllm) and delete {state.directory}"
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
            raise PatchkitError(
                f"{assessment.patch.id}: conflict: {assessment.reason}; nothing was changed"
            )
        if kind == FileFinding.EDITED:
            _check_force(assessment, files, entry.path, force=force)
        changes.append(_restore(entry, files, assessment))
    return changes


def _check_force(assessment: Assessment, files: TreeFiles, path: str, *, force: bool) -> None:
    """An edited file is restored only with --force, and only to its own release's original."""
    patch_id = assessment.patch.id
    if not force:
        raise PatchkitError(
            f"{patch_id}: {assessment.reason.split(';')[0]}; revert refuses to overwrite those "
            "edits (--force restores the original anyway and discards them); nothing was changed"
        )
    refusal = force_refusal(files, path)
    if refusal:
        raise PatchkitError(
            f"{patch_id}: {files.tree.fs.full(path)} was edited and {refusal}; --force never "
            "restores a file of another release; nothing was changed"
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
        raise PatchkitError(
            f"{patch_id}: the backup of {applied.path} is missing or damaged and "
            "reverse-applying the diff does not give the original back; reinstall vLLM "
            f"(pip install --force-reinstall --no-deps vllm=={files.state.vllm_version}); "
            "nothing was changed"
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
