"""apply and revert: assess every selected patch, then write all of it or none.

Nothing is written until every selected patch has been checked: a conflict,
or any warning under ``--strict``, stops the run with the tree untouched.
While a run holds the tree's lock, Ctrl-C and SIGTERM are held
(:mod:`patchkit.engine.signals`): they take effect when the run has finished the
step it was in, never between a write and its record.

What a run may restore is decided per file (:func:`patchkit.engine.decide.chain_finding`):
a backup goes only over the bytes its patch left there, or, with
``--force``, over an edited file of the same release; never over a file of
another release. Records that no longer describe the files (vLLM was
reinstalled) are dropped, not acted on.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone

from patchkit.catalogue.load import Catalogue, Patch
from patchkit.engine import bytecode, signals
from patchkit.engine.decide import (
    APPLIED,
    CONFLICT,
    EDITED,
    FOREIGN,
    NEEDED,
    STALE,
    Assessment,
    TreeFiles,
    assess_with,
    chain_finding,
    force_refusal,
)
from patchkit.engine.hunks import apply_file_patch
from patchkit.engine.state import (
    STATE_DIR,
    FileRecord,
    PatchRecord,
    State,
    backup_path,
    load_state,
    sweep,
    tidy,
)
from patchkit.engine.transaction import (
    FileChange,
    LockUnavailable,
    TreeLock,
    commit,
    interrupted,
    recover,
)
from patchkit.errors import HunkMismatch, PatchkitError
from patchkit.target import caches
from patchkit.target.tree import VllmTree, sha256_bytes


@dataclass
class Outcome:
    """What a run did (or would do) with one patch."""

    assessment: Assessment
    action: str  # applied, would-apply, already-applied, skipped, reverted, not-applied

    def to_json(self) -> dict:
        data = self.assessment.to_json()
        data["action"] = self.action
        data["hunks"] = [
            {"file": p.path, "hunk": p.hunk, "line": p.line, "offset": p.offset}
            for p in self.assessment.placements
        ]
        return data


@dataclass
class RunReport:
    command: str
    tree: VllmTree
    outcomes: list[Outcome] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # known bugs; never fail --strict
    notes: list[str] = field(default_factory=list)
    bytecode_removed: list[str] = field(default_factory=list)
    caches_removed: list[dict] = field(default_factory=list)
    dry_run: bool = False

    def take_findings(self, assessment: Assessment) -> None:
        """Carry an assessment's warnings and known-bug notices into the report."""
        for line in assessment.warnings:
            if line not in self.warnings:  # e.g. "untested release", once, not per patch
                self.warnings.append(line)
        for line in assessment.notices:
            if line not in self.notices:
                self.notices.append(line)

    def to_json(self) -> dict:
        return {
            "ok": True,
            "command": self.command,
            "vllm": self.tree.describe(),
            "dry_run": self.dry_run,
            "patches": [o.to_json() for o in self.outcomes],
            "warnings": self.warnings,
            "notices": self.notices,
            "notes": self.notes,
            "bytecode_removed": self.bytecode_removed,
            "caches_removed": self.caches_removed,
        }


def state_of(tree: VllmTree, catalogue: Catalogue) -> State:
    """The tree's state, each entry checked against the diffs of the patch it names."""
    return load_state(tree.fs, catalogue.file_kinds)


@contextmanager
def _locked(tree: VllmTree, report: RunReport, catalogue: Catalogue):
    """Lock the tree, hold signals, roll back an interrupted run, yield the state; tidy."""
    with TreeLock(tree.fs) as lock, signals.held():
        try:
            report.notes.extend(recover(tree.fs, catalogue.file_kinds))
            state = state_of(tree, catalogue)
            sweep(state)
            yield state
        finally:
            tidy(tree.fs, lock)


def select(catalogue: Catalogue, only: tuple[str, ...]) -> list[Patch]:
    """The patches named by --only (all when empty), in series order."""
    for patch_id in only:
        catalogue.get(patch_id)  # raises on an unknown id
    return [p for p in catalogue.patches if not only or p.id in only]


def status(tree: VllmTree, catalogue: Catalogue) -> RunReport:
    """Assess every patch; reads files only."""
    state = state_of(tree, catalogue)
    report = RunReport("status", tree)
    if interrupted(tree.fs):
        report.warnings.append(
            "an earlier patchkit run was interrupted while writing; the next "
            "`patchkit apply` or `patchkit revert` rolls it back"
        )
    files = tree_files(tree, state, catalogue)
    for patch in catalogue.patches:
        assessment = assess_with(patch, tree, state, catalogue, files)
        if assessment.state == NEEDED:
            above = later_on_same_files(patch, assessment.variant.paths, files)
            if above is not None:
                assessment.reason = (
                    f"{above[0]}, later in the series, is applied on {above[1]}: revert it "
                    "first (patches stack in series order)"
                )
            else:
                stack(files, assessment)  # what apply would see for the next patch
        report.outcomes.append(Outcome(assessment, assessment.state))
        report.take_findings(assessment)
        _note_stale(report, assessment)
    report.warnings.extend(_unknown_warnings(state, catalogue, tree))
    return report


