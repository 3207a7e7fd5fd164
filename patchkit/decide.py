"""Decide each patch's state on a tree, by content first and by version second.

States:

* ``needed``         - a variant's pristine side matches; applying is safe.
* ``applied``        - patchkit's patched text is there.
* ``upstream``       - this release already has the fix (content evidence).
* ``not-applicable`` - this release's design makes the patch meaningless.
* ``conflict``       - neither pristine nor patched: a fork, a hand edit, a
  half-applied patch, or a file that differs from the wheel's RECORD.

The version only orders the search (the variant listed for it is tried
first) and decides whether to warn that the release is untested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from patchkit.catalogue import Catalogue, Decision, Patch, Variant
from patchkit.errors import HunkMismatch
from patchkit.hunks import Placement, apply_file_patch
from patchkit.safepath import inside
from patchkit.state import FileRecord, PatchRecord, State
from patchkit.transaction import FileChange
from patchkit.tree import VllmTree, sha256_bytes

NEEDED = "needed"
APPLIED = "applied"
UPSTREAM = "upstream"
NOT_APPLICABLE = "not-applicable"
CONFLICT = "conflict"


@dataclass
class Assessment:
    """One patch's state on one tree, and what applying it would write."""

    patch: Patch
    state: str
    reason: str = ""
    variant: Variant | None = None
    files: tuple[str, ...] = ()
    placements: list[Placement] = field(default_factory=list)
    changes: list[FileChange] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Known upstream bugs this patch does not fix but a user of this release
    # should know about; shown by every command, never a failure (not --strict).
    notices: list[str] = field(default_factory=list)
    record: PatchRecord | None = None

    def to_json(self) -> dict:
        return {
            "id": self.patch.id,
            "state": self.state,
            "reason": self.reason or None,
            "variant": self.variant.name if self.variant else None,
            "files": list(self.files),
            "warnings": self.warnings,
            "notices": self.notices,
        }


class TreeFiles:
    """The tree's files as a run sees them: read once, with the run's own edits on top.

    Patches stack (quilt's model): patch N is assessed on the tree as patches
    1..N-1 leave it. ``overlay`` puts a patch's result in place before the
    next patch is assessed; ``state`` and ``order`` (the series) say which
    applied patches already touch each file, in which order.
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
            path = inside(self.tree.root, relpath, "the catalogue")
            try:
                self._disk[relpath] = path.read_bytes()
            except FileNotFoundError:
                self._disk[relpath] = None
        return self._disk[relpath]

    def overlay(self, relpath: str, data: bytes | None) -> None:
        self._overlay[relpath] = data

    def text(self, relpath: str) -> str | None:
        data = self.data(relpath)
        return None if data is None else data.decode("utf-8", errors="surrogateescape")

    def sha256(self, relpath: str) -> str | None:
        data = self.data(relpath)
        return None if data is None else sha256_bytes(data)

    def chain(self, relpath: str) -> list[tuple[str, FileRecord]]:
        """(patch id, record) of each applied patch touching ``relpath``, in series order."""
        if self.state is None:
            return []
        ids = list(self.order) + sorted(set(self.state.patches) - set(self.order))
        return [
            (patch_id, record)
            for patch_id in ids
            if patch_id in self.state.patches
            for record in self.state.patches[patch_id].files
            if record.path == relpath
        ]

    def base_sha256(self, relpath: str) -> str | None:
        """The file before any patch: what the wheel's RECORD describes."""
        chain = self.chain(relpath)
        if chain:
            return chain[0][1].pre_sha256
        data = self.disk(relpath)
        return None if data is None else sha256_bytes(data)


def assess_with(
    patch: Patch, tree: VllmTree, state: State, catalogue: Catalogue, files: TreeFiles
) -> Assessment:
    version = tree.parsed_version
    expected = patch.expected_for(version)
    result = (
        _from_record(patch, state.patches.get(patch.id), files)
        or _from_decisions(patch, expected, files)
        or _from_variants(patch, expected, tree, files)
    )
    if not catalogue.is_tested(version):
        result.warnings.insert(
            0,
            f"vLLM {tree.version} is not a tested release ({catalogue.tested_span}); "
            "decided by content",
        )
    result.notices.extend(_notices(patch, tree, files))
    return result


def _from_record(patch: Patch, record: PatchRecord | None, files: TreeFiles) -> Assessment | None:
    """Trust our own record when the files still carry the hashes the stack of records wrote.

    For each file, the applied patches touching it form a chain in series
    order (each one's ``pre`` is the one below's ``post``); the file must
    hold the top one's ``post``. A file back at the bottom one's ``pre``
    means vLLM was reinstalled: the record is stale and content decides.
    """
    if record is None:
        return None
    paths = tuple(f.path for f in record.files)
    findings = [chain_finding(files, f.path) for f in record.files]
    if all(kind == "applied" for kind, _ in findings):
        variant = patch.variant(record.variant)
        result = Assessment(patch, APPLIED, variant=variant, files=paths, record=record)
        if variant is None or variant.sha256 != record.patch_sha256:
            result.warnings.append(
                f"{patch.id}: the patch file changed since it was applied; run "
                f"`patchkit revert --only {patch.id}` then `patchkit apply --only {patch.id}`"
            )
        return result
    if all(kind == "stale" for kind, _ in findings):
        return None  # vLLM was reinstalled over a patched tree: the record is stale
    # Some file edited, or some back to its original while others still carry the
    # patch (a partial reinstall): either way, not a state patchkit left.
    edited, (kind, top) = next(
        (f.path, found) for f, found in zip(record.files, findings, strict=True)
        if found[0] != "applied"
    )  # fmt: skip
    if kind == "stale":
        what = f"{edited} is back to its original while the rest of {patch.id} is applied "
        what += "(vLLM partly reinstalled?)"
    else:
        what = f"{edited} was edited after patchkit applied {top}"
    return Assessment(
        patch,
        CONFLICT,
        reason=f"{what}; `patchkit revert --only {top} --force` restores the original",
        files=paths,
        record=record,
    )


