"""Find the vLLM tree to work on and tell which version it is, without importing it.

A *tree* is the directory that contains the ``vllm/`` package: a
site-packages / dist-packages directory, or the root of a vLLM source
checkout. Importing vllm would pull in torch and CUDA (seconds, and it may
fail on a build machine), so everything here reads files only.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.version import InvalidVersion, Version

from patchkit.errors import PatchkitError

VERSION_ENV = "PATCHKIT_VLLM_VERSION"


@dataclass
class VllmTree:
    """A directory holding ``vllm/``, its version and its wheel RECORD if any."""

    root: Path
    version: str  # as reported, local label kept ("0.26.0+cu130")
    source: str  # metadata | git | file | override | unknown
    record: dict[str, str] = field(default_factory=dict)  # relpath -> sha256 hex
    git_root: Path | None = None

    @property
    def parsed_version(self) -> Version | None:
        """The version without its local label, for range matching; None if unparsable."""
        try:
            return Version(Version(self.version).public)
        except InvalidVersion:
            return None

    def path(self, relpath: str) -> Path:
        return self.root / relpath

    def describe(self) -> dict:
        return {"version": self.version, "path": str(self.root), "source": self.source}


def is_version(text: object) -> bool:
    """Whether ``text`` is a PEP 440 version (0.26.0, 0.26.0+cu130)."""
    try:
        Version(text)
    except (InvalidVersion, TypeError):
        return False
    return True


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str | None:
    try:
        return sha256_bytes(path.read_bytes())
    except FileNotFoundError:
        return None


def locate(target: str | None, version_override: str | None = None) -> VllmTree:
    """The tree at ``target``, or the vLLM importable by this interpreter."""
    root = _target_root(Path(target)) if target else _importable_root()
    override = version_override or os.environ.get(VERSION_ENV)
    tree = _detect(root)
    if override:
        tree.version, tree.source = override, "override"
    return tree


def _target_root(target: Path) -> Path:
    if not target.exists():
        raise PatchkitError(f"--target {target}: no such directory")
    if target.name == "vllm" and (target / "__init__.py").is_file():
        target = target.parent  # accept the package directory itself too
    if not (target / "vllm" / "__init__.py").is_file():
        raise PatchkitError(
            f"--target {target}: no vllm/ package there; pass the directory that "
            "contains vllm/ (site-packages or the root of a vLLM checkout)"
        )
    return target.resolve()


def _importable_root() -> Path:
    # find_spec on a top-level name locates the package without executing it.
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        import sys

        raise PatchkitError(
            f"vLLM is not installed for this Python ({sys.executable}); pass "
            "--target DIR (the directory that contains vllm/), or run "
            "`patchkit fetch VERSION` to get a release tree"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return package_dir.parent.resolve()


def _detect(root: Path) -> VllmTree:
    dist_info = _dist_info(root)
    if dist_info is not None:
        version = _metadata_version(dist_info)
        return VllmTree(root, version, "metadata", _read_record(dist_info))
    git_root = _git_root(root)
    if git_root is not None:
        described = _git_version(git_root)
        if described:
            return VllmTree(root, described, "git", git_root=git_root)
    from_file = _version_file(root)
    if from_file:
        return VllmTree(root, from_file, "file", git_root=git_root)
    return VllmTree(root, "unknown", "unknown", git_root=git_root)


def _dist_info(root: Path) -> Path | None:
    """The vllm-*.dist-info whose RECORD lists vllm/__init__.py."""
    candidates = sorted(root.glob("vllm-*.dist-info"))
    owning = [d for d in candidates if _lists_vllm(d)]
    if len(owning) > 1:
        names = ", ".join(d.name for d in owning)
        raise PatchkitError(
            f"{root}: several vLLM installs claim vllm/ ({names}); remove the stale "
            "dist-info or reinstall vLLM"
        )
    return owning[0] if owning else None


def _lists_vllm(dist_info: Path) -> bool:
    record = dist_info / "RECORD"
    if not record.is_file():
        return (dist_info / "METADATA").is_file()
    with open(record, encoding="utf-8", newline="") as handle:
        return any(row and row[0] == "vllm/__init__.py" for row in csv.reader(handle))


def _metadata_version(dist_info: Path) -> str:
    with open(dist_info / "METADATA", encoding="utf-8") as handle:
        headers = HeaderParser().parse(handle)
    version = headers.get("Version")
    if not version:
        raise PatchkitError(f"{dist_info / 'METADATA'}: no Version header")
    return version.strip()


def _read_record(dist_info: Path) -> dict[str, str]:
    """RECORD rows as relpath -> sha256 hex; rows without a hash are skipped."""
    record = dist_info / "RECORD"
    if not record.is_file():
        return {}
    hashes = {}
    with open(record, encoding="utf-8", newline="") as handle:
        for row in csv.reader(handle):
            if len(row) >= 2 and row[1].startswith("sha256="):
                digest = row[1][len("sha256=") :]
                padded = digest + "=" * (-len(digest) % 4)
                hashes[row[0]] = base64.urlsafe_b64decode(padded).hex()
    return hashes


def _git_root(root: Path) -> Path | None:
    for directory in (root, *root.parents):
        if (directory / ".git").exists():
            return directory
    return None


def _git_version(git_root: Path) -> str | None:
    """``git describe --tags``: v0.26.0 -> 0.26.0, v0.26.0-3-gabc -> 0.26.0+3.gabc."""
    try:
        import git  # gitpython; imported here so status stays fast elsewhere

        described = git.Repo(git_root).git.describe("--tags", "--long", "--match", "v[0-9]*")
    except Exception:  # no tags, not a repository, git missing: fall back to files
        return None
    match = re.fullmatch(r"v(.+)-(\d+)-g([0-9a-f]+)", described.strip())
    if not match:
        return None
    base, distance, sha = match.groups()
    return base if distance == "0" else f"{base}+{distance}.g{sha}"


def _version_file(root: Path) -> str | None:
    path = root / "vllm" / "_version.py"
    if not path.is_file():
        return None
    match = re.search(
        r"^(?:__version__|version)\s*=\s*(?:\w+\s*=\s*)?['\"]([^'\"]+)['\"]",
        path.read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    return match.group(1) if match else None
