"""Load and check the patch catalogue: ``series.toml``, ``bugs.toml``, ``<id>/patch.toml``.

Modelled on quilt's series (the order patches apply in), Spack's
version-ranged patches (PEP 440 specifiers mapped to diff files) and
vllm-ascend's per-patch record (Why / Upstream / Remove-When).

Each patch has *variants* (one unified diff per vLLM code family) and
*decisions* (releases where the patch is ``upstream`` or ``not-applicable``,
each with content evidence so that untested versions are decided by content,
not by number). Every tested release must map to exactly one of them.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from patchkit.catalogue import journal
from patchkit.catalogue.model import (
    DECISION_STATES,
    Bug,
    Catalogue,
    CatalogueInvalid,
    Decision,
    Diagnosis,
    Evidence,
    Notice,
    Override,
    Patch,
    Switch,
    Variant,
    range_text,
)
from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError
from patchkit.fs.safepath import checked_relpath
from patchkit.identity import is_version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PATCHES_DIR_ENV = "PATCHKIT_PATCHES_DIR"

# Every table the catalogue's files hold, and the keys each may hold. A key not listed is
# refused when the file loads, with one line naming the file, the table and the key, and
# nothing loads: a typo of an optional key (`opt-in` for `opt_in`) would otherwise change
# what `apply` does without a word. A key whose value is a table (`[diagnosis]`) or an
# array of tables (`[[variants]]`, `evidence = [{...}]`) names, in brackets, the entry
# that lists that table's keys. A new key is one word here (and the code that reads it);
# a file the loader does not read (patches/survey.toml) is not checked.
SCHEMA: dict[str, dict[str, str | None]] = {
    "series.toml": {"series": None, "tested_releases": None},
    "bugs.toml": {"bug": "[[bug]]"},
    "bug": {
        "ids": None,
        "title": None,
        "affected": None,
        "fix": None,
        "needs_compute_capability": None,
        "fixed_by_ptxas": None,
        "kernel_scan": None,
        "upstream_fix": "[upstream_fix]",
    },
    "upstream_fix": {"evidence": "[[evidence]]"},
    "patch.toml": {
        "id": None,
        "title": None,
        "why": None,
        "upstream": None,
        "remove_when": None,
        "runtime_gate": None,
        "covers": None,
        "opt_in": None,
        "variants": "[[variants]]",
        "decisions": "[[decisions]]",
        "notices": "[[notices]]",
        "diagnosis": "[diagnosis]",
        "overridden_by": "[overridden_by]",
    },
    "variants": {
        "name": None,
        "diff": None,
        "versions": None,
        "made_on": None,
        "creates": None,
        "context": None,
        "families": None,
    },
    "decisions": {
        "state": None,
        "versions": None,
        "reason": None,
        "evidence": "[[evidence]]",
        "evidence_from": None,
    },
    "notices": {"versions": None, "message": None, "evidence": "[[evidence]]", "fixed_by": None},
    "diagnosis": {
        "bugs": None,
        "protects": None,
        "replaces_kernels": None,
        "disabled_by": "[[disabled_by]]",
    },
    "disabled_by": {"env": None, "values": None, "unless": None},
    "overridden_by": {"env": None, "versions": None, "detail": None, "check": None},
    # { file, pattern }: a pattern that must match; { file, absent = true }: no such file
    "evidence": {"file": None, "pattern": None, "absent": None},
}
BUG_FACTS = (
    "title",
    "affected",
    "fix",
    "needs_compute_capability",
    "fixed_by_ptxas",
    "kernel_scan",
)
# what an unknown key most likely means, where it is more than a typo
HINTS = {("diagnosis", fact): "a bug's facts are written once, in bugs.toml" for fact in BUG_FACTS}
MAX_SHOWN_KEY = 60  # characters of an unknown key an error line quotes


def default_root() -> Path:
    """The catalogue shipped with patchkit, unless PATCHKIT_PATCHES_DIR names another."""
    override = os.environ.get(PATCHES_DIR_ENV)
    if override:
        return Path(override)
    package = Path(__file__).resolve().parent.parent
    installed = package / "patches"  # a wheel install carries patches/ inside the package
    return installed if installed.is_dir() else package.parent / "patches"


def installed_catalogue(root: Path) -> bool:
    """Whether ``root`` is a catalogue installed with patchkit (a wheel), not a source checkout.

    An installed catalogue is package data (``site-packages/patchkit/patches``):
    pip owns it, and a reinstall replaces it; ``refresh`` never writes there.
    """
    real = Path(os.path.realpath(root))
    package = Path(__file__).resolve().parent.parent
    return real == package / "patches" or bool({"site-packages", "dist-packages"} & set(real.parts))


class CatalogueInterrupted(PatchkitError):
    """The catalogue could not be loaded, and a refresh was interrupted while writing it
    (``journal``): what it could not load (``cause``) is likely the refresh's half."""

    code = Code.CATALOGUE_INTERRUPTED