def tree_files(tree: VllmTree, state: State, catalogue: Catalogue) -> TreeFiles:
    return TreeFiles(tree, state, catalogue.ids)


def stack(files: TreeFiles, assessment: Assessment) -> None:
    """Put a needed patch's result in place, so the next patch is assessed on top of it."""
    if assessment.state == NEEDED:
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

    A stale record (vLLM reinstalled under it) does not count: nothing of it is there.
    """
    later = files.order[files.order.index(patch.id) + 1 :] if patch.id in files.order else ()
    for other in later:
        record = files.state.patches.get(other)
        for path in (f.path for f in record.files) if record else ():
            if path in paths and chain_finding(files, path)[0] != STALE:
                return other, path
    return None


def _note_stale(report: RunReport, assessment: Assessment) -> None:
    if assessment.stale_record:
        report.notes.append(
            f"{assessment.patch.id}: state.json's record of it no longer matches the files "
            "(vLLM was reinstalled); the next apply or revert drops it"
        )


def _unknown_records(state: State, catalogue: Catalogue, tree: VllmTree) -> dict[str, bool]:
    """Recorded patches this catalogue lacks: id -> whether all its files are stale on disk."""
    files = tree_files(tree, state, catalogue)
    return {
        patch_id: _record_is_stale(state, patch_id, files)
        for patch_id in state.patches
        if patch_id not in catalogue.ids
    }


def _unknown_warnings(state: State, catalogue: Catalogue, tree: VllmTree) -> list[str]:
    return [
        _unknown_line(state, patch_id)
        for patch_id, stale in _unknown_records(state, catalogue, tree).items()
        if not stale
    ]


def _unknown_line(state: State, patch_id: str) -> str:
    paths = ", ".join(f.path for f in state.patches[patch_id].files)
    return (
        f"{state.path} records patch {patch_id!r}, which this patchkit does not know; its "
        f"files ({paths}) still hold what it wrote and were left alone: revert it with the "
        "patchkit that applied it, or reinstall vLLM (pip install --force-reinstall "
        f"--no-deps vllm) and delete {state.directory}"
    )


def _drop_stale(state: State, catalogue: Catalogue, tree: VllmTree, ids: list[str]) -> list[str]:
    """Forget records that describe nothing on disk any more; returns the notes to print.

    Judged on the files as they are on disk (a fresh view, without this
    run's planned writes).
    """
    files = tree_files(tree, state, catalogue)
    unknown = _unknown_records(state, catalogue, tree)
    stale = [i for i in ids if i in state.patches and _record_is_stale(state, i, files)]
    stale += [i for i, is_stale in unknown.items() if is_stale]
    for patch_id in stale:
        state.patches.pop(patch_id)
    return [f"dropped the stale record of {i} (vLLM was reinstalled since)" for i in stale]


def _record_is_stale(state: State, patch_id: str, files: TreeFiles) -> bool:
    return all(chain_finding(files, f.path)[0] == STALE for f in state.patches[patch_id].files)


def apply(
    tree: VllmTree,
    catalogue: Catalogue,
    only: tuple[str, ...] = (),
    dry_run: bool = False,
    strict: bool = False,
    clear_caches: bool = False,
) -> RunReport:
    report = RunReport("apply", tree, dry_run=dry_run)
    patches = select(catalogue, only)
    if dry_run:
        state = state_of(tree, catalogue)
        return _plan_apply(report, tree, catalogue, patches, only, strict, state)
    try:
        with _locked(tree, report, catalogue) as state:
            _plan_apply(report, tree, catalogue, patches, only, strict, state)
            needed = [o.assessment for o in report.outcomes if o.action == "applied"]
            stale_notes = _drop_stale(state, catalogue, tree, [p.id for p in patches])
            if needed or stale_notes:
                _commit_apply(tree, state, needed)
                report.notes.extend(stale_notes)
            if needed:
                _remove_bytecode(report, tree, [c.path for a in needed for c in a.changes])
                remaining = status(tree, catalogue).notices  # known issues this run fixed go
                report.notices = [n for n in report.notices if n in remaining]
    except LockUnavailable as exc:
        report = RunReport("apply", tree)
        _plan_apply(report, tree, catalogue, patches, only, strict, state_of(tree, catalogue))
        _nothing_to_write(report, exc, ("applied",))
    if clear_caches:
        report.caches_removed = caches.clear_caches(tree.root)
    return report


def _remove_bytecode(report: RunReport, tree: VllmTree, paths: list[str]) -> None:
    """After the commit: stale bytecode goes; a failure here is a warning, not a rollback."""
    removed, problems = bytecode.remove_bytecode(tree.fs, paths)
    report.bytecode_removed = removed
    report.warnings.extend(problems)


def _nothing_to_write(report: RunReport, exc: LockUnavailable, writing: tuple[str, ...]) -> None:
    """On a tree patchkit cannot write, succeed only if the run would write nothing."""
    if interrupted(report.tree.fs) or any(o.action in writing for o in report.outcomes):
        raise PatchkitError(f"{exc}; nothing was changed") from None
    report.notes.append("the tree is not writable, and nothing needed writing")


def _plan_apply(
    report: RunReport,
    tree: VllmTree,
    catalogue: Catalogue,
    patches: list[Patch],
    only: tuple[str, ...],
    strict: bool,
    state: State,
) -> RunReport:
    files = tree_files(tree, state, catalogue)
    if report.dry_run and interrupted(tree.fs):
        report.warnings.append("an interrupted run will be rolled back first by a real apply")
    for patch in patches:
        assessment = assess_with(patch, tree, state, catalogue, files)
        report.take_findings(assessment)
        _note_stale(report, assessment)
        if assessment.state == CONFLICT:
            raise PatchkitError(
                f"{patch.id}: conflict: {assessment.reason}; nothing was changed "
                f"(apply the others with --only)"
            )
        if assessment.state == NEEDED:
            above = later_on_same_files(patch, assessment.variant.paths, files)
            if above is not None:
                raise PatchkitError(
                    f"{patch.id}: {above[0]}, later in the series, is applied and also changes "
                    f"{above[1]}; patches stack in series order, so revert it first "
                    f"(patchkit revert --only {above[0]}), then apply both; nothing was changed"
                )
            stack(files, assessment)
        action = {
            NEEDED: "would-apply" if report.dry_run else "applied",
            APPLIED: "already-applied",
        }
        report.outcomes.append(Outcome(assessment, action.get(assessment.state, "skipped")))
        if patch.id in only and assessment.state not in (NEEDED, APPLIED):
            report.warnings.append(
                f"{patch.id} was asked for with --only but is not applied: "
                f"{assessment.state} ({assessment.reason})"
            )
    report.warnings.extend(_unknown_warnings(state, catalogue, tree))
    _fail_if_strict(report, strict)
    return report


def _fail_if_strict(report: RunReport, strict: bool) -> None:
    if strict and report.warnings:
        count = len(report.warnings)
        raise PatchkitError(
            f"--strict: {report.warnings[0]}"
            + (f" (and {count - 1} more warnings)" if count > 1 else "")
            + "; nothing was changed"
        )


def _commit_apply(tree: VllmTree, state: State, needed: list[Assessment]) -> None:
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    backups = {}
    for assessment in needed:
        patch_id = assessment.patch.id
        records = []
        for change in assessment.changes:
            backup = None
            if change.before is not None:
                backup = backup_path(patch_id, change.path)
                backups[backup] = change.before
            records.append(
                FileRecord(
                    path=change.path,
                    pre_sha256=_sha(change.before),
                    post_sha256=_sha(change.after),
                    backup=backup,
                )
            )
        state.patches[patch_id] = PatchRecord(
            id=patch_id,
            patch_sha256=assessment.variant.sha256,
            variant=assessment.variant.name,
            applied_at=now,
            files=records,
        )
    if needed:
        state.vllm_version = tree.version
    changes = merged([c for a in needed for c in a.changes])
    commit(state, changes, backups)


def revert(
    tree: VllmTree,
    catalogue: Catalogue,
    only: tuple[str, ...] = (),
    force: bool = False,
    clear_caches: bool = False,
) -> RunReport:
    report = RunReport("revert", tree)
    patches = list(reversed(select(catalogue, only)))
    try:
        with _locked(tree, report, catalogue) as state:
            _revert_locked(report, tree, catalogue, patches, only, force, state)
    except LockUnavailable as exc:
        report = status(tree, catalogue)
        report.command = "revert"
        report.outcomes = [o for o in report.outcomes if not only or o.assessment.patch.id in only]
        _nothing_to_write(report, exc, (APPLIED, CONFLICT))
        for outcome in report.outcomes:
            outcome.action = "not-applied"
    if clear_caches:
        report.caches_removed = caches.clear_caches(tree.root)
    return report


def _revert_locked(
    report: RunReport,
    tree: VllmTree,
    catalogue: Catalogue,
    patches: list[Patch],
    only: tuple[str, ...],
    force: bool,
    state: State,
) -> None:
    unknown = [i for i, stale in _unknown_records(state, catalogue, tree).items() if not stale]
    if unknown and not only:
        raise PatchkitError(f"{_unknown_line(state, unknown[0])}; nothing was changed")
    stale_notes = _drop_stale(state, catalogue, tree, [p.id for p in patches])
    files = tree_files(tree, state, catalogue)
    changes: list[FileChange] = []
    for patch in patches:  # last in the series first: a stack comes off from the top
        assessment = assess_with(patch, tree, state, catalogue, files)
        report.take_findings(assessment)
        patch_changes = _revert_changes(assessment, files, force)
        if patch_changes is None:
            report.outcomes.append(Outcome(assessment, "not-applied"))
            if patch.id in only:
                report.warnings.append(f"{patch.id} is not applied ({assessment.state})")
            continue
        paths = tuple(c.path for c in patch_changes)
        above = later_on_same_files(patch, paths, files)
        if above is not None:
            raise PatchkitError(
                f"{patch.id}: {above[0]} is applied on top of it in {above[1]}; revert "
                f"{above[0]} first (patchkit revert --only {above[0]} --only {patch.id}); "
                "nothing was changed"
            )
        for change in patch_changes:
            files.overlay(change.path, change.after)
        changes.extend(patch_changes)
        state.patches.pop(patch.id, None)
        report.outcomes.append(Outcome(assessment, "reverted"))
    changes = merged(changes)
    reverted = [o.assessment.patch.id for o in report.outcomes if o.action == "reverted"]
    if changes or reverted or stale_notes:
        commit(state, changes, backups={})
        report.notes.extend(stale_notes)
        _remove_bytecode(report, tree, [c.path for c in changes])
    _drop_backups(state, [o.assessment.patch.id for o in report.outcomes])


def _revert_changes(
    assessment: Assessment, files: TreeFiles, force: bool
) -> list[FileChange] | None:
    """The writes that undo one patch; None when it is not applied."""
    record = assessment.record
    if record is None or assessment.stale_record:
        if assessment.state == APPLIED:  # applied by hand or without .patchkit/: by content
            return _reverse_apply(assessment, files)
        return None
    changes = []
    for entry in record.files:
        kind, top = chain_finding(files, entry.path)
        if kind == STALE:
            continue  # back to its original already (or a created file that is gone)
        if kind == FOREIGN:
            raise PatchkitError(
                f"{assessment.patch.id}: conflict: {assessment.reason}; nothing was changed"
            )
        if kind == EDITED:
            _check_force(assessment, files, entry.path, force)
        changes.append(_restore(entry, files, assessment))
    return changes


def _check_force(assessment: Assessment, files: TreeFiles, path: str, force: bool) -> None:
    """An edited file is restored only with --force, and only to its own release's original."""
    patch_id = assessment.patch.id
    if not force:
        raise PatchkitError(
            f"{patch_id}: {assessment.reason.split(';')[0]}; revert refuses to overwrite those "
            "edits (use --force to restore the original anyway); nothing was changed"
        )
    refusal = force_refusal(files, path)
    if refusal:
        raise PatchkitError(
            f"{patch_id}: {files.tree.fs.full(path)} was edited and {refusal}; --force never "
            "restores a file of another release; nothing was changed"
        )


def _restore(record: FileRecord, files: TreeFiles, assessment: Assessment) -> FileChange:
    """The write that puts one file back to before the patch (from its backup, or rebuilt)."""
    current = files.data(record.path)
    patch_id = assessment.patch.id
    if record.pre_sha256 is None:
        return FileChange(record.path, current, None, (patch_id,))  # the patch created it
    backup = f"{STATE_DIR}/{record.backup}"
    original = files.tree.fs.read(backup, str(files.state.path))
    if original is not None and _sha(original) == record.pre_sha256:
        return FileChange(record.path, current, original, (patch_id,))
    rebuilt = _reverse_one(assessment, record.path, files)
    if rebuilt is None or _sha(rebuilt) != record.pre_sha256:
        raise PatchkitError(
            f"{patch_id}: the backup of {record.path} is missing or damaged and "
            "reverse-applying the diff does not give the original back; reinstall vLLM "
            f"(pip install --force-reinstall --no-deps vllm=={files.state.vllm_version}); "
            "nothing was changed"
        )
    return FileChange(record.path, current, rebuilt, (patch_id,))


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


def _drop_backups(state: State, patch_ids: list[str]) -> None:
    for patch_id in patch_ids:
        if patch_id not in state.patches:
            state.fs.remove_tree(f"{STATE_DIR}/backups/{patch_id}", "state")


def _sha(data: bytes | None) -> str | None:
    return None if data is None else sha256_bytes(data)
