"""``patchkit refresh``: write a patch's diff from the tree it is applied to (quilt's refresh).

The maintainer's loop, as in quilt: ``patchkit apply`` on a release tree,
edit the patched files there, ``patchkit refresh ID``. The variant's diff is
rewritten from each file's original (the backup patchkit keeps) to the file
as it is now, with the variant's lines of context; a file the patch creates
is copied back to ``patches/<id>/files/``. The tree's record of the patch is
updated in one transaction, so ``status`` still says ``applied`` and
``revert`` still gives the original back.

Only the top patch of a file can be refreshed: a later patch applied on the
same file would end up inside this one's diff (revert it first, as quilt
asks you to pop).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from patchkit.catalogue.model import Catalogue, Variant
from patchkit.engine import signals
from patchkit.engine.assess import TreeFiles
from patchkit.engine.decide import later_on_same_files
from patchkit.engine.diffs import unified_diff
from patchkit.engine.fsutil import write_cache_file
from patchkit.engine.safepath import Root
from patchkit.engine.state import (
    STATE_DIR,
    FileRecord,
    PatchRecord,
    State,
    backup_path,
    load_state,
)
from patchkit.engine.transaction import TreeLock, commit, interrupted
from patchkit.errors import PatchkitError
from patchkit.target.tree import VllmTree, sha256_bytes


@dataclass
class RefreshReport:
    patch_id: str
    variant: str
    diff: Path
    changed: list[str] = field(default_factory=list)  # files in the new diff
    unchanged: list[str] = field(default_factory=list)  # back to their original: left out
    created: list[Path] = field(default_factory=list)  # sources copied back to files/
    added: list[str] = field(default_factory=list)  # --add: files newly in the patch

    def to_json(self) -> dict:
        return {
            "ok": True,
            "patch": self.patch_id,
            "variant": self.variant,
            "diff": str(self.diff),
            "changed": self.changed,
            "unchanged": self.unchanged,
            "created": [str(p) for p in self.created],
            "added": self.added,
        }


def refresh(
    tree: VllmTree,
    catalogue: Catalogue,
    patch_id: str,
    variant_name: str | None = None,
    add: tuple[str, ...] = (),
    pristine: Path | None = None,
) -> RefreshReport:
    patch = catalogue.get(patch_id)
    with TreeLock(tree.fs), signals.held():
        if interrupted(tree.fs):
            raise PatchkitError(
                "an interrupted run left a journal; run `patchkit apply` or `patchkit revert` "
                "first, then refresh"
            )
        state = load_state(tree.fs, catalogue.file_kinds)
        record = state.patches.get(patch.id)
        if record is None and not add:
            raise PatchkitError(
                f"{patch.id} is not applied on {tree.root}: `patchkit apply --only {patch.id} "
                f"--target {tree.root}`, edit the files, then refresh (or, to make a variant "
                "from edits of a pristine tree, name the edited files with --add)"
            )
        variant = patch.variant(variant_name or (record.variant if record else ""))
        if variant is None:
            known = ", ".join(v.name for v in patch.variants)
            raise PatchkitError(f"{patch.id} has no variant {variant_name!r} (it has: {known})")
        if record is None:  # patch-package's way: the patch is made from the edits
            record = state.patches[patch.id] = PatchRecord(patch.id, "0" * 64, variant.name,
                                                           _now(), [])  # fmt: skip
        originals = _originals(tree, state, record.files, add, pristine)
        files = TreeFiles(tree, state, catalogue.ids)
        above = later_on_same_files(patch, tuple(originals), files)
        if above is not None:
            raise PatchkitError(
                f"{above[0]}, later in the series, is applied on {above[1]} too and would end up "
                f"in {patch.id}'s diff; revert it first (patchkit revert --only {above[0]})"
            )
        report = _write_sources(tree, variant, originals, patch.id)
        report.added = [p for p in add if p not in {f.path for f in record.files}]
        _record(tree, state, patch.id, variant, originals)
    return report


def _originals(
    tree: VllmTree,
    state: State,
    records: list[FileRecord],
    add: tuple[str, ...],
    pristine: Path | None,
) -> dict[str, bytes | None]:
    """Each file of the patch -> its bytes before the patch (None: the patch creates it)."""
    found = {}
    for entry in records:
        if entry.pre_sha256 is None:
            found[entry.path] = None
            continue
        data = tree.fs.read(f"{STATE_DIR}/{entry.backup}", str(state.path))
        if data is None or sha256_bytes(data) != entry.pre_sha256:
            raise PatchkitError(
                f"the backup of {entry.path} is missing or damaged; refresh needs it as the "
                "original (reinstall vLLM, apply, edit again)"
            )
        found[entry.path] = data
    for relpath in add:
        others = sorted(p.id for p in state.patches.values() for f in p.files if f.path == relpath)
        if relpath not in found and others:
            raise PatchkitError(
                f"{relpath} is patched by {', '.join(others)} too; a file shared with other "
                "patches joins this one while they are applied, with their result as its "
                "original: apply this patch's variant first (even a partial one), then refresh"
            )
        if relpath not in found:
            found[relpath] = _pristine_file(tree, relpath, pristine)
    return found


def _pristine_file(tree: VllmTree, relpath: str, pristine: Path | None) -> bytes | None:
    """A file's original for --add, from a pristine tree of the same release."""
    if pristine is None:
        from patchkit.target.fetch import fetch

        pristine = fetch(tree.version)
    with Root.open(pristine) as fs:
        data = fs.read(relpath, "--pristine")
    recorded = tree.record.get(relpath)
    if data is not None and recorded is not None and sha256_bytes(data) != recorded:
        raise PatchkitError(
            f"{pristine}/{relpath} is not vLLM {tree.version}'s file (RECORD); pass "
            "--pristine a pristine tree of the same release"
        )
    return data  # None: vLLM has no such file, the patch creates it