def load_catalogue(root: Path | None = None) -> Catalogue:
    """The catalogue at ``root`` (default: :func:`default_root`), every file checked; it
    only reads (an interrupted refresh is noticed, and left to refresh)."""
    root = Path(root) if root is not None else default_root()
    try:
        return _load(root)
    except PatchkitError as exc:
        staging = journal.pending(root)
        if staging is None:
            raise
        raise CatalogueInterrupted(
            f"{exc} (a patchkit refresh was interrupted while writing this catalogue, "
            f"{staging}: `patchkit refresh --recover` finishes or undoes it)",
            journal=staging,
            cause=exc,
        ) from None


def _load(root: Path) -> Catalogue:
    ids, releases = _series(root)
    bugs = _load_bugs(root / "bugs.toml")
    patches = tuple(_load_patch(root / patch_id, patch_id, bugs) for patch_id in ids)
    for patch in patches:
        _check_decided_once(patch, releases)
        _check_made_on(patch, releases)
        for notice in patch.notices:
            if notice.fixed_by and notice.fixed_by not in ids:
                raise CatalogueInvalid(
                    patch.root / "patch.toml",
                    f"notices.fixed_by: {notice.fixed_by!r} is not in the series",
                )
    # a refresh killed mid-write: noticed, never acted on here (reading never writes);
    # refresh, which owns the journal, finishes or undoes it
    interrupted = journal.pending(root)
    return Catalogue(root, patches, releases, interrupted_refresh=interrupted)


