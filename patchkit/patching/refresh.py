"""``patchkit refresh``: write a patch's diff from the tree it is applied to (quilt's refresh).

The maintainer's loop, as in quilt: ``patchkit apply`` on a release tree,
edit the patched files there, ``patchkit refresh ID``. The variant's diff is
rewritten from each file's original (the backup patchkit keeps) to the file
as it is now, with the variant's lines of context; a file the patch creates
is copied back to ``patches/<id>/files/``. The tree's state entry of the patch is
updated with it, so ``status`` still says ``applied`` and ``revert`` still
gives the original back.

A refresh is a transaction like ``apply``: first everything is computed (a
pristine tree for ``--add`` is downloaded then, with Ctrl-C working), and
everything refresh must refuse is refused (a file back to its original
everywhere, a link, bytes a diff cannot give back); only then are the diff,
the created files and the tree's state written, all or none, with signals
held (:mod:`patchkit.catalogue.journal`). A signal that arrives while they
are written is acted on before the commit point (everything is put back) or
reported as arriving after it (everything was written); never "nothing
changed" after a change.

Only the top patch of a file can be refreshed: a later patch applied on the
same file would end up inside this one's diff (revert it first, as quilt
asks you to pop). refresh writes only into a catalogue in a source checkout,
never into the one installed with patchkit.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

from patchkit import signals
from patchkit.catalogue import journal
from patchkit.catalogue.load import installed_catalogue
from patchkit.catalogue.model import Catalogue, Patch, Variant, variant_files, variant_sha256
from patchkit.codes import Code, Reason
from patchkit.diffs.hunks import apply_file_patch
from patchkit.diffs.unified import unified_diff
from patchkit.errors import PatchkitError, Refused, cause_of
from patchkit.fs.safepath import Root
from patchkit.identity import sha256_bytes
from patchkit.patching.assess import TreeFiles
from patchkit.patching.decide import later_on_same_files
from patchkit.patching.state import (
    STATE_DIR,
    TXN_DIR,
    AppliedPatch,
    PatchedFile,
    State,
    backup_path,
    file_sha256,
    load_state,
    recorded_backups,
    sweep,
)
from patchkit.patching.transaction import TreeLock, after_recovery, commit_or_undo, recover
from patchkit.vllmtree.tree import VllmTree


@dataclass
class RefreshReport:
    patch_id: str
    variant: str
    diff: Path
    changed: list[str] = field(default_factory=list)  # files in the new diff
    unchanged: list[str] = field(default_factory=list)  # back to their original: left out
    created: list[Path] = field(default_factory=list)  # sources copied back to files/
    added: list[str] = field(default_factory=list)  # --add: files newly in the patch
    recovered: list[Reason] = field(default_factory=list)  # what it finished or undid first


@dataclass
class _Plan:
    """Everything a refresh writes, computed before the first write."""

    report: RefreshReport
    files: list[journal.CatalogueFile]  # into the catalogue
    state: State  # the tree's state as it will be
    backups: dict[str, bytes]  # originals of files newly in the patch (--add)


class InterruptedAfterRefresh(PatchkitError):
    """Ctrl-C, SIGTERM or SIGHUP arrived after the commit point: the refresh is complete."""

    code = Code.INTERRUPTED

    def __init__(self, signum: int, report: RefreshReport):
        name = signal.Signals(signum).name
        super().__init__(
            f"{name} arrived as refresh finished; it had written everything: {report.diff}, "
            f"{report.patch_id}'s created files and the tree's record (review with git diff)",
            signal=name,
            patch=report.patch_id,
            diff=report.diff,
        )
        self.exit_code = 128 + signum


def refresh(
    tree: VllmTree,
    catalogue: Catalogue,
    patch_id: str,
    variant_name: str | None = None,
    add: tuple[str, ...] = (),
    pristine: Path | None = None,
) -> RefreshReport:
    if installed_catalogue(catalogue.root):
        raise Refused(Reason.of(Code.REFRESH_INSTALLED_CATALOGUE, catalogue=str(catalogue.root)))
    patch = catalogue.get(patch_id)
    pristine = _pristine_tree(tree, catalogue, patch, add, pristine)  # may download: no lock
    recovered: list[Reason] = []
    with Root.open(catalogue.root) as root, journal.CatalogueLock(root), TreeLock(tree.fs):
        with signals.held():
            # the CLI finished or undid an interrupted refresh before it loaded the
            # catalogue (recover_interrupted_refresh); one that died since makes this run
            # stop (its catalogue is stale), an interrupted run on the tree is rolled back
            # and the report says so
            recovered += journal.recover_locked(root, catalogue.ids)
            if recovered:
                raise Refused(Reason.of(Code.REFRESH_CATALOGUE_RECOVERED, recovered=recovered[0]))
            recovered += recover(tree.fs, catalogue.file_kinds, tree.reinstall_facts)
            state = load_state(tree.fs, catalogue.file_kinds)
            recorded = recorded_backups(state)  # _plan makes state the one to be written
        try:
            plan = _plan(tree, catalogue, root, patch, state, variant_name, add, pristine)
            with signals.held():  # only now: a refused plan leaves .patchkit/ as it was
                sweep(state, recorded)
            _write(tree, root, plan)
        except (OSError, PatchkitError) as exc:
            if not recovered or isinstance(exc, InterruptedAfterRefresh):
                raise
            # the roll-back of an interrupted run stands: the error says so
            raise after_recovery(exc, recovered, "reading") from None
    plan.report.recovered = recovered
    return plan.report


def _pristine_tree(
    tree: VllmTree, catalogue: Catalogue, patch: Patch, add: tuple[str, ...], pristine: Path | None
) -> Path | None:
    """The pristine tree --add needs, fetched now: before any lock, with signals acted on."""
    if pristine is not None or not add:
        return pristine
    applied = load_state(tree.fs, catalogue.file_kinds).patches.get(patch.id)
    recorded = {f.path for f in applied.files} if applied else set()
    if all(relpath in recorded for relpath in add):
        return None
    from patchkit.releases.fetch import fetch

    return fetch(tree.version)


def _plan(
    tree: VllmTree,
    catalogue: Catalogue,
    root: Root,
    patch: Patch,
    state: State,
    variant_name: str | None,
    add: tuple[str, ...],
    pristine: Path | None,
) -> _Plan:
    """Read and check everything; refuse before anything is written."""
    applied = state.patches.get(patch.id)
    if applied is None and not add:
        raise Refused(Reason.of(Code.REFRESH_NOT_APPLIED, patch=patch.id, tree=str(tree.root)))
    variant = patch.variant(variant_name or (applied.variant if applied else ""))
    if variant is None:
        known = [v.name for v in patch.variants]
        raise Refused(
            Reason.of(Code.REFRESH_NO_VARIANT, patch=patch.id, variant=variant_name, known=known)
        )
    recorded = {f.path for f in applied.files} if applied else set()
    if applied is None:  # patch-package's way: the patch is made from the edits
        applied = state.patches[patch.id] = AppliedPatch(
            patch.id, "0" * 64, variant.name, _now(), []
        )
    originals = _originals(tree, state, applied.files, add, pristine)
    above = later_on_same_files(patch, tuple(originals), TreeFiles(tree, state, catalogue.ids))
    if above is not None:
        raise Refused(
            Reason.of(Code.REFRESH_UNDER_LATER, patch=patch.id, above=above[0], path=above[1])
        )
    current = {relpath: tree.fs.read(relpath, "refresh") for relpath in originals}
    report, diff, created = _sources(variant, originals, current, patch.id)
    entries = _patched_files(patch.id, originals, current)
    if not entries:
        raise Refused(Reason.of(Code.REFRESH_NOTHING_LEFT, patch=patch.id))
    all_created = _all_created(root, patch, variant, created)
    _check_exact(variant, diff, all_created, originals, current)
    applied.files, applied.variant = entries, variant.name
    applied.patch_sha256 = variant_sha256(diff, all_created)
    state.vllm_version = state.vllm_version or tree.version
    report.added = [p for p in add if p not in recorded]
    backups = {
        backup_path(patch.id, entry.path): originals[entry.path]
        for entry in entries
        if entry.backup is not None and entry.path not in recorded
    }
    files = _catalogue_files(root, catalogue, patch, variant, diff, created)
    return _Plan(report, files, state, backups)


def _originals(
    tree: VllmTree,
    state: State,
    entries: list[PatchedFile],
    add: tuple[str, ...],
    pristine: Path | None,
) -> dict[str, bytes | None]:
    """Each file of the patch -> its bytes before the patch (None: the patch creates it)."""
    found = {}
    for entry in entries:
        if entry.pre_sha256 is None:
            found[entry.path] = None
            continue
        data = tree.fs.read(f"{STATE_DIR}/{entry.backup}", str(state.path))
        if data is None or sha256_bytes(data) != entry.pre_sha256:
            raise Refused(
                Reason.of(Code.REFRESH_BACKUP_DAMAGED, path=entry.path, **tree.reinstall_facts)
            )
        found[entry.path] = data
    for relpath in add:
        others = sorted(p.id for p in state.patches.values() for f in p.files if f.path == relpath)
        if relpath not in found and others:
            raise Refused(Reason.of(Code.REFRESH_SHARED_FILE, path=relpath, others=others))
        if relpath not in found:
            found[relpath] = _pristine_file(tree, relpath, pristine)
    return found


def _pristine_file(tree: VllmTree, relpath: str, pristine: Path | None) -> bytes | None:
    """A file's original for --add, from a pristine tree of the same release."""
    if pristine is None:  # _pristine_tree saw the file recorded; its state entry changed since
        raise Refused(Reason.of(Code.REFRESH_ENTRY_CHANGED, tree=str(tree.root)))
    with Root.open(pristine) as fs:
        data = fs.read(relpath, "--pristine")
    row = tree.record.row(relpath)
    if data is not None and row is not None and not row.matches(data):
        raise Refused(
            Reason.of(Code.REFRESH_NOT_PRISTINE, path=f"{pristine}/{relpath}", version=tree.version)
        )
    return data  # None: vLLM has no such file, the patch creates it


