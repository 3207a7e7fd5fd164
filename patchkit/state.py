"""The per-tree state file: what patchkit applied, with hashes and backups.

Location: ``<tree>/.patchkit/`` (the tree is the directory holding vllm/),
next to the code it describes, like quilt's ``.pc/``:

* ``state.json``  - per applied patch: id, sha256 of the diff, variant,
  time, and per file the sha256 before and after plus the backup path;
* ``backups/<id>/<relpath>`` - the file as it was before the patch;
* ``lock``        - taken by apply/revert so two runs never interleave;
* ``txn/``        - only while a run is writing: the journal that lets the
  next run roll an interrupted one back.

Anyone who can write the tree can write ``state.json``, so it is validated
field by field before anything acts on it: a file path must stay under
``vllm/``, a backup path must be the one patchkit itself would have chosen,
and nothing under ``.patchkit/`` may be a symbolic link. A state file that
fails is reported with its path and never acted on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patchkit.errors import PatchkitError
from patchkit.fsutil import TMP_SUFFIX
from patchkit.safepath import checked_relpath, no_links_below

STATE_DIR = ".patchkit"
FORMAT = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PATCH_ID = re.compile(r"[a-z0-9][a-z0-9-]*")


@dataclass
class FileRecord:
    path: str
    pre_sha256: str | None  # None: the patch created the file
    post_sha256: str | None  # None: the patch deleted the file
    backup: str | None  # relative to the state dir; None when pre is None


@dataclass
class PatchRecord:
    id: str
    patch_sha256: str
    variant: str
    applied_at: str
    files: list[FileRecord] = field(default_factory=list)


@dataclass
class State:
    directory: Path
    patches: dict[str, PatchRecord] = field(default_factory=dict)
    vllm_version: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / "state.json"

    def to_bytes(self) -> bytes:
        data = {
            "format": FORMAT,
            "vllm_version": self.vllm_version,
            "patches": [asdict(record) for record in self.patches.values()],
        }
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def backup_path(patch_id: str, relpath: str) -> str:
    """Where a patch's original of ``relpath`` lives, relative to ``.patchkit/``."""
    return f"backups/{patch_id}/{relpath}"


def state_dir(root: Path) -> Path:
    return root / STATE_DIR


def load_state(root: Path) -> State:
    """The validated state of ``root``; an empty State when nothing is recorded."""
    directory = state_dir(root)
    no_links_below(directory)
    state = State(directory)
    if not state.path.is_file():
        return state
    try:
        data = json.loads(state.path.read_text(encoding="utf-8"))
        state.vllm_version, patches = _parse(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PatchkitError(
            f"{state.path}: invalid state file ({exc}); it was not acted on. If vLLM's files "
            f"are pristine, delete {directory} and run `patchkit status` (patches are then "
            "recognised by content)"
        ) from None
    state.patches = {p.id: p for p in patches}
    return state


def _parse(data: object) -> tuple[str | None, list[PatchRecord]]:
    """Check every field of a decoded state file; ValueError names the first bad one."""
    _require(isinstance(data, dict), "top level is not an object")
    _require(set(data) == {"format", "vllm_version", "patches"}, "unexpected keys")
    _require(data["format"] == FORMAT, f"unknown format {data['format']!r}")
    _require(_is_str_or_none(data["vllm_version"]), "vllm_version is not a string")
    _require(isinstance(data["patches"], list), "patches is not a list")
    records = [_parse_patch(raw) for raw in data["patches"]]
    ids = [r.id for r in records]
    _require(len(ids) == len(set(ids)), "a patch is recorded twice")
    return data["vllm_version"], records


def _parse_patch(raw: object) -> PatchRecord:
    keys = {"id", "patch_sha256", "variant", "applied_at", "files"}
    _require(isinstance(raw, dict) and set(raw) == keys, "a patch entry has the wrong keys")
    _require(isinstance(raw["id"], str) and _PATCH_ID.fullmatch(raw["id"]), "bad patch id")
    patch_id = raw["id"]
    _require(is_sha256(raw["patch_sha256"]), f"{patch_id}: patch_sha256 is not a sha256")
    _require(isinstance(raw["variant"], str), f"{patch_id}: variant is not a string")
    _require(isinstance(raw["applied_at"], str), f"{patch_id}: applied_at is not a string")
    _require(isinstance(raw["files"], list) and raw["files"], f"{patch_id}: files is empty")
    files = [_parse_file(patch_id, f) for f in raw["files"]]
    return PatchRecord(patch_id, raw["patch_sha256"], raw["variant"], raw["applied_at"], files)


def _parse_file(patch_id: str, raw: object) -> FileRecord:
    keys = {"path", "pre_sha256", "post_sha256", "backup"}
    _require(isinstance(raw, dict) and set(raw) == keys, f"{patch_id}: a file entry is malformed")
    try:
        path = checked_relpath(raw["path"], f"{patch_id}: file")
    except PatchkitError as exc:
        raise ValueError(str(exc)) from None
    pre, post, backup = raw["pre_sha256"], raw["post_sha256"], raw["backup"]
    _require(pre is None or is_sha256(pre), f"{patch_id}: {path}: pre_sha256 is not a sha256")
    _require(post is None or is_sha256(post), f"{patch_id}: {path}: post_sha256 is not a sha256")
    expected_backup = None if pre is None else backup_path(patch_id, path)
    _require(backup == expected_backup, f"{patch_id}: {path}: backup {backup!r} is not its own")
    return FileRecord(path, pre, post, backup)


def _require(condition: object, message: str) -> None:
    if not condition:
        raise ValueError(message)


def is_sha256(value: object) -> bool:
    """A lower-case hex sha256, as state.json and the journal store them."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _is_str_or_none(value: object) -> bool:
    return value is None or isinstance(value, str)


def sweep(state: State) -> None:
    """Remove what an interrupted run can leave in ``.patchkit/`` besides the journal.

    Temporary files of atomic writes, and backups of patches the state does
    not record (written before a run's journal, then killed). Called under
    the lock, after recovery, so the directory holds exactly what the state
    describes.
    """
    directory = state.directory
    if not directory.is_dir():
        return
    for dirpath, _, names in os.walk(directory):
        for name in names:
            if name.endswith(TMP_SUFFIX):
                os.unlink(os.path.join(dirpath, name))
    backups = directory / "backups"
    if not backups.is_dir():
        return
    wanted = {r.backup for p in state.patches.values() for r in p.files if r.backup}
    for dirpath, _, names in os.walk(backups, topdown=False):
        for name in names:
            path = Path(dirpath) / name
            if str(path.relative_to(directory)) not in wanted:
                path.unlink()
        if dirpath != str(backups) and not os.listdir(dirpath):
            os.rmdir(dirpath)


def tidy(root: Path, lock) -> None:
    """Remove ``.patchkit/`` once it records nothing, so a reverted tree is as before.

    Called while holding ``lock``; the lock file goes last, and TreeLock notices
    when a waiter's lock file was unlinked under it.
    """
    directory = state_dir(root)
    if not directory.is_dir() or (directory / "txn" / "journal.json").exists():
        return
    state = load_state(root)
    sweep(state)
    if state.patches:
        return
    (directory / "state.json").unlink(missing_ok=True)
    shutil.rmtree(directory / "backups", ignore_errors=True)
    shutil.rmtree(directory / "txn", ignore_errors=True)
    lock.unlink_file()
    try:
        directory.rmdir()
    except OSError:
        pass  # something else lives there; leave it
