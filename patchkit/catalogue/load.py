"""The patch catalogue: ``patches/series.toml`` and ``patches/<id>/patch.toml``.

Modelled on quilt's series (the order patches apply in), Spack's
version-ranged patches (PEP 440 specifiers mapped to diff files) and
vllm-ascend's per-patch record (Why / Upstream / Remove-When).

Each patch has *variants* (one unified diff per vLLM code family) and
*decisions* (releases where the patch is ``upstream`` or ``not-applicable``,
each with content evidence so that untested versions are decided by content,
not by number). Every tested release must map to exactly one of them.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from patchkit.engine.hunks import FilePatch, parse_diff
from patchkit.engine.safepath import checked_relpath
from patchkit.errors import PatchkitError
from patchkit.target.tree import is_version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PATCHES_DIR_ENV = "PATCHKIT_PATCHES_DIR"
DECISION_STATES = ("upstream", "not-applicable")


@dataclass(frozen=True)
class Evidence:
    """A regular expression that must match in a vLLM file (content check)."""

    file: str
    pattern: str

    def found_in(self, text: str) -> bool:
        return re.search(self.pattern, text, re.MULTILINE) is not None


@dataclass(frozen=True)
class Variant:
    """One unified diff for one code family of vLLM."""

    name: str
    diff_path: Path
    versions: SpecifierSet

    @cached_property
    def diff_bytes(self) -> bytes:
        try:
            return self.diff_path.read_bytes()
        except OSError as exc:
            raise PatchkitError(f"{self.diff_path}: cannot read the diff: {exc.strerror}") from None

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.diff_bytes).hexdigest()

    @cached_property
    def files(self) -> tuple[FilePatch, ...]:
        text = self.diff_bytes.decode("utf-8", errors="replace")
        return tuple(parse_diff(text, str(self.diff_path)))

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)

    def file_patch(self, relpath: str) -> FilePatch:
        """The hunks this variant has for one file."""
        for file_patch in self.files:
            if file_patch.path == relpath:
                return file_patch
        raise PatchkitError(f"{self.diff_path}: no hunks for {relpath}")


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
class Diagnosis:
    """What ``doctor`` needs to judge the bug(s) a patch addresses, declared by the patch.

    Patches that address the same bug must declare the same facts (checked
    when the catalogue loads), so a bug is judged once, from data.
    """

    bugs: tuple[str, ...]  # "vllm#48590"
    title: str
    affected: SpecifierSet  # vLLM versions with the bug
    fix: str  # the command that fixes it
    protects: str  # the verdict's reason when this patch is applied and in effect
    needs_compute_capability: str = ""  # e.g. "9.0": other GPUs are not affected
    fixed_by_ptxas: str = ""  # e.g. "13.3": Triton's ptxas from this version on fixes it
    kernel_scan: bool = False  # `doctor --kernels` evidence decides the verdict
    replaces_kernels: bool = False  # applied and on, no scanned Triton kernel runs
    disabled_by: tuple[Switch, ...] = ()  # settings that turn this patch's protection off

    @property
    def label(self) -> str:
        """'vLLM #47639 / #57851: title'."""
        numbers = " / ".join("#" + b.split("#", 1)[1] for b in self.bugs)
        return f"vLLM {numbers}: {self.title}"

    def facts(self) -> tuple:
        return (self.bugs, self.title, str(self.affected), self.fix,
                self.needs_compute_capability, self.fixed_by_ptxas, self.kernel_scan)  # fmt: skip


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
        raise PatchkitError(f"unknown patch {patch_id!r}; known: {', '.join(self.ids)}")

    def is_tested(self, version: Version | None) -> bool:
        return version is not None and str(version) in self.tested_releases

    def predates(self, version: Version | None) -> bool:
        """Whether ``version`` is older than every release the catalogue covers."""
        return version is not None and version < min(Version(r) for r in self.tested_releases)

    @property
    def tested_span(self) -> str:
        return f"{self.tested_releases[0]} to {self.tested_releases[-1]}"


def default_root() -> Path:
    """The catalogue shipped with patchkit, unless PATCHKIT_PATCHES_DIR names another."""
    override = os.environ.get(PATCHES_DIR_ENV)
    if override:
        return Path(override)
    package = Path(__file__).resolve().parent.parent
    installed = package / "patches"  # a wheel install carries patches/ inside the package
    return installed if installed.is_dir() else package.parent / "patches"


def load_catalogue(root: Path | None = None) -> Catalogue:
    root = Path(root) if root is not None else default_root()
    series_file = root / "series.toml"
    series = _read_toml(series_file)
    ids = _require(series, "series", series_file, list)
    releases = tuple(_require(series, "tested_releases", series_file, list))
    for release in releases:
        if not isinstance(release, str) or not is_version(release):
            raise PatchkitError(f"{series_file}: tested_releases: {release!r} is not a version")
    if len(set(ids)) != len(ids):
        raise PatchkitError(f"{series_file}: series lists a patch twice")
    patches = tuple(_load_patch(root / patch_id, patch_id) for patch_id in ids)
    for patch in patches:
        _check_decided_once(patch, releases)
        for notice in patch.notices:
            if notice.fixed_by and notice.fixed_by not in ids:
                raise PatchkitError(
                    f"{patch.root / 'patch.toml'}: notices.fixed_by: {notice.fixed_by!r} is "
                    "not in the series"
                )
    _check_shared_diagnoses(patches)
    return Catalogue(root=root, patches=patches, tested_releases=releases)


def _check_shared_diagnoses(patches: tuple[Patch, ...]) -> None:
    """Patches that address the same bug declare the same facts about it."""
    seen: dict[str, tuple[Patch, tuple]] = {}
    for patch in patches:
        if patch.diagnosis is None:
            continue
        for bug in patch.diagnosis.bugs:
            first = seen.setdefault(bug, (patch, patch.diagnosis.facts()))
            if first[1] != patch.diagnosis.facts():
                raise PatchkitError(
                    f"{patch.root / 'patch.toml'}: diagnosis of {bug} differs from "
                    f"{first[0].id}'s (bugs, title, affected, fix and conditions must agree)"
                )


def _check_decided_once(patch: Patch, releases: tuple[str, ...]) -> None:
    """Every tested release maps to exactly one variant or decision of the patch."""
    meta_file = patch.root / "patch.toml"
    for release in releases:
        version = Version(release)
        matches = [
            f"{type(e).__name__.lower()} {getattr(e, 'name', None) or getattr(e, 'state', '')} "
            f"({e.versions})"
            for e in (*patch.variants, *patch.decisions)
            if e.versions.contains(version, prereleases=True)
        ]
        if len(matches) != 1:
            found = ", ".join(matches) or "none"
            raise PatchkitError(
                f"{meta_file}: variants/decisions: tested release {release} must be decided "
                f"exactly once, found {found}"
            )


def _load_patch(directory: Path, patch_id: str) -> Patch:
    meta_file = directory / "patch.toml"
    meta = _read_toml(meta_file)
    if meta.get("id") != patch_id:
        raise PatchkitError(f"{meta_file}: id must be {patch_id!r} (the series entry)")
    variants = tuple(
        Variant(
            name=_require(v, "name", meta_file, str),
            diff_path=directory / _require(v, "diff", meta_file, str),
            versions=_specifier(v, meta_file),
        )
        for v in meta.get("variants", [])
    )
    decisions = tuple(
        Decision(
            state=_decision_state(d, meta_file),
            versions=_specifier(d, meta_file),
            reason=_require(d, "reason", meta_file, str),
            evidence=_evidence(d, meta_file),
        )
        for d in meta.get("decisions", [])
    )
    notices = tuple(
        Notice(
            versions=_specifier(n, meta_file),
            message=_require(n, "message", meta_file, str),
            evidence=_evidence(n, meta_file, required=False),
            fixed_by=n.get("fixed_by", ""),
        )
        for n in meta.get("notices", [])
    )
    for variant in variants:
        _ = variant.files  # parse now: a broken diff or a path outside vllm/ fails the load
    return Patch(
        id=patch_id,
        title=_require(meta, "title", meta_file, str),
        why=_require(meta, "why", meta_file, str).strip(),
        upstream=tuple(_require(meta, "upstream", meta_file, list)),
        remove_when=_require(meta, "remove_when", meta_file, str).strip(),
        variants=variants,
        decisions=decisions,
        notices=notices,
        runtime_gate=meta.get("runtime_gate", "").strip(),
        overridden_by=_override(meta.get("overridden_by"), meta_file),
        covers=meta.get("covers", "").strip(),
        diagnosis=_diagnosis(meta.get("diagnosis"), meta_file),
        root=directory,
    )


def _diagnosis(table: dict | None, origin: Path) -> Diagnosis | None:
    if table is None:
        return None
    bugs = tuple(_require(table, "bugs", origin, list))
    if not all(isinstance(b, str) and re.fullmatch(r"[a-z-]+#\d+", b) for b in bugs):
        raise PatchkitError(f"{origin}: diagnosis.bugs: ids look like 'vllm#48590', got {bugs}")
    return Diagnosis(
        bugs=bugs,
        title=_require(table, "title", origin, str),
        affected=_specifier({"versions": table.get("affected")}, origin),
        fix=_require(table, "fix", origin, str),
        protects=_require(table, "protects", origin, str),
        needs_compute_capability=table.get("needs_compute_capability", ""),
        fixed_by_ptxas=table.get("fixed_by_ptxas", ""),
        kernel_scan=bool(table.get("kernel_scan", False)),
        replaces_kernels=bool(table.get("replaces_kernels", False)),
        disabled_by=_switches(table.get("disabled_by", []), origin),
    )


def _switches(tables, origin: Path) -> tuple[Switch, ...]:
    """`disabled_by`: one { env, values | unless } table or a list of them."""
    tables = [tables] if isinstance(tables, dict) else tables
    found = []
    for table in tables:
        if not isinstance(table, dict) or not isinstance(table.get("env"), str):
            raise PatchkitError(f"{origin}: diagnosis.disabled_by: each entry needs env = '...'")
        if ("values" in table) == ("unless" in table):
            raise PatchkitError(
                f"{origin}: diagnosis.disabled_by {table['env']}: give values or unless, not both"
            )
        lower = tuple(str(v).strip().lower() for v in table.get("values", table.get("unless")))
        unless = lower if "unless" in table else None
        found.append(Switch(table["env"], () if unless is not None else lower, unless))
    return tuple(found)


def _override(table: dict | None, origin: Path) -> Override | None:
    if table is None:
        return None
    return Override(
        env=_require(table, "env", origin, str),
        versions=_specifier(table, origin),
        detail=_require(table, "detail", origin, str).strip(),
        check=table.get("check", ""),
    )


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise PatchkitError(f"{path}: cannot read the patch catalogue: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise PatchkitError(f"{path}: invalid TOML: {exc}") from None


def _require(table: dict, key: str, origin: Path, kind: type):
    value = table.get(key)
    if not isinstance(value, kind) or not value:
        raise PatchkitError(f"{origin}: missing or empty {key!r} ({kind.__name__} expected)")
    return value


def _specifier(table: dict, origin: Path) -> SpecifierSet:
    text = _require(table, "versions", origin, str)
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise PatchkitError(f"{origin}: invalid version specifier {text!r}") from None


def _decision_state(table: dict, origin: Path) -> str:
    state = _require(table, "state", origin, str)
    if state not in DECISION_STATES:
        raise PatchkitError(f"{origin}: state {state!r} is not one of {DECISION_STATES}")
    return state


def _evidence(table: dict, origin: Path, required: bool = True) -> tuple[Evidence, ...]:
    items = table.get("evidence", [])
    if required and not items:
        raise PatchkitError(f"{origin}: a decision needs content evidence (file + pattern)")
    evidence = []
    for item in items:
        file = _require(item, "file", origin, str)
        checked_relpath(file, f"{origin}: evidence file")
        pattern = _require(item, "pattern", origin, str)
        try:
            re.compile(pattern)
        except re.error as exc:
            raise PatchkitError(f"{origin}: evidence pattern {pattern!r}: {exc}") from None
        evidence.append(Evidence(file=file, pattern=pattern))
    return tuple(evidence)