def _sources(
    variant: Variant,
    originals: dict[str, bytes | None],
    current: dict[str, bytes | None],
    patch_id: str,
) -> tuple[RefreshReport, bytes, dict[str, bytes]]:
    """The variant's new diff and created files, from the tree as it is now."""
    report = RefreshReport(patch_id, variant.name, variant.diff_path)
    parts, created = [], {}
    for relpath, original in originals.items():
        now = current[relpath]
        if original is None:
            if now is None:
                raise Refused(Reason.of(Code.REFRESH_CREATED_GONE, path=relpath, patch=patch_id))
            if relpath not in variant.created:
                toml = str(variant.diff_path.parent / "patch.toml")
                raise Refused(Reason.of(Code.REFRESH_NEW_FILE, path=relpath, toml=toml))
            created[relpath] = now
            report.created.append(variant.files_dir / relpath)
        elif now == original:
            report.unchanged.append(relpath)
        else:
            parts.append(unified_diff(relpath, original, now, variant.context))
            report.changed.append(relpath)
    return report, b"".join(parts), created


def _patched_files(
    patch_id: str, originals: dict[str, bytes | None], current: dict[str, bytes | None]
) -> list[PatchedFile]:
    """The patch's state entry: the files as they are now (one back to its original drops out)."""
    entries = []
    for relpath, original in originals.items():
        now = current[relpath]
        if original is not None and now == original:
            continue  # no longer part of the patch
        backup = None if original is None else backup_path(patch_id, relpath)
        entries.append(PatchedFile(relpath, file_sha256(original), file_sha256(now), backup))
    return entries


