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
``vllm/`` and be a file that a diff of that patch creates or changes (a
``pre_sha256`` of null only where one creates it), a backup path must be
the one patchkit itself would have chosen, and nothing under ``.patchkit/``
may be a symbolic link. A state file that fails is reported with its path
and never acted on.
"""

from __future__ import annotations

import json
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, Refused
from patchkit.fs.files import decode_json
from patchkit.fs.safepath import TMP_SUFFIX, Root, TooLarge, UnsafePath, checked_relpath
from patchkit.identity import sha256_bytes

STATE_DIR = ".patchkit"
STATE_FILE = f"{STATE_DIR}/state.json"
TXN_DIR = f"{STATE_DIR}/txn"
BACKUPS_DIR = f"{STATE_DIR}/backups"
FORMAT = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PATCH_ID = re.compile(r"[a-z0-9][a-z0-9-]*")
MAX_JSON_BYTES = 16 << 20  # far above any real state or journal; refuses absurd input early


def file_sha256(data: bytes | None) -> str | None:
    """The sha256 a state entry or a journal keeps of a file's bytes; None for no file."""
    return None if data is None else sha256_bytes(data)


@dataclass
class PatchedFile:
    path: str
    pre_sha256: str | None  # None: the patch created the file
    post_sha256: str | None  # None: the patch deleted the file
    backup: str | None  # relative to the state dir; None when pre is None


@dataclass
class AppliedPatch:
    id: str
    patch_sha256: str
    variant: str
    applied_at: str
    files: list[PatchedFile] = field(default_factory=list)


@dataclass
class State:
    fs: Root  # the tree root; every path here is relative to it
    patches: dict[str, AppliedPatch] = field(default_factory=dict)
    vllm_version: str | None = None

    @property
    def path(self) -> Path:
        """state.json's full path, for messages."""
        return self.fs.full(STATE_FILE)

    @property
    def directory(self) -> Path:
        return self.fs.full(STATE_DIR)

    def to_bytes(self) -> bytes:
        data = {
            "format": FORMAT,
            "vllm_version": self.vllm_version,
            "patches": [asdict(applied) for applied in self.patches.values()],
        }
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def backup_path(patch_id: str, relpath: str) -> str:
    """Where a patch's original of ``relpath`` lives, relative to ``.patchkit/``."""
    return f"backups/{patch_id}/{relpath}"


def check_no_links(fs: Root) -> None:
    """Refuse a ``.patchkit/`` that is, or holds, a symbolic link or another mount.

    patchkit removes temporary files and backups it no longer needs from
    ``.patchkit/``; a bind mount there (of the directory itself or of any
    directory in it) would make that remove someone's files. Checked before
    a run changes anything.
    """
    found = fs.links_below(STATE_DIR, "state")
    if found:
        raise UnsafePath(f"{found} (patchkit's state holds only real files)", **found.facts)
    mounted = fs.mount_point_at_or_below(STATE_DIR, "state")
    if mounted:
        raise UnsafePath(
            f"{mounted} is a mount point; patchkit keeps its state only in directories of "
            "the tree's own file system and never removes across mounts; unmount it",
            path=mounted,
            kind="a mount point",
        )


MISSING = object()


def load_json(fs: Root, relpath: str, what: str) -> object:
    """Decode one of patchkit's JSON files; MISSING when it is not there; ValueError when bad.

    The bound is the read's: a 4 GiB (sparse) state file read whole before its size was
    checked took the machine's memory."""
    try:
        raw = fs.read(relpath, what, MAX_JSON_BYTES)
    except TooLarge:
        raise ValueError(f"larger than {MAX_JSON_BYTES} bytes") from None
    return MISSING if raw is None else decode_json(raw, MAX_JSON_BYTES)


def load_state(fs: Root, file_kinds=None) -> State:
    """The validated state of the tree at ``fs``; an empty State when nothing is recorded.

    ``file_kinds(patch_id)``: for a patch of the catalogue, each path its
    diffs touch and how (``creates``, ``changes``, ``deletes``); None for an
    unknown patch. Entries that name anything else are refused.
    """
    check_no_links(fs)
    state = State(fs)
    try:
        data = load_json(fs, STATE_FILE, "state")
        if data is MISSING:
            return state
        state.vllm_version, patches = _parse(data)
        if file_kinds is not None:
            for applied in patches:
                _check_against_diffs(applied, file_kinds(applied.id))
    except ValueError as exc:
        raise invalid_state(state, str(exc)) from None
    state.patches = {p.id: p for p in patches}
    return state


def invalid_state(state: State, detail: str) -> Refused:
    return Refused(
        Reason.of(
            Code.INVALID_STATE,
            path=str(state.path),
            why=detail,
            directory=str(state.directory),
        )
    )


def _check_against_diffs(applied: AppliedPatch, kinds: dict[str, set[str]] | None) -> None:
    """Each file entry must be one that a diff of its patch creates, changes or deletes."""
    if kinds is None:
        return  # an unknown patch: kept, never acted on (operations reports it)
    for entry in applied.files:
        allowed = kinds.get(entry.path, set())
        _require(allowed, f"{applied.id}: no diff of {applied.id} touches {entry.path}")
        _require(
            entry.pre_sha256 is not None or "creates" in allowed,
            f"{applied.id}: {entry.path}: pre_sha256 is null, but no diff of {applied.id} "
            "creates that file",
        )
        _require(
            entry.post_sha256 is not None or "deletes" in allowed,
            f"{applied.id}: {entry.path}: post_sha256 is null, but no diff of {applied.id} "
            "deletes that file",
        )