def _series(root: Path) -> tuple[list[str], tuple[str, ...]]:
    """series.toml: the patch ids in order, and the tested releases."""
    series_file = root / "series.toml"
    series = _read_toml(series_file, "series.toml")
    ids = _require(series, "series", series_file, list)
    releases = tuple(_require(series, "tested_releases", series_file, list))
    for release in releases:
        if not isinstance(release, str) or not is_version(release):
            raise CatalogueInvalid(series_file, f"tested_releases: {release!r} is not a version")
    for patch_id in ids:
        if not isinstance(patch_id, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", patch_id):
            raise CatalogueInvalid(series_file, f"series: {patch_id!r} is not a patch id")
    if len(set(ids)) != len(ids):
        raise CatalogueInvalid(series_file, "series lists a patch twice")
    return ids, releases


def recover_interrupted_refresh(root: Path | None = None) -> list[Reason]:
    """Finish or undo a refresh that died while writing the catalogue at ``root``: refresh's
    first step (it owns the journal), `refresh --recover`'s only one; what it did, a reason
    each. Needs only series.toml, so a catalogue half one refresh's still gets there."""
    root = Path(root) if root is not None else default_root()
    ids, _ = _series(root)
    return journal.recover(root, ids)


def _check_made_on(patch: Patch, releases: tuple[str, ...]) -> None:
    """Each variant is made on a tested release of its own range (refresh reproduces it),
    and the releases naming its code families are tested releases of that range too."""
    for variant in patch.variants:
        for key, release in [("made_on", variant.made_on)] + [
            ("families", f) for f in variant.families
        ]:
            if release not in releases or not variant.versions.contains(
                Version(release), prereleases=True
            ):
                raise CatalogueInvalid(
                    patch.root / "patch.toml",
                    f"variant {variant.name}: {key} "
                    f"{release} must be a tested release in {range_text(variant.versions)}",
                )


def _check_decided_once(patch: Patch, releases: tuple[str, ...]) -> None:
    """Every tested release maps to exactly one variant or decision of the patch."""
    meta_file = patch.root / "patch.toml"
    for release in releases:
        version = Version(release)
        matches = [
            f"{type(e).__name__.lower()} {getattr(e, 'name', None) or getattr(e, 'state', '')} "
            f"({range_text(e.versions)})"
            for e in (*patch.variants, *patch.decisions)
            if e.versions.contains(version, prereleases=True)
        ]
        if len(matches) != 1:
            found = ", ".join(matches) or "none"
            raise CatalogueInvalid(
                meta_file,
                f"variants/decisions: tested release {release} must be decided "
                f"exactly once, found {found}",
            )


def _load_bugs(path: Path) -> dict[tuple[str, ...], Bug]:
    """patches/bugs.toml: each bug's facts, keyed by its ids (no file: no bugs)."""
    if not path.is_file():
        return {}
    entries = _read_toml(path, "bugs.toml").get("bug", [])
    if not isinstance(entries, list):
        raise CatalogueInvalid(path, "[[bug]] entries expected")
    bugs = {}
    for table in entries:
        ids = _bug_ids(_require(table, "ids", path, list), path, "bug.ids")
        fix = table.get("upstream_fix", {})
        bugs[ids] = Bug(
            ids=ids,
            title=_require(table, "title", path, str),
            affected=_specifier({"versions": table.get("affected")}, path),
            fix=_require(table, "fix", path, str),
            needs_compute_capability=_optional(table, "needs_compute_capability", path, str, ""),
            fixed_by_ptxas=_optional(table, "fixed_by_ptxas", path, str, ""),
            kernel_scan=_optional(table, "kernel_scan", path, bool, False),
            upstream_fix=_evidence(fix, path) if fix else (),
        )
    return bugs


def _bug_ids(ids: list, origin: Path, key: str) -> tuple[str, ...]:
    if not all(isinstance(b, str) and re.fullmatch(r"[a-z-]+#\d+", b) for b in ids):
        raise CatalogueInvalid(origin, f"{key}: ids look like 'vllm#48590', got {ids}")
    return tuple(ids)


def _load_patch(directory: Path, patch_id: str, bugs: dict[tuple[str, ...], Bug]) -> Patch:
    meta_file = directory / "patch.toml"
    meta = _read_toml(meta_file, "patch.toml")
    if meta.get("id") != patch_id:
        raise CatalogueInvalid(meta_file, f"id must be {patch_id!r} (the series entry)")
    variants = tuple(_variant(v, directory, meta_file) for v in meta.get("variants", []))
    decisions = tuple(
        Decision(
            state=_decision_state(d, meta_file),
            versions=_specifier(d, meta_file),
            reason=_require(d, "reason", meta_file, str),
            evidence=_decision_evidence(d, meta_file, bugs),
        )
        for d in meta.get("decisions", [])
    )
    notices = tuple(
        Notice(
            versions=_specifier(n, meta_file),
            message=_require(n, "message", meta_file, str),
            evidence=_evidence(n, meta_file, required=False),
            fixed_by=_optional(n, "fixed_by", meta_file, str, ""),
        )
        for n in meta.get("notices", [])
    )
    for variant in variants:
        _ = variant.files  # parse now: a broken diff or a path outside vllm/ fails the load
    return Patch(
        id=patch_id,
        title=_require(meta, "title", meta_file, str),
        why=_require(meta, "why", meta_file, str).strip(),
        upstream=tuple(_strings(meta, "upstream", meta_file)),
        remove_when=_require(meta, "remove_when", meta_file, str).strip(),
        variants=variants,
        decisions=decisions,
        notices=notices,
        runtime_gate=_optional(meta, "runtime_gate", meta_file, str, "").strip(),
        overridden_by=_override(meta.get("overridden_by"), meta_file),
        covers=_optional(meta, "covers", meta_file, str, "").strip(),
        diagnosis=_diagnosis(meta.get("diagnosis"), meta_file, bugs),
        opt_in=_opt_in(meta, meta_file),
        root=directory,
    )


def _opt_in(meta: dict, origin: Path) -> bool:
    """``opt_in = true``: a diagnostic that a plain `apply` must never put into a tree."""
    value = meta.get("opt_in", False)
    if not isinstance(value, bool):
        raise CatalogueInvalid(origin, f"opt_in: true or false expected, got {value!r}")
    return value


def _variant(table: dict, directory: Path, origin: Path) -> Variant:
    created = table.get("creates", [])
    if not isinstance(created, list) or not all(isinstance(c, str) for c in created):
        raise CatalogueInvalid(origin, "variants.creates: a list of paths under files/ expected")
    for relpath in created:
        checked_relpath(relpath, f"{origin}: variants.creates")
    made_on = _require(table, "made_on", origin, str)
    if not is_version(made_on):
        raise CatalogueInvalid(origin, f"variants.made_on: {made_on!r} is not a version")
    context = table.get("context", 3)
    if type(context) is not int or not 0 < context <= 10:
        raise CatalogueInvalid(origin, f"variants.context: 1 to 10 lines expected, got {context!r}")
    families = table.get("families", [])
    if not isinstance(families, list) or not all(isinstance(f, str) for f in families):
        raise CatalogueInvalid(origin, "variants.families: a list of tested releases expected")
    return Variant(
        name=_require(table, "name", origin, str),
        diff_path=directory / _require(table, "diff", origin, str),
        versions=_specifier(table, origin),
        created=tuple(created),
        made_on=made_on,
        context=context,
        families=tuple(families),
    )


def _diagnosis(table: dict | None, origin: Path, bugs: dict) -> Diagnosis | None:
    if table is None:
        return None
    return Diagnosis(
        bug=_bug(table, origin, bugs),
        protects=_require(table, "protects", origin, str),
        replaces_kernels=_optional(table, "replaces_kernels", origin, bool, False),
        disabled_by=_switches(table.get("disabled_by", []), origin),
    )


def _bug(table: dict, origin: Path, bugs: dict) -> Bug:
    ids = _bug_ids(_require(table, "bugs", origin, list), origin, "diagnosis.bugs")
    if ids not in bugs:
        raise CatalogueInvalid(
            origin, f"diagnosis.bugs: no [[bug]] with ids {list(ids)} in bugs.toml"
        )
    return bugs[ids]


def _decision_evidence(table: dict, origin: Path, bugs: dict) -> tuple[Evidence, ...]:
    """A decision's evidence, its own or (evidence_from) its bug's upstream fix."""
    source = _optional(table, "evidence_from", origin, str, None)
    if source is None:
        return _evidence(table, origin)
    bug = next((b for ids, b in bugs.items() if source in ids), None)
    if bug is None or not bug.upstream_fix:
        raise CatalogueInvalid(
            origin, f"decisions.evidence_from: {source!r} has no upstream_fix in bugs.toml"
        )
    return bug.upstream_fix


def _switches(tables, origin: Path) -> tuple[Switch, ...]:
    """`disabled_by`: a list of { env, values | unless } tables (their keys checked)."""
    found = []
    for table in tables:
        if not isinstance(table, dict) or not isinstance(table.get("env"), str):
            raise CatalogueInvalid(origin, "diagnosis.disabled_by: each entry needs env = '...'")
        if ("values" in table) == ("unless" in table):
            raise CatalogueInvalid(
                origin, f"diagnosis.disabled_by {table['env']}: give values or unless, not both"
            )
        given = _strings(table, "values" if "values" in table else "unless", origin)
        lower = tuple(v.strip().lower() for v in given)
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
        check=_optional(table, "check", origin, str, ""),
    )


