"""The catalogue's data model: patches, their variants, decisions, notices and bugs.

Plain frozen dataclasses; :mod:`patchkit.catalogue.load` builds them from
``patches/`` and checks them. A variant's diff and created files are read
lazily, once.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from patchkit.codes import Code, Reason
from patchkit.diffs.hunks import FilePatch, created_file_patch, parse_diff
from patchkit.errors import FileProblem, PatchkitError

DECISION_STATES = ("upstream", "not-applicable")

# a range's specifiers in the order people write them: lower bounds, pins, upper bounds
_BOUND_ORDER = {">": 0, ">=": 0, "~=": 1, "==": 1, "===": 1, "!=": 2, "<": 3, "<=": 3}


def range_text(versions: SpecifierSet) -> str:
    """A version range as the catalogue writes it, lower bound first (``>=0.17.0,<0.33.0``);
    SpecifierSet's own text sorts its specifiers as strings, so ``<`` came first."""
    specifiers = sorted(versions, key=lambda s: (_BOUND_ORDER.get(s.operator, 2), str(s)))
    return ",".join(str(s) for s in specifiers)


class CatalogueInvalid(FileProblem):
    """A catalogue file (series.toml, bugs.toml, a patch.toml, a diff or a file a patch
    creates) that cannot be read or does not say what the catalogue must: ``path`` and
    ``detail``. Nothing is loaded."""

    code = Code.CATALOGUE_INVALID


class UnknownPatch(PatchkitError):
    """A patch id the catalogue does not have: ``patch``, and the ids it ``known``."""

    code = Code.UNKNOWN_PATCH


@dataclass(frozen=True)
class Evidence:
    """A regular expression that must match in a vLLM file (content check), or, with
    ``absent``, the fact that the release does not ship the file (a removed module)."""

    file: str
    pattern: str = ""
    absent: bool = False

    def holds(self, text: str | None) -> bool:
        """Whether the evidence holds on the file's text (None: the file is not there)."""
        if self.absent:
            return text is None
        return re.search(self.pattern, text or "", re.MULTILINE) is not None


@dataclass(frozen=True)
class Variant:
    """One code family's change: a unified diff of vLLM's files, plus files it creates.

    A file the patch adds to the tree lives as a real source under
    ``patches/<id>/files/<path>`` (linted, formatted and imported by tests
    like any module); its new-file hunk is made from it when the catalogue
    loads, never written by hand. ``made_on`` is the release the diff is made
    on (``patchkit refresh`` on that release's tree reproduces it byte for
    byte); ``context`` the lines of context its hunks carry.
    """

    name: str
    diff_path: Path
    versions: SpecifierSet
    created: tuple[str, ...] = ()
    made_on: str = ""
    context: int = 3
    # One tested release per code family of the files the variant changes (where the
    # code it runs with differs): the tests that run the patched code on real releases
    # take these; none declared means every tested release of the variant.
    families: tuple[str, ...] = ()

    @property
    def files_dir(self) -> Path:
        return self.diff_path.parent / "files"

    @property
    def made(self) -> bool:
        """False for a variant a maintainer has declared but not yet made with refresh.

        The diff is what refresh makes (empty when the variant only creates
        files), so it alone says: a variant that declares ``creates`` is not
        made until refresh has written its diff and copied its files.
        """
        return self.diff_path.exists()

    @cached_property
    def diff_bytes(self) -> bytes:
        if not self.made:
            return b""
        try:
            return self.diff_path.read_bytes()
        except OSError as exc:
            raise CatalogueInvalid(
                self.diff_path, f"cannot read the diff: {exc.strerror}"
            ) from None

    @cached_property
    def created_bytes(self) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        if not self.made:
            return found
        for relpath in self.created:
            source = self.files_dir / relpath
            try:
                found[relpath] = source.read_bytes()
            except OSError as exc:
                raise CatalogueInvalid(
                    self.diff_path.parent / "patch.toml",
                    f"variants.creates: {source}: cannot read the created file: {exc.strerror}",
                ) from None
        return found

    @cached_property
    def sha256(self) -> str:
        """Of the diff and every created file (path and bytes): what was applied."""
        return variant_sha256(self.diff_bytes, self.created_bytes)

    @cached_property
    def files(self) -> tuple[FilePatch, ...]:
        if not self.made:
            return ()
        return variant_files(self.diff_bytes, self.created_bytes, str(self.diff_path))

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)

    def file_patch(self, relpath: str) -> FilePatch:
        """The hunks this variant has for one file."""
        for file_patch in self.files:
            if file_patch.path == relpath:
                return file_patch
        raise CatalogueInvalid(self.diff_path, f"no hunks for {relpath}")