def _all_created(
    root: Root, patch: Patch, variant: Variant, created: dict[str, bytes]
) -> dict[str, bytes]:
    """Every file the variant declares in creates, as it will be: from the tree or files/."""
    found = {}
    for relpath in variant.created:
        data = created.get(relpath)
        if data is None:
            data = root.read(f"{patch.id}/files/{relpath}", "refresh")
        if data is None:
            raise Refused(
                Reason.of(
                    Code.REFRESH_CREATED_NOWHERE,
                    toml=str(variant.diff_path.parent / "patch.toml"),
                    variant=variant.name,
                    path=relpath,
                    patch=patch.id,
                    files=str(variant.files_dir),
                )
            )
        found[relpath] = data
    return found


def _check_exact(
    variant: Variant,
    diff: bytes,
    created: dict[str, bytes],
    originals: dict[str, bytes | None],
    current: dict[str, bytes | None],
) -> None:
    """Refuse a diff that, parsed and applied as ``apply`` will, gives other bytes back."""
    if not diff.strip() and not created:
        return
    for file_patch in variant_files(diff, created, str(variant.diff_path)):
        if file_patch.path not in current:
            continue  # a created file kept as it is in files/
        original = originals.get(file_patch.path)
        text = None if original is None else original.decode("utf-8", errors="surrogateescape")
        result, _ = apply_file_patch(text, file_patch)
        if _bytes(result) != current[file_patch.path]:
            why = _why_inexact(originals.get(file_patch.path), current[file_patch.path])
            raise Refused(Reason.of(Code.REFRESH_INEXACT, path=file_patch.path, why=why))