def chain_finding(files: TreeFiles, relpath: str) -> tuple[str, str]:
    """(applied | stale | edited, the top patch) for one file's chain of records."""
    chain = files.chain(relpath)
    current = files.sha256(relpath)
    top_id, top = chain[-1]
    linked = all(
        below.post_sha256 == above.pre_sha256
        for (_, below), (_, above) in zip(chain, chain[1:], strict=False)
    )
    if linked and current == top.post_sha256:
        return "applied", top_id
    on_disk = files.disk(relpath)
    if (None if on_disk is None else sha256_bytes(on_disk)) == chain[0][1].pre_sha256:
        return "stale", top_id  # the file on disk is back to before the whole stack
    return "edited", top_id


def _from_decisions(
    patch: Patch, expected: Variant | Decision | None, files: TreeFiles
) -> Assessment | None:
    ordered = sorted(patch.decisions, key=lambda d: d is not expected)
    for decision in ordered:
        if all(e.found_in(files.text(e.file) or "") for e in decision.evidence):
            evidence_files = tuple(dict.fromkeys(e.file for e in decision.evidence))
            return Assessment(patch, decision.state, reason=decision.reason, files=evidence_files)
    return None


def _from_variants(
    patch: Patch, expected: Variant | Decision | None, tree: VllmTree, files: TreeFiles
) -> Assessment:
    ordered = sorted(patch.variants, key=lambda v: v is not expected)
    for variant in ordered:
        attempt = _try_variant(variant, files, reverse=False)
        if attempt is not None:
            result = _needed(patch, variant, attempt, tree, files)
            if isinstance(expected, Variant) and variant is not expected:
                result.warnings.append(
                    f"{patch.id}: content matches variant {variant.name}, not "
                    f"{expected.name} listed for vLLM {tree.version}"
                )
            if isinstance(expected, Decision):
                result.warnings.append(
                    f"{patch.id}: the catalogue lists vLLM {tree.version} as {expected.state}, "
                    "but its evidence is not in this tree"
                )
            return result
    for variant in ordered:
        if _try_variant(variant, files, reverse=True) is not None:
            return Assessment(
                patch,
                APPLIED,
                reason=(
                    "the patched text is present but patchkit has no record of applying it "
                    "(applied by hand, or .patchkit/ was removed); revert reverse-applies the diff"
                ),
                variant=variant,
                files=variant.paths,
            )
    return _conflict(patch, expected, files)


def _try_variant(
    variant: Variant, files: TreeFiles, reverse: bool
) -> tuple[dict[str, str | None], list[Placement]] | None:
    """New texts and placements if every hunk of the variant applies, else None."""
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
                reason=(
                    f"{path} differs from the sha256 in vLLM {tree.version}'s RECORD "
                    "(edited, or not the wheel's file); reinstall vLLM "
                    f"(pip install --force-reinstall --no-deps vllm=={tree.version}) to patch it"
                ),
                variant=variant,
                files=variant.paths,
            )
    changes = [
        FileChange(
            path,
            files.data(path),
            None if text is None else text.encode("utf-8", errors="surrogateescape"),
        )
        for path, text in new_texts.items()
    ]
    return Assessment(
        patch, NEEDED, variant=variant, files=variant.paths, placements=placements, changes=changes
    )


def _conflict(patch: Patch, expected: Variant | Decision | None, files: TreeFiles) -> Assessment:
    variant = expected if isinstance(expected, Variant) else patch.variants[0]
    detail = "no variant matches"
    try:
        for file_patch in variant.files:
            apply_file_patch(files.text(file_patch.path), file_patch)
    except HunkMismatch as exc:
        detail = str(exc)
    return Assessment(
        patch,
        CONFLICT,
        reason=(
            f"variant {variant.name}: {detail}; the file is neither the pristine text "
            f"this patch expects nor its patched text"
        ),
        variant=variant,
        files=variant.paths,
    )


def _notices(patch: Patch, tree: VllmTree, files: TreeFiles) -> list[str]:
    version = tree.parsed_version
    found = []
    for notice in patch.notices:
        in_range = version is not None and notice.versions.contains(version, prereleases=True)
        has_evidence = all(e.found_in(files.text(e.file) or "") for e in notice.evidence)
        if notice.fixed_by and _applied(notice.fixed_by, files):
            continue
        if has_evidence and (in_range or (version is None and notice.evidence)):
            found.append(f"{patch.id}: {notice.message}")
    return found


def _applied(patch_id: str, files: TreeFiles) -> bool:
    """Whether our record of ``patch_id`` still holds on the files (its fix is in place)."""
    record = files.state.patches.get(patch_id) if files.state else None
    return record is not None and all(
        chain_finding(files, f.path)[0] == "applied" for f in record.files
    )
