"""The per-tree state file: what patchkit applied, with hashes and backups.

Location: ``<tree>/.patchkit/`` (the tree is the directory holding vllm/),
next to the code it describes, like quilt's ``.pc/``:

* ``state.json``  - per applied patch: id, sha256 of the diff, variant,
  time, and per file the sha256 before and after plus the backup path;
* ``backups/<id>/<relpath>`` - the file as it was before the patch;
* ``lock``        - taken by apply/revert so two runs never interleave;
* ``txn/``        - only while a run is writing: the journal that lets the
  next run roll an interrupted one back.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patchkit.errors import PatchkitError
from patchkit.fsutil import write_atomic

STATE_DIR = ".patchkit"
FORMAT = 1


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

    def save(self) -> None:
        write_atomic(self.path, self.to_bytes())


def state_dir(root: Path) -> Path:
    return root / STATE_DIR


def load_state(root: Path) -> State:
    directory = state_dir(root)
    state = State(directory)
    if not state.path.is_file():
        return state
    try:
        data = json.loads(state.path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown format {data.get('format')!r}")
        for raw in data["patches"]:
            files = [FileRecord(**f) for f in raw.pop("files")]
            state.patches[raw["id"]] = PatchRecord(files=files, **raw)
        state.vllm_version = data.get("vllm_version")
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchkitError(
            f"{state.path}: unreadable state file ({exc}); move it aside and run "
            "`patchkit status` (patches are then recognised by content)"
        ) from None
    return state


def tidy(root: Path, lock) -> None:
    """Remove ``.patchkit/`` once it records nothing, so a reverted tree is as before.

    Called while holding ``lock``; the lock file goes last, and TreeLock notices
    when a waiter's lock file was unlinked under it.
    """
    directory = state_dir(root)
    if not directory.is_dir() or (directory / "txn").exists() or load_state(root).patches:
        return
    (directory / "state.json").unlink(missing_ok=True)
    shutil.rmtree(directory / "backups", ignore_errors=True)
    lock.unlink_file()
    try:
        directory.rmdir()
    except OSError:
        pass  # something else lives there; leave it