def _read_toml(path: Path, schema: str) -> dict:
    """A catalogue file, its every table's keys checked against SCHEMA[``schema``]."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise CatalogueInvalid(path, f"cannot read the patch catalogue: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogueInvalid(path, f"invalid TOML: {exc}") from None
    check_keys(data, schema, path)
    return data


def check_keys(table: dict, schema: str, origin: Path, where: tuple[str, ...] = ()) -> None:
    """Every key of ``table`` (and of the tables inside it) is one SCHEMA lists for it,
    and a table's place holds a table (an array of them where SCHEMA says ``[[...]]``);
    else one line naming the file, the table and the key."""
    allowed = SCHEMA[schema]
    for key, value in table.items():
        if key not in allowed:
            raise CatalogueInvalid(origin, _unknown_key(schema, where, key))
        inner = allowed[key]
        if inner is None:
            continue
        name, many = inner.strip("[]"), inner.startswith("[[")
        label = (f"[{inner.strip('[]')}]" if not many else inner) if not where else key
        if many and isinstance(value, list) and all(isinstance(v, dict) for v in value):
            for number, item in enumerate(value, start=1):
                check_keys(item, name, origin, (*where, f"{label} #{number}"))
        elif not many and isinstance(value, dict):
            check_keys(value, name, origin, (*where, label))
        else:
            shape = "an array of tables" if many else "a table"
            place = ", ".join((*where, key)) if where else key
            raise CatalogueInvalid(
                origin, f"{place}: {shape} expected ({inner}), got {type(value).__name__}"
            )


def _unknown_key(schema: str, where: tuple[str, ...], key: str) -> str:
    allowed = SCHEMA[schema]
    table = ", ".join(where) if where else "the top-level table"
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = HINTS.get((schema, key)) or (f"did you mean {close[0]!r}?" if close else "")
    shown = repr(key) if len(key) <= MAX_SHOWN_KEY else f"{key[:MAX_SHOWN_KEY]!r}..."
    return (
        f"unknown key {shown} in {table}" + (f" ({hint})" if hint else "") + "; "
        f"known there: {', '.join(allowed)}. A key patchkit does not know is refused, never "
        "ignored: nothing was loaded"
    )


def _require(table: dict, key: str, origin: Path, kind: type):
    value = table.get(key)
    if not isinstance(value, kind) or not value:
        raise CatalogueInvalid(origin, f"missing or empty {key!r} ({kind.__name__} expected)")
    return value


def _optional(table: dict, key: str, origin: Path, kind: type, default):
    """An optional key's value, of type ``kind`` (a bool is no str, and 1 is no bool), or
    ``default`` when it is absent; a value of another type is one line: `"false"` for a
    boolean would otherwise be true."""
    if key not in table:
        return default
    value = table[key]
    if type(value) is not kind:
        raise CatalogueInvalid(
            origin, f"{key}: {kind.__name__} expected, got {type(value).__name__} {value!r:.60}"
        )
    return value


def _strings(table: dict, key: str, origin: Path) -> list[str]:
    """A required, non-empty list of strings."""
    value = _require(table, key, origin, list)
    if not all(isinstance(v, str) for v in value):
        raise CatalogueInvalid(origin, f"{key}: a list of strings expected")
    return value


def _specifier(table: dict, origin: Path) -> SpecifierSet:
    text = _require(table, "versions", origin, str)
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise CatalogueInvalid(origin, f"invalid version specifier {text!r}") from None


def _decision_state(table: dict, origin: Path) -> str:
    state = _require(table, "state", origin, str)
    if state not in DECISION_STATES:
        raise CatalogueInvalid(origin, f"state {state!r} is not one of {DECISION_STATES}")
    return state


def _evidence(table: dict, origin: Path, required: bool = True) -> tuple[Evidence, ...]:
    items = table.get("evidence", [])
    if required and not items:
        raise CatalogueInvalid(origin, "a decision needs content evidence (file + pattern)")
    evidence = []
    for item in items:
        file = _require(item, "file", origin, str)
        checked_relpath(file, f"{origin}: evidence file")
        absent = item.get("absent", False)
        if not isinstance(absent, bool):
            raise CatalogueInvalid(origin, f"evidence {file}: absent: true or false expected")
        if absent and "pattern" in item:
            raise CatalogueInvalid(
                origin, f"evidence {file}: give a pattern or absent = true, not both"
            )
        if absent:
            evidence.append(Evidence(file=file, absent=True))
            continue
        pattern = _require(item, "pattern", origin, str)
        try:
            re.compile(pattern)
        except re.error as exc:
            raise CatalogueInvalid(origin, f"evidence pattern {pattern!r}: {exc}") from None
        evidence.append(Evidence(file=file, pattern=pattern))
    return tuple(evidence)