def _parse(data: object) -> tuple[str | None, list[AppliedPatch]]:
    """Check every field of a decoded state file; ValueError names the first bad one."""
    _require(isinstance(data, dict), "top level is not an object")
    _require(set(data) == {"format", "vllm_version", "patches"}, "unexpected keys")
    _require(data["format"] == FORMAT, f"unknown format {str(data['format'])[:20]!r}")
    _require(
        data["vllm_version"] is None or _is_short_str(data["vllm_version"]),
        "vllm_version is not a short string",
    )
    _require(isinstance(data["patches"], list), "patches is not a list")
    entries = [_parse_patch(raw) for raw in data["patches"]]
    ids = [r.id for r in entries]
    _require(len(ids) == len(set(ids)), "a patch is recorded twice")
    return data["vllm_version"], entries


def _parse_patch(raw: object) -> AppliedPatch:
    keys = {"id", "patch_sha256", "variant", "applied_at", "files"}
    _require(isinstance(raw, dict) and set(raw) == keys, "a patch entry has the wrong keys")
    _require(
        isinstance(raw["id"], str) and len(raw["id"]) <= 100 and _PATCH_ID.fullmatch(raw["id"]),
        "bad patch id",
    )
    patch_id = raw["id"]
    _require(is_sha256(raw["patch_sha256"]), f"{patch_id}: patch_sha256 is not a sha256")
    _require(_is_short_str(raw["variant"]), f"{patch_id}: variant is not a short string")
    _require(_is_short_str(raw["applied_at"]), f"{patch_id}: applied_at is not a short string")
    _require(isinstance(raw["files"], list) and raw["files"], f"{patch_id}: files is empty")
    files = [_parse_file(patch_id, f) for f in raw["files"]]
    paths = [f.path for f in files]
    _require(len(paths) == len(set(paths)), f"{patch_id}: a file is recorded twice")
    return AppliedPatch(patch_id, raw["patch_sha256"], raw["variant"], raw["applied_at"], files)


def _parse_file(patch_id: str, raw: object) -> PatchedFile:
    keys = {"path", "pre_sha256", "post_sha256", "backup"}
    _require(isinstance(raw, dict) and set(raw) == keys, f"{patch_id}: a file entry is malformed")
    try:
        path = checked_relpath(raw["path"], f"{patch_id}: file")
    except PatchkitError as exc:
        raise ValueError(str(exc)) from None
    pre, post, backup = raw["pre_sha256"], raw["post_sha256"], raw["backup"]
    _require(pre is None or is_sha256(pre), f"{patch_id}: {path}: pre_sha256 is not a sha256")
    _require(post is None or is_sha256(post), f"{patch_id}: {path}: post_sha256 is not a sha256")
    _require(pre is not None or post is not None, f"{patch_id}: {path}: pre and post both null")
    expected_backup = None if pre is None else backup_path(patch_id, path)
    _require(backup == expected_backup, f"{patch_id}: {path}: backup {backup!r} is not its own")
    return PatchedFile(path, pre, post, backup)


def _require(condition: object, message: str) -> None:
    if not condition:
        raise ValueError(message)


def is_sha256(value: object) -> bool:
    """A lower-case hex sha256, as state.json and the journal store them."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _is_short_str(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 200


def sweep(state: State, wanted: set[str] | None = None) -> None:
    """Remove what an interrupted run can leave in ``.patchkit/`` besides the journal.

    Temporary files of atomic writes, and backups of patches the state does
    not record (written before a run's journal, then killed). Called under
    the lock, after recovery, before a run's first write, so the directory
    holds exactly what the state describes. ``wanted``: the backups to keep,
    :func:`recorded_backups` of the state as committed, where ``state`` is
    already the one the run will write.
    """
    _sweep_dir(state.fs, STATE_DIR, recorded_backups(state) if wanted is None else wanted)


def recorded_backups(state: State) -> set[str]:
    """The backups ``state``'s entries record, as paths relative to the tree."""
    entries = [r for p in state.patches.values() for r in p.files]
    return {f"{STATE_DIR}/{r.backup}" for r in entries if r.backup}


def _sweep_dir(fs: Root, relpath: str, wanted: set[str]) -> None:
    for name in fs.names(relpath, "state"):
        child = f"{relpath}/{name}"
        found = fs.lstat(child, "state")
        if found is None:
            continue
        if name.endswith(TMP_SUFFIX):
            fs.remove_tree(child, "state")
        elif child.startswith(f"{BACKUPS_DIR}/") or child == BACKUPS_DIR:
            if _is_dir(found):
                _sweep_dir(fs, child, wanted)
                if child != BACKUPS_DIR:
                    fs.rmdir(child, "state")
            elif child not in wanted:
                fs.unlink(child, "state")
        elif child == TXN_DIR and _is_dir(found):
            _sweep_dir(fs, child, wanted)


def _is_dir(found) -> bool:
    return stat.S_ISDIR(found.st_mode)


def tidy(fs: Root, lock) -> None:
    """Remove ``.patchkit/`` once it records nothing, so a reverted tree is as before.

    Reads the state as committed on disk. Called while holding ``lock``; the
    lock file goes last, and TreeLock notices when a waiter's lock file was
    unlinked under it.
    """
    if fs.lstat(STATE_DIR, "state") is None or fs.lstat(f"{TXN_DIR}/journal.json", "state"):
        return
    state = load_state(fs)
    sweep(state)
    if state.patches:
        return
    fs.unlink(STATE_FILE, "state")
    fs.remove_tree(BACKUPS_DIR, "state")
    fs.remove_tree(TXN_DIR, "state")
    lock.unlink_file()
    fs.rmdir(STATE_DIR, "state")  # something else lives there: leave it