def _write_sources(
    tree: VllmTree, variant: Variant, originals: dict[str, bytes | None], patch_id: str
) -> RefreshReport:
    """Write the variant's diff and created files from the tree as it is now."""
    report = RefreshReport(patch_id, variant.name, variant.diff_path)
    parts = []
    for relpath, original in originals.items():
        current = tree.fs.read(relpath, "refresh")
        if original is None:
            if current is None:
                raise PatchkitError(f"{relpath}, a file {patch_id} creates, is not in the tree")
            if relpath not in variant.created:
                raise PatchkitError(
                    f"{relpath} is a new file: list it in the variant's creates in "
                    f"{variant.diff_path.parent / 'patch.toml'} first"
                )
            write_cache_file(variant.files_dir / relpath, current)
            report.created.append(variant.files_dir / relpath)
        elif current == original:
            report.unchanged.append(relpath)
        else:
            parts.append(unified_diff(relpath, _text(original), _text(current), variant.context))
            report.changed.append(relpath)
    write_cache_file(variant.diff_path, "".join(parts).encode("utf-8", errors="surrogateescape"))
    return report


def _record(tree: VllmTree, state: State, patch_id: str, variant: Variant, originals: dict) -> None:
    """The patch's record now describes the files as they are, and the refreshed variant."""
    fresh = replace(variant)  # a new object: its sha256 is read from the rewritten files
    records, backups = [], {}
    for relpath, original in originals.items():
        current = tree.fs.read(relpath, "refresh")
        if original is not None and current == original:
            continue  # no longer part of the patch
        backup = None if original is None else backup_path(patch_id, relpath)
        if backup is not None:
            backups[backup] = original
        pre = None if original is None else sha256_bytes(original)
        records.append(FileRecord(relpath, pre, sha256_bytes(current), backup))
    if not records:
        raise PatchkitError(
            f"every file of {patch_id} is back to its original: nothing left to refresh into "
            "a diff; edit the files, or revert the patch"
        )
    entry = state.patches[patch_id]
    entry.files, entry.variant, entry.patch_sha256 = records, fresh.name, fresh.sha256
    state.vllm_version = state.vllm_version or tree.version
    commit(state, [], backups)


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="surrogateescape")