def _why_inexact(original: bytes | None, now: bytes | None) -> str:
    for data in (now, original):
        if data and b"\r\n" in data and data.count(b"\n") != data.count(b"\r\n"):
            return "it mixes \\r\\n and \\n line endings"
        if data and data.endswith(b"\r"):
            return "its last line ends in a lone \\r"
    return "patchkit's hunks cannot hold its lines"


def _catalogue_files(
    root: Root,
    catalogue: Catalogue,
    patch: Patch,
    variant: Variant,
    diff: bytes,
    created: dict[str, bytes],
) -> list[journal.CatalogueFile]:
    """The catalogue files that change, each with its bytes now and its mode (kept)."""
    origin = str(patch.root / "patch.toml")
    wanted = {_relative(catalogue.root, variant.diff_path, origin): diff}
    wanted.update({f"{patch.id}/files/{relpath}": data for relpath, data in created.items()})
    files = []
    for relpath, after in wanted.items():
        journal.catalogue_path(relpath, [patch.id], origin)
        before = root.read(relpath, "refresh")
        if before == after:
            continue
        found = root.lstat(relpath, "refresh")
        mode = None if found is None else found.st_mode & 0o7777
        files.append(journal.CatalogueFile(relpath, before, after, mode))
    return files


def _relative(root: Path, path: Path, origin: str) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        raise Refused(
            Reason.of(Code.REFRESH_OUTSIDE_CATALOGUE, origin=origin, path=str(path), root=str(root))
        ) from None


def _write(tree: VllmTree, root: Root, plan: _Plan) -> None:
    """Write the plan all-or-nothing, with signals held only now.

    A signal that arrived while the catalogue files were put in place undoes
    them before the commit point (the tree's state file); one that arrives
    after it is reported as such.
    """
    new_state = sha256_bytes(plan.state.to_bytes())
    write = journal.CatalogueWrite(root, plan.files, journal.tree_path(tree.fs), new_state)
    with signals.held():
        try:
            write.prepare()
            write.install()
            _act_on_signal()
            commit_or_undo(plan.state, [], plan.backups)
        except BaseException as exc:
            write.undo()
            if isinstance(exc, OSError):
                why = cause_of(exc, "writing")
                raise Refused(Reason.of(Code.REFRESH_NOT_WRITTEN, cause=why)) from None
            raise
        late = _finish(tree, write)
    if late is not None:
        raise InterruptedAfterRefresh(late, plan.report)


def _finish(tree: VllmTree, write: journal.CatalogueWrite) -> int | None:
    """After the commit point: tidy up; a failure here leaves what the next refresh removes.

    Returns the signal that arrived meanwhile, taken so it cannot claim that
    nothing changed.
    """
    try:
        write.finish()
        tree.fs.remove_tree(TXN_DIR, "journal")
    except KeyboardInterrupt:
        return signal.SIGINT
    except signals.Terminated as exc:
        return exc.signum
    except (OSError, PatchkitError):
        pass
    return _take_signal()


def _act_on_signal() -> None:
    """Before the commit point: a held signal ends the run now, and everything goes back."""
    signum = _take_signal()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    if signum is not None:
        raise signals.Terminated(signum)


def _take_signal() -> int | None:
    """A held signal that is pending and not ignored, consumed; None if there is none."""
    for signum in sorted(signal.sigpending() & signals.HELD):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.sigtimedwait({signum}, 0)
            return signum
    return None


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode("utf-8", errors="surrogateescape")