def variant_sha256(diff: bytes, created: dict[str, bytes]) -> str:
    """A variant's sha256 from its diff and created files' bytes (refresh: before writing)."""
    digest = hashlib.sha256(diff)
    for relpath, data in sorted(created.items()):
        digest.update(b"\0" + relpath.encode() + b"\0" + data)
    return digest.hexdigest()


def variant_files(diff: bytes, created: dict[str, bytes], origin: str) -> tuple[FilePatch, ...]:
    """The file patches of a made variant: its diff's, then a new-file hunk per created file.

    Bytes that are not UTF-8 stay themselves (surrogateescape), as the tree's
    files are read, so a diff gives back exactly the bytes it was made from.
    """
    text = diff.decode("utf-8", errors="surrogateescape")
    changed = tuple(parse_diff(text, origin)) if text.strip() else ()
    made = tuple(
        created_file_patch(relpath, data.decode("utf-8", errors="surrogateescape"))
        for relpath, data in created.items()
    )
    if not changed and not made:
        raise CatalogueInvalid(origin, "no file changes found in the diff")
    return changed + made


@dataclass(frozen=True)
class Decision:
    """Releases where the patch is upstream or not applicable, and the proof."""

    state: str
    versions: SpecifierSet
    reason: str
    evidence: tuple[Evidence, ...]


@dataclass(frozen=True)
class Notice:
    """A known problem that the patch does not fix, warned about by status.

    ``fixed_by``: the id of a patch that fixes it; once that patch is
    applied, the notice is not shown.
    """

    versions: SpecifierSet
    message: str
    evidence: tuple[Evidence, ...] = ()
    fixed_by: str = ""


@dataclass(frozen=True)
class Override:
    """A setting that can replace the patched code path (checked by `doctor`).

    ``check`` names the doctor check that looks at it (``tuned-lora-configs``).
    """

    env: str
    versions: SpecifierSet
    detail: str
    check: str = ""


@dataclass(frozen=True)
class Switch:
    """An environment variable that turns a patch's protection off at run time.

    Off when its value (stripped, lower case) is one of `values`, or, with
    `unless`, when it is anything but those: VLLM_BATCH_INVARIANT counts as
    set for any value but empty or 0, PATCHKIT_LORA_BACKEND only for triton.
    """

    env: str
    values: tuple[str, ...] = ()
    unless: tuple[str, ...] | None = None

    def turned_off(self, environ) -> str:
        """The value that turns the protection off here, or '' if it does not."""
        value = environ.get(self.env, "").strip().lower()
        off = value not in self.unless if self.unless is not None else value in self.values
        return value if off else ""


@dataclass(frozen=True)
class Bug:
    """The facts about one upstream bug (or a group fixed together), from patches/bugs.toml."""

    ids: tuple[str, ...]  # ("vllm#48590",)
    title: str
    affected: SpecifierSet  # vLLM versions with the bug
    fix: str  # the command that fixes it
    needs_compute_capability: str = ""  # e.g. "9.0": other GPUs are not affected
    fixed_by_ptxas: str = ""  # e.g. "13.3": Triton's ptxas from this version on fixes it
    kernel_scan: bool = False  # `doctor --kernels` evidence decides the verdict
    upstream_fix: tuple[Evidence, ...] = ()  # how a release with the fix is recognised


