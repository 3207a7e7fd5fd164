"""Assess each patch's state on a tree, by content first and by version second.

States:

* ``needed``         - a variant's pristine side matches; applying is safe.
* ``applied``        - patchkit's patched text is there.
* ``upstream``       - this release already has the fix (content evidence).
* ``not-applicable`` - this release's design makes the patch meaningless.
* ``conflict``       - neither pristine nor patched: a fork, a hand edit, a
  half-applied patch, or a file that differs from the wheel's RECORD.
* ``changed-upstream`` - on a release the catalogue has not tested, the code
  moved under the patch: a hunk does not fit a file that is the wheel's own
  (its RECORD hash), or the release no longer ships the file. Nothing is
  known about the bug there; on a tested release every patch is decided, so
  this state never appears.

The version only orders the search (the variant listed for it is tried
first) and decides whether to warn that the release is untested.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import Version

from patchkit.catalogue.model import Catalogue, Decision, Patch, Variant
from patchkit.codes import Code, Reason
from patchkit.diffs.hunks import Placement, apply_file_patch
from patchkit.errors import HunkMismatch
from patchkit.fs.safepath import checked_relpath
from patchkit.identity import sha256_bytes
from patchkit.patching.state import AppliedPatch, PatchedFile, State
from patchkit.patching.transaction import FileChange
from patchkit.vllmtree.tree import VllmTree
from patchkit.vocabulary import FileFinding, PatchState

NEEDED, APPLIED, CONFLICT = PatchState.NEEDED, PatchState.APPLIED, PatchState.CONFLICT
NOT_APPLICABLE, CHANGED_UPSTREAM = PatchState.NOT_APPLICABLE, PatchState.CHANGED_UPSTREAM
STALE, EDITED, FOREIGN = FileFinding.STALE, FileFinding.EDITED, FileFinding.FOREIGN


@dataclass(frozen=True)
class KnownIssue:
    """A notice of the catalogue that holds on this tree; ``fixed_by`` a patch that ends it.

    ``remedy`` is what the user can do, by the state of that patch on this tree and by
    whether a plain `patchkit apply` would run here (:func:`patchkit.patching.decide.plan`
    gives each notice its remedy once every patch is assessed). ``undecided`` is the release
    when the catalogue has not tested it: the bug was seen up to ``seen_up_to`` and is
    unknown there.
    """

    message: str
    fixed_by: str = ""
    remedy: Reason | None = None
    undecided: str = ""
    seen_up_to: str = ""
    evidence: tuple[str, ...] = ()  # the files its evidence matched in, where it was checked

    @property
    def reason(self) -> Reason:
        """The notice as a message: the catalogue's text, and what holds it (status, apply
        and doctor print it)."""
        facts = {"text": self.message, "fixed_by": self.fixed_by or None, "remedy": self.remedy}
        if self.undecided:
            return Reason.of(
                Code.KNOWN_ISSUE_UNDECIDED,
                version=self.undecided,
                seen_up_to=self.seen_up_to,
                evidence=list(self.evidence),
                **facts,
            )
        return Reason.of(Code.KNOWN_ISSUE, **facts)


@dataclass(frozen=True)
class Assessment:
    """One patch's state on one tree, and what applying it would write; a value (a plan
    that says more makes a new one)."""

    patch: Patch
    state: PatchState
    reason: Reason | None = None
    variant: Variant | None = None
    files: tuple[str, ...] = ()
    placements: tuple[Placement, ...] = ()
    changes: tuple[FileChange, ...] = ()
    warnings: tuple[Reason, ...] = ()
    # Known upstream bugs a user of this release should know about; shown under
    # this patch by status and apply (not revert), never a failure (not --strict).
    notices: tuple[KnownIssue, ...] = ()
    entry: AppliedPatch | None = None
    stale_entry: bool = False  # ``entry`` no longer describes the files (vLLM reinstalled)
    outdated: bool = False  # applied from an older catalogue (its warning says so)


class TreeFiles:
    """The tree's files as a run sees them: read once, with the run's own edits on top.

    Patches stack (quilt's model): patch N is assessed on the tree as patches
    1..N-1 leave it. ``overlay`` puts a patch's result in place before the
    next patch is assessed; ``state`` and ``order`` (the series) say which
    applied patches already touch each file, in which order. Files are read
    through the tree's open root (:class:`patchkit.fs.safepath.Root`), so a link
    or a FIFO in place of a file is refused, never followed or waited on.
    """

    def __init__(self, tree: VllmTree, state: State | None = None, order: tuple[str, ...] = ()):
        self.tree = tree
        self.state = state
        self.order = order
        self._disk: dict[str, bytes | None] = {}
        self._overlay: dict[str, bytes | None] = {}

    def data(self, relpath: str) -> bytes | None:
        if relpath in self._overlay:
            return self._overlay[relpath]
        return self.disk(relpath)

    def disk(self, relpath: str) -> bytes | None:
        """The file as it is on disk, before this run's edits."""
        if relpath not in self._disk:
            checked_relpath(relpath, "the catalogue")
            self._disk[relpath] = self.tree.fs.read(relpath, "the catalogue")
        return self._disk[relpath]

    def overlay(self, relpath: str, data: bytes | None) -> None:
        self._overlay[relpath] = data

    def without(self, patch_id: str, undo: list[FileChange]) -> TreeFiles:
        """The files as they would be on disk with ``patch_id`` taken off (``undo``) and
        its state entry gone: what a replacement of that patch is assessed on."""
        state = self.state
        rest = State(
            state.fs, {k: v for k, v in state.patches.items() if k != patch_id}, state.vllm_version
        )
        files = TreeFiles(self.tree, rest, self.order)
        files._overlay = dict(self._overlay)
        files._disk.update({change.path: change.after for change in undo})
        return files

    def text(self, relpath: str) -> str | None:
        data = self.data(relpath)
        return None if data is None else data.decode("utf-8", errors="surrogateescape")

    def sha256(self, relpath: str) -> str | None:
        data = self.data(relpath)
        return None if data is None else sha256_bytes(data)

    def chain(self, relpath: str) -> list[tuple[str, PatchedFile]]:
        """(patch id, its PatchedFile) of each applied patch touching ``relpath``, in order."""
        if self.state is None:
            return []
        ids = list(self.order) + sorted(set(self.state.patches) - set(self.order))
        return [
            (patch_id, applied)
            for patch_id in ids
            if patch_id in self.state.patches
            for applied in self.state.patches[patch_id].files
            if applied.path == relpath
        ]

    def base_sha256(self, relpath: str) -> str | None:
        """The file before any patch: what the wheel's RECORD describes.

        A chain of stale entries (vLLM reinstalled since) says nothing about it.
        """
        chain = self.chain(relpath)
        if chain and chain_finding(self, relpath)[0] != STALE:
            return chain[0][1].pre_sha256
        data = self.disk(relpath)
        return None if data is None else sha256_bytes(data)


def assess_with(
    patch: Patch, tree: VllmTree, state: State, catalogue: Catalogue, files: TreeFiles
) -> Assessment:
    version = tree.parsed_version
    expected = patch.expected_for(version)
    applied = state.patches.get(patch.id)
    newer = bool(newer_than_catalogue(catalogue, version))
    result = (
        _from_entry(patch, applied, files, catalogue)
        or _from_decisions(patch, expected, files)
        or _from_variants(patch, expected, tree, files, newer)
    )
    if applied is not None and result.entry is None:
        result = replace(result, entry=applied, stale_entry=True)
    if result.state == CONFLICT and result.entry is None and catalogue.predates(version):
        predates = Reason.of(
            Code.PREDATES_CATALOGUE, version=tree.version, tested=catalogue.tested_span
        )
        result = Assessment(patch, NOT_APPLICABLE, reason=predates)
    if result.state == CONFLICT and result.entry is None and not catalogue.is_tested(version):
        result = _changed_upstream(result, tree, files, catalogue) or result
    if not catalogue.is_tested(version):
        newest = newer_than_catalogue(catalogue, version)
        untested = (
            Reason.of(Code.NEWER_THAN_CATALOGUE, version=tree.version, newest=newest)
            if newest
            else Reason.of(
                Code.UNTESTED_RELEASE, version=tree.version, tested=catalogue.tested_span
            )
        )
        result = replace(result, warnings=(untested, *result.warnings))
    notices = (*result.notices, *_notices(result, tree, files, catalogue))
    return replace(result, notices=notices)


def assess_replacement(patch: Patch, tree: VllmTree, files: TreeFiles) -> Assessment:
    """The catalogue's current version of an applied patch, on ``files`` (the tree with
    the applied version taken off: :meth:`TreeFiles.without`)."""
    expected = patch.expected_for(tree.parsed_version)
    return _from_decisions(patch, expected, files) or _from_variants(patch, expected, tree, files)


def newer_than_catalogue(catalogue: Catalogue, version: Version | None) -> str:
    """The newest tested release when ``version`` is newer than it; '' otherwise."""
    newest = catalogue.newest_tested
    return newest if version is not None and version > Version(newest) else ""


def _from_entry(
    patch: Patch, applied: AppliedPatch | None, files: TreeFiles, catalogue: Catalogue
) -> Assessment | None:
    """Trust our state entry when the files still carry the hashes the stack of entries wrote.

    For each file, the applied patches touching it form a chain in series
    order (each one's ``pre`` is the one below's ``post``); the file must
    hold the top one's ``post``. An entry whose every file is back at its
    ``pre``, or is now another release's own file, is stale (vLLM was
    reinstalled): content decides, and the next apply or revert drops it.
    """
    if applied is None:
        return None
    paths = tuple(f.path for f in applied.files)
    findings = [chain_finding(files, f.path) for f in applied.files]
    kinds = {kind for kind, _ in findings}
    if kinds == {FileFinding.APPLIED}:
        variant = patch.variant(applied.variant)
        result = Assessment(patch, APPLIED, variant=variant, files=paths, entry=applied)
        if variant is None or variant.sha256 != applied.patch_sha256:
            result = replace(
                result,
                outdated=True,
                warnings=(Reason.of(Code.OUTDATED, patch=patch.id),),
                reason=Reason.of(Code.APPLIED_FROM_OLDER_CATALOGUE, patch=patch.id),
            )
        return result
    if kinds == {STALE}:
        return None
    return Assessment(
        patch,
        CONFLICT,
        files=paths,
        reason=_entry_conflict(patch, applied, findings, files, catalogue),
        entry=applied,
    )


def _entry_conflict(
    patch: Patch,
    applied: AppliedPatch,
    findings: list[tuple[str, str]],
    files: TreeFiles,
    catalogue: Catalogue,
) -> Reason:
    """Why a recorded patch is neither applied nor stale, and the command that gets out of it."""
    by_kind: dict[str, tuple[str, str]] = {}
    for entry, (kind, top) in zip(applied.files, findings, strict=True):
        by_kind.setdefault(kind, (entry.path, top))
    tree = files.tree
    if FOREIGN in by_kind:
        path, top = by_kind[FOREIGN]
        return Reason.of(Code.FOREIGN_BACKUP, path=path, top=top, version=tree.version,
                         **tree.reinstall_facts)  # fmt: skip
    unknown = [top for _, top in by_kind.values() if top not in files.order]
    if unknown:
        return Reason.of(Code.UNKNOWN_PATCH_ON_TOP, path=applied.files[0].path, top=unknown[0])
    if EDITED in by_kind:
        path, top = by_kind[EDITED]
        return _edited(path, top, files, catalogue)
    path, top = by_kind[STALE]
    rest = [
        entry.path
        for entry, (kind, _) in zip(applied.files, findings, strict=True)
        if kind == FileFinding.APPLIED
    ]
    recorded = files.state.vllm_version if files.state else None
    facts = {"path": path, "patch": patch.id, "top": top, "rest": rest, "version": tree.version}
    if not tree.same_release(recorded):
        return Reason.of(Code.OTHER_RELEASE_INSTALLED, recorded=recorded, **facts)
    return Reason.of(Code.PARTLY_REINSTALLED, **facts)


def _edited(path: str, top: str, files: TreeFiles, catalogue: Catalogue) -> Reason:
    """A file changed since patchkit applied ``top``: both ways out, each with what it costs
    (``refresh``: where the catalogue is a source checkout, keeping the edit in the patch)."""
    return Reason.of(
        Code.EDITED,
        path=path,
        top=top,
        target=shlex.quote(str(files.tree.root)),
        refusal=force_refusal(files, path),
        refresh=source_checkout(catalogue.root),
    )


def source_checkout(root: Path) -> bool:
    """Whether the catalogue at ``root`` is a maintainer's source checkout, where `refresh`
    may write: a directory this user can write to, not inside an installed environment
    (site-packages or dist-packages, where a pip upgrade would drop the change)."""
    installed = {"site-packages", "dist-packages"}
    return not installed & set(root.resolve().parts) and os.access(root, os.W_OK)


def chain_finding(files: TreeFiles, relpath: str) -> tuple[FileFinding, str]:
    """(applied | stale | edited | foreign, the top patch) for one file's chain of state entries.

    ``stale``: the file on disk is back to before the whole stack, or it is
    now the installed release's own file (its RECORD hash) while the stack was
    made on another one. ``foreign``: the RECORD names another release's file
    than the stack was made on, and the file is neither: no backup may go there.
    """
    chain = files.chain(relpath)
    current = files.sha256(relpath)
    top_id, top = chain[-1]
    bottom = chain[0][1].pre_sha256
    recorded = files.tree.record.get(relpath)
    if recorded is not None and recorded != bottom:
        return (STALE if current == recorded else FOREIGN), top_id
    linked = all(
        below.post_sha256 == above.pre_sha256
        for (_, below), (_, above) in zip(chain, chain[1:], strict=False)
    )
    if linked and current == top.post_sha256:
        return FileFinding.APPLIED, top_id
    on_disk = files.disk(relpath)
    if (None if on_disk is None else sha256_bytes(on_disk)) == bottom:
        return STALE, top_id
    return EDITED, top_id


def force_refusal(files: TreeFiles, relpath: str) -> Reason | None:
    """Why ``--force`` may not restore the original of an edited file; None when it may.

    The backup (or, for a created file, its absence) belongs to the release
    the patch was applied to. It may go over the file only if that is the
    installed release: the RECORD lists the backup's hash for this path, or,
    without a RECORD entry, the tree still reports the version the state
    recorded. In a checkout the version is the tag, whatever the commits since
    it, so HEAD's file must also be the backup's or what patchkit wrote (fork
    mode commits it): a commit that changed the file since makes the backup
    another commit's file, and restoring it undid that commit under a
    "Revert patchkit" message.
    """
    tree, state = files.tree, files.state
    chain = files.chain(relpath)
    bottom = chain[0][1].pre_sha256
    recorded = tree.record.get(relpath)
    if recorded is not None:
        return None if recorded == bottom else Reason.of(Code.BACKUP_NOT_THIS_RELEASE)
    if state is not None and not tree.same_release(state.vllm_version):
        return Reason.of(
            Code.APPLIED_TO_OTHER_VERSION,
            applied_to=state.vllm_version,
            version=tree.version,
            **tree.reinstall_facts,
        )
    if tree.checkout and tree.at_head(relpath) not in (bottom, chain[-1][1].post_sha256):
        return Reason.of(Code.BACKUP_NOT_THIS_COMMIT, path=relpath, **tree.reinstall_facts)
    return None


def _from_decisions(
    patch: Patch, expected: Variant | Decision | None, files: TreeFiles
) -> Assessment | None:
    ordered = sorted(patch.decisions, key=lambda d: d is not expected)
    for decision in ordered:
        if all(e.holds(files.text(e.file)) for e in decision.evidence):
            evidence_files = tuple(dict.fromkeys(e.file for e in decision.evidence))
            state = PatchState(decision.state)
            reason = Reason.of(Code.DECIDED, state=decision.state, text=decision.reason)
            return Assessment(patch, state, reason=reason, files=evidence_files)
    return None


def _from_variants(
    patch: Patch,
    expected: Variant | Decision | None,
    tree: VllmTree,
    files: TreeFiles,
    newer: bool = False,
) -> Assessment:
    """The variant listed for the release first; then the others, oldest first, or, on a
    release newer than the catalogue (``newer``), newest first: an older variant may fit
    newer code too and miss what the newer variants added for it."""
    rest = [v for v in patch.variants if v is not expected]
    if newer:
        rest.sort(key=lambda v: Version(v.made_on), reverse=True)
    ordered = ([expected] if isinstance(expected, Variant) else []) + rest
    for variant in ordered:
        attempt = _try_variant(variant, files, reverse=False)
        if attempt is not None:
            result = _needed(patch, variant, attempt, tree, files)
            return replace(result, warnings=_other_choice(patch, expected, variant, tree.version))
    for variant in ordered:
        if _try_variant(variant, files, reverse=True) is not None:
            return Assessment(
                patch,
                APPLIED,
                reason=Reason.of(Code.APPLIED_WITHOUT_ENTRY),
                variant=variant,
                files=variant.paths,
            )
    return _conflict(patch, expected, files)


def _other_choice(
    patch: Patch, expected: Variant | Decision | None, variant: Variant, version: str
) -> tuple[Reason, ...]:
    """Warnings when the variant that fits is not what the catalogue lists for the release."""
    if isinstance(expected, Variant) and variant is not expected:
        return (
            Reason.of(
                Code.OTHER_VARIANT,
                patch=patch.id,
                variant=variant.name,
                listed=expected.name,
                version=version,
            ),
        )
    if isinstance(expected, Decision):
        return (
            Reason.of(
                Code.DECISION_EVIDENCE_MISSING,
                patch=patch.id,
                version=version,
                state=expected.state,
            ),
        )
    return ()


def _try_variant(
    variant: Variant, files: TreeFiles, reverse: bool
) -> tuple[dict[str, str | None], list[Placement]] | None:
    """New texts and placements if every hunk of the variant applies, else None."""
    if not variant.files:
        return None  # declared, not made yet (patchkit refresh makes it)
    new_texts: dict[str, str | None] = {}
    placements: list[Placement] = []
    try:
        for file_patch in variant.files:
            fp = file_patch.reversed() if reverse else file_patch
            new_text, where = apply_file_patch(files.text(fp.path), fp)
            new_texts[fp.path] = new_text
            placements.extend(where)
    except HunkMismatch:
        return None
    return new_texts, placements


def _needed(
    patch: Patch,
    variant: Variant,
    attempt: tuple[dict[str, str | None], list[Placement]],
    tree: VllmTree,
    files: TreeFiles,
) -> Assessment:
    new_texts, placements = attempt
    for path in new_texts:
        recorded = tree.record.get(path)
        if recorded is not None and files.base_sha256(path) != recorded:
            return Assessment(
                patch,
                CONFLICT,
                reason=Reason.of(
                    Code.DIFFERS_FROM_RECORD,
                    path=path,
                    version=tree.version,
                    **tree.reinstall_facts,
                ),  # fmt: skip
                variant=variant,
                files=variant.paths,
            )
    changes = tuple(
        FileChange(
            path,
            files.data(path),
            None if text is None else text.encode("utf-8", errors="surrogateescape"),
            (patch.id,),
        )
        for path, text in new_texts.items()
    )
    return Assessment(
        patch,
        NEEDED,
        variant=variant,
        files=variant.paths,
        placements=tuple(placements),
        changes=changes,
    )


def _changed_upstream(
    conflict: Assessment, tree: VllmTree, files: TreeFiles, catalogue: Catalogue
) -> Assessment | None:
    """A conflict on an untested release whose files are the wheel's own: vLLM moved the
    code, nobody edited it. None when a file differs from the RECORD (or there is none).

    The variant judged is the one nearest the release (the newest for a release newer
    than the catalogue), so the line names the code patchkit last saw.
    """
    patch = conflict.patch
    made = [v for v in patch.variants if v.made]
    if not made or not tree.record:
        return None
    newer = bool(newer_than_catalogue(catalogue, tree.parsed_version))
    newest = max(made, key=lambda v: Version(v.made_on))
    variant = newest if newer else conflict.variant or made[0]
    gone, rewritten = [], []  # rewritten: the first hunk of each file that no longer fits
    for path in variant.paths:
        if path in variant.created:
            continue
        if files.data(path) is None:
            if path in tree.record:
                return None  # RECORD lists it: deleted by hand, not by vLLM
            gone.append(path)
        elif files.base_sha256(path) != tree.record.get(path):
            return None  # not the wheel's file: an edit, a conflict proper
        elif (misfit := _misfit(variant, path, files)) is not None:
            rewritten.append(misfit)
    if not gone and not rewritten:
        return None
    first = rewritten[0] if rewritten else None
    moved = Reason.of(
        Code.CHANGED_UPSTREAM,
        patch=patch.id,
        version=tree.version,
        gone=gone[0] if gone else None,
        changed=first.path if first else None,
        hunk=first.hunk_index if first else None,
        header=first.header if first else None,
        detail=first.detail if first else None,
        newest=catalogue.newest_tested,
    )
    return Assessment(patch, CHANGED_UPSTREAM, reason=moved, variant=variant, files=variant.paths)


def _misfit(variant: Variant, path: str, files: TreeFiles) -> HunkMismatch | None:
    """The first of the variant's hunks for one file that does not apply to it (where,
    and the first line that differs), or None where they all do."""
    try:
        for file_patch in (f for f in variant.files if f.path == path):
            apply_file_patch(files.text(path), file_patch)
    except HunkMismatch as exc:
        return exc
    return None


def _conflict(patch: Patch, expected: Variant | Decision | None, files: TreeFiles) -> Assessment:
    variant = expected if isinstance(expected, Variant) else patch.variants[0]
    if not variant.made:
        not_made = Reason.of(
            Code.VARIANT_NOT_MADE,
            patch=patch.id,
            variant=variant.name,
            diff=variant.diff_path.name,
            made_on=variant.made_on,
        )
        return Assessment(patch, CONFLICT, reason=not_made, variant=variant)
    why = _why_no_fit(variant, files)
    return Assessment(patch, CONFLICT, reason=why, variant=variant, files=variant.paths)


def _why_no_fit(variant: Variant, files: TreeFiles) -> Reason:
    """The first file of the variant that is missing, or the first hunk that does not fit."""
    try:
        for file_patch in variant.files:
            if files.text(file_patch.path) is None and not file_patch.creates:
                return Reason.of(Code.FILE_MISSING, variant=variant.name, path=file_patch.path)
            apply_file_patch(files.text(file_patch.path), file_patch)
    except HunkMismatch as exc:
        return Reason.of(
            Code.HUNK_MISMATCH,
            variant=variant.name,
            path=exc.path,
            hunk=exc.hunk_index,
            header=exc.header,
            detail=exc.detail,
        )
    return Reason.of(Code.NO_VARIANT_MATCHES, variant=variant.name)


def _notices(
    result: Assessment, tree: VllmTree, files: TreeFiles, catalogue: Catalogue
) -> list[KnownIssue]:
    """The patch's notices that hold here: in range (or no version) with their evidence.

    On a release the catalogue has not tested the notice is shown as unknown there, with
    the newest tested release it holds on: the catalogue never asserts a bug it has not
    decided.
    """
    version = tree.parsed_version
    tested = catalogue.is_tested(version)
    found = []
    for notice in result.patch.notices:
        in_range = version is not None and notice.versions.contains(version, prereleases=True)
        has_evidence = all(e.holds(files.text(e.file)) for e in notice.evidence)
        if notice.fixed_by and _applied(notice.fixed_by, files):
            continue
        if not (has_evidence and (in_range or (version is None and notice.evidence))):
            continue
        seen = [r for r in catalogue.tested_releases if notice.versions.contains(r)]
        undecided = "" if tested or version is None or not seen else tree.version
        found.append(
            KnownIssue(
                notice.message,
                notice.fixed_by,
                undecided=undecided,
                seen_up_to=max(seen, key=Version) if undecided else "",
                evidence=tuple(dict.fromkeys(e.file for e in notice.evidence)),
            )
        )
    return found


def remedy(
    issue: KnownIssue, result: Assessment, tree: VllmTree, apply_command: str
) -> Reason | None:
    """What the user can do about a known issue, by the state of the patch that fixes it
    on this tree (a catalogue's notice states the facts only). ``apply_command`` is the
    apply that would run on this tree for that patch (`patchkit apply`, or `patchkit apply
    --only ID` where a plain apply refuses)."""
    fixed_by = issue.fixed_by
    if not fixed_by:
        return None
    if fixed_by != result.patch.id:
        return Reason.of(Code.FIXED_BY_OTHER_PATCH, patch=fixed_by)
    if result.state == NEEDED:
        code = Code.STILL_FITS if issue.undecided else Code.APPLY_FIXES
        return Reason.of(code, patch=fixed_by, command=apply_command)
    if result.state == CHANGED_UPSTREAM:
        return Reason.of(Code.NO_FIX_HERE, patch=fixed_by, version=tree.version)
    if result.state == CONFLICT:
        reinstall = tree.source == "metadata"  # its files can be the wheel's own again
        return Reason.of(Code.CONFLICT_STAYS, patch=fixed_by, version=tree.version,
                         reinstall=reinstall, **tree.reinstall_facts)  # fmt: skip
    return None


def _applied(patch_id: str, files: TreeFiles) -> bool:
    """Whether our state entry of ``patch_id`` still holds on the files (its fix is in place)."""
    applied = files.state.patches.get(patch_id) if files.state else None
    return applied is not None and all(
        chain_finding(files, f.path)[0] == FileFinding.APPLIED for f in applied.files
    )
