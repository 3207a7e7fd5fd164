"""Reading built images' root file systems: what changed, what was added, what is left.

Images are compared as mounted directory trees. A file counts as changed
when its type, mode, size, modification time or link target differs (a
lower layer's file seen through overlay keeps all of them), and vLLM's
Python files and patchkit's records are compared byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from scripts.docker_check.base import PYTHON, SITE

NOT_IN_AN_IMAGE = ("git", "patch", "gcc", "cc", "c++", "make")
BIN_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")


@dataclass(frozen=True)
class Entry:
    kind: str  # "d", "f" or "l"
    mode: int
    size: int = 0
    mtime_ns: int = 0
    link: str = ""


def walk(root: Path, under: str = "") -> dict[str, Entry]:
    """Every path below ``root/under``, relative to ``root``, with what a quick check compares."""
    found: dict[str, Entry] = {}
    top = root / under
    for directory, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            info = os.lstat(path)
            relpath = os.path.relpath(path, root)
            if stat.S_ISDIR(info.st_mode):
                found[relpath] = Entry("d", info.st_mode)
            elif stat.S_ISLNK(info.st_mode):
                found[relpath] = Entry("l", info.st_mode, link=os.readlink(path))
            else:
                found[relpath] = Entry("f", info.st_mode, info.st_size, info.st_mtime_ns)
    return found


@dataclass
class Changes:
    """What an image holds that its base does not (added, changed) and what it dropped."""

    added: dict[str, Entry] = field(default_factory=dict)
    changed: dict[str, Entry] = field(default_factory=dict)
    removed: dict[str, Entry] = field(default_factory=dict)


def differences(base: Path, image: Path) -> Changes:
    before, after = walk(base), walk(image)
    changes = Changes()
    for relpath, entry in after.items():
        old = before.get(relpath)
        if old is None:
            changes.added[relpath] = entry
        elif old != entry and not (old.kind == entry.kind == "d" and old.mode == entry.mode):
            changes.changed[relpath] = entry
    changes.removed = {p: e for p, e in before.items() if p not in after}
    return changes


def digest(root: Path, under: str) -> dict[str, tuple]:
    """Each path below ``root/under``: its entry, with the sha256 of every Python file and
    of every file outside vLLM's package (records, backups, state) in place of its time."""
    out: dict[str, tuple] = {}
    for relpath, entry in walk(root, under).items():
        outside = not relpath.startswith(f"{SITE}/vllm/")  # vLLM's own shared objects: stat only
        if entry.kind == "f" and (relpath.endswith(".py") or outside):
            data = hashlib.sha256((root / relpath).read_bytes()).hexdigest()
            out[relpath] = (entry.kind, entry.mode, entry.size, data)
        else:
            out[relpath] = (entry.kind, entry.mode, entry.size, entry.mtime_ns, entry.link)
    return out


def record_paths(root: Path, dist_info: str) -> set[str]:
    """The paths a distribution's RECORD lists, relative to the root file system."""
    text = (root / dist_info / "RECORD").read_text()
    rows = (line.split(",")[0] for line in text.splitlines() if line.strip())
    return {os.path.normpath(os.path.join(os.path.dirname(dist_info), row)) for row in rows}


@dataclass
class Part:
    files: int = 0
    size: int = 0
    paths: list[str] = field(default_factory=list)


def classify(changes: Changes, image: Path, patch_files: set[str]) -> dict[str, Part]:
    """What the image adds over its base, by what put it there; "other" is what nothing
    should have left (build output, caches, an empty mount point)."""
    owners: dict[str, str] = {}
    for dist in sorted(p for p in changes.added if p.endswith(".dist-info")):
        part = "patchkit" if os.path.basename(dist).startswith("patchkit_vllm-") else "dependencies"
        owners.update(dict.fromkeys(record_paths(image, dist), part))
    patched = {f"{SITE}/{p}" for p in patch_files}
    entries = {**changes.added, **changes.changed}
    files = {p: e for p, e in entries.items() if e.kind != "d"}
    parts: dict[str, Part] = {}

    def count(relpath: str, name: str, size: int = 0) -> None:
        part = parts.setdefault(name, Part())
        part.files, part.size = part.files + 1, part.size + size
        part.paths.append(relpath)

    for relpath, entry in files.items():
        count(relpath, _part(relpath, owners, patched), entry.size)
    for relpath in sorted(set(entries) - set(files)):  # directories holding none of the files
        if _part(relpath, owners, patched) == "other" and not any(
            f.startswith(f"{relpath}/") for f in files
        ):
            count(f"{relpath}/", "other")
    for relpath in changes.removed:
        count(
            f"{relpath} (removed)",
            "removed bytecode" if stale_bytecode(relpath, patched) else "other",
        )
    return parts


def _part(relpath: str, owners: dict[str, str], patched: set[str]) -> str:
    if relpath in owners:
        return owners[relpath]
    if relpath in patched:
        return "patched vLLM files"
    if relpath.startswith((f"{SITE}/.patchkit/", "etc/patchkit/")) or relpath in (
        f"{SITE}/.patchkit",
        "etc/patchkit",
    ):
        return "backups and state" if relpath.startswith(SITE) else "records"
    return "other"


def stale_bytecode(relpath: str, patched: set[str]) -> bool:
    """Whether ``relpath`` is the bytecode of one of the ``patched`` modules (patchkit
    removes it with the change); both relative to the same directory."""
    folder, name = os.path.split(relpath)
    if os.path.basename(folder) != "__pycache__" or not name.endswith(".pyc"):
        return False
    module = name.split(".")[0]
    return f"{os.path.dirname(folder)}/{module}.py" in patched


def vllm_changes(base: Path, image: Path) -> tuple[set[str], set[str], set[str]]:
    """vLLM's files (relative to the dist-packages directory) that the image has added or
    changed, its Python files compared byte for byte; its bytecode files that changed; and
    those of them it removed."""
    before, after = digest(base, f"{SITE}/vllm"), digest(image, f"{SITE}/vllm")
    differ = {
        p.removeprefix(f"{SITE}/")
        for p in before.keys() | after.keys()
        if before.get(p) != after.get(p) and (before.get(p) or after.get(p))[0] != "d"
    }
    removed = {p.removeprefix(f"{SITE}/") for p in before.keys() - after.keys()}
    bytecode = {p for p in differ if "/__pycache__/" in p}
    return differ - bytecode, bytecode, removed & bytecode


def not_image_like(root: Path, release: str) -> list[str]:
    """How a base falls short of the official image's layout, if it does."""
    problems = []
    if not (root / f"usr/lib/python{PYTHON}/EXTERNALLY-MANAGED").is_file():
        problems.append("the system Python is not marked externally managed")
    if not (root / SITE / f"vllm-{release}.dist-info" / "RECORD").is_file():
        problems.append(f"no vllm-{release}.dist-info/RECORD in {SITE}")
    for tool in NOT_IN_AN_IMAGE:
        found = [d for d in BIN_DIRS if (root / d / tool).exists()]
        if found:
            problems.append(f"/{found[0]}/{tool} is there")
    return problems