@dataclass(frozen=True)
class Diagnosis:
    """What ``doctor`` needs to judge a patch's bug: the bug's facts, written once in
    patches/bugs.toml, and this patch's own part (what it protects, what turns it off)."""

    bug: Bug
    protects: str  # the verdict's reason when this patch is applied and in effect
    replaces_kernels: bool = False  # applied and on, no scanned Triton kernel runs
    disabled_by: tuple[Switch, ...] = ()  # settings that turn this patch's protection off

    bugs = property(lambda self: self.bug.ids)
    title = property(lambda self: self.bug.title)
    affected = property(lambda self: self.bug.affected)
    fix = property(lambda self: self.bug.fix)
    needs_compute_capability = property(lambda self: self.bug.needs_compute_capability)
    fixed_by_ptxas = property(lambda self: self.bug.fixed_by_ptxas)
    kernel_scan = property(lambda self: self.bug.kernel_scan)

    @property
    def label(self) -> str:
        """'vLLM #47639 / #57851: title'."""
        numbers = " / ".join("#" + b.split("#", 1)[1] for b in self.bugs)
        return f"vLLM {numbers}: {self.title}"


@dataclass(frozen=True)
class Patch:
    id: str
    title: str
    why: str
    upstream: tuple[str, ...]
    remove_when: str
    variants: tuple[Variant, ...]
    decisions: tuple[Decision, ...]
    notices: tuple[Notice, ...] = ()
    runtime_gate: str = ""
    overridden_by: Override | None = None
    covers: str = ""
    diagnosis: Diagnosis | None = None
    opt_in: bool = False  # a diagnostic: only `apply --only ID` applies it, plain apply never
    root: Path = field(default=Path("."), compare=False)

    def expected_for(self, version: Version | None) -> Variant | Decision | None:
        """The variant or decision the catalogue lists for this version."""
        if version is None:
            return None
        for entry in (*self.variants, *self.decisions):
            if entry.versions.contains(version, prereleases=True):
                return entry
        return None

    def variant(self, name: str) -> Variant | None:
        return next((v for v in self.variants if v.name == name), None)

    @cached_property
    def file_kinds(self) -> dict[str, set[str]]:
        """Each path any diff of this patch touches, and how: creates, changes, deletes.

        A state or journal entry is acted on only for these paths, so a forged
        entry cannot make patchkit delete or overwrite any other file.
        """
        kinds: dict[str, set[str]] = {}
        for variant in self.variants:
            for file_patch in variant.files:
                kinds.setdefault(file_patch.path, set()).add(file_patch.kind)
        return kinds


@dataclass(frozen=True)
class Catalogue:
    root: Path
    patches: tuple[Patch, ...]
    tested_releases: tuple[str, ...]
    # the staging of a refresh that died mid-write (journal.pending), left for refresh to
    # finish or undo: until then the catalogue may hold some of its files and not others
    interrupted_refresh: Path | None = None

    @property
    def interrupted_note(self) -> Reason | None:
        """What to say about :attr:`interrupted_refresh`, or None when there is none."""
        if self.interrupted_refresh is None:
            return None
        return Reason.of(Code.CATALOGUE_INTERRUPTED, journal=str(self.interrupted_refresh))

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.patches)

    def file_kinds(self, patch_id: str) -> dict[str, set[str]] | None:
        """Patch.file_kinds of a patch in the catalogue; None for an id it does not have."""
        patch = next((p for p in self.patches if p.id == patch_id), None)
        return None if patch is None else patch.file_kinds

    def get(self, patch_id: str) -> Patch:
        for patch in self.patches:
            if patch.id == patch_id:
                return patch
        raise UnknownPatch(
            f"unknown patch {patch_id!r}; {self.did_you_mean(patch_id)}"
            f"known: {', '.join(self.ids)}",
            patch=patch_id,
            known=self.ids,
        )

    def did_you_mean(self, patch_id: str) -> str:
        """ "did you mean 'x'? " for the known id closest to a mistyped one, else "": a typo
        (expand-blockn) is named at once instead of left to be found among every id."""
        close = difflib.get_close_matches(patch_id, self.ids, n=1)
        return f"did you mean {close[0]!r}? " if close else ""

    def is_tested(self, version: Version | None) -> bool:
        return version is not None and str(version) in self.tested_releases

    def predates(self, version: Version | None) -> bool:
        """Whether ``version`` is older than every release the catalogue covers."""
        return version is not None and version < min(Version(r) for r in self.tested_releases)

    @property
    def newest_tested(self) -> str:
        """The newest release the catalogue decided (a version, not the last listed)."""
        return max(self.tested_releases, key=Version)

    @property
    def tested_span(self) -> str:
        return f"{self.tested_releases[0]} to {self.tested_releases[-1]}"
