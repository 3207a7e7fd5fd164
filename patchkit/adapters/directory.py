"""An adapter or model directory opened once, its files opened through its descriptor.

The directory is the user's, and so is every name in it: a file is opened
with ``openat`` on the directory's descriptor, never by a path string, so a
directory renamed or swapped halfway does not send the reads elsewhere. A
link is followed only when it names a file beside it (``adapter_model.safetensors
-> v2.safetensors``), or when the directory is a Hugging Face cache snapshot and
the link names its blob (``../../blobs/HASH``, checked on descriptors); one
that leads elsewhere out of the directory (``../../secret``, ``/dev/zero``) or
through a subdirectory is refused in one line, as is
anything that is not a regular file (a FIFO would hang the read, a device
never ends).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from patchkit.adapters.safetensorsfile import shown
from patchkit.errors import FileProblem, OsFailure, OversizedFile, PatchkitError, UnsafeFile
from patchkit.fs.files import decode_user_json
from patchkit.fs.safepath import kind_of

# adapter_config.json and config.json: PEFT's and transformers' are a few kB,
# a rank_pattern naming every module of a large model tens of kB.
CONFIG_BYTES = 1 << 20
# A Hugging Face cache snapshot's file: a link to its content-addressed blob.
HF_BLOB = re.compile(r"\.\./\.\./blobs/([A-Za-z0-9][A-Za-z0-9._-]{0,127})")


class Directory:
    """A directory held open by descriptor; its files opened relative to it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise OsFailure(exc, "opening", path=self.path) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Directory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has(self, name: str) -> bool:
        """Whether an entry of that name is there (of any kind: a link or FIFO is refused
        later, when it is opened, with a line that says what it is)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def open(self, name: str):
        """The regular file ``name`` (or the file beside it that a link names, or the blob a
        Hugging Face snapshot links to), for reading.

        Its type is checked before it is opened, and again on the descriptor: a
        device is never opened (opening one can act, as a tape rewinds or a
        watchdog arms), and what was opened is what is read."""
        where, target = self._resolve(name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            mode = os.stat(target, dir_fd=where, follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                raise UnsafeFile(self.path / name, f"{kind_of(mode)}, not a regular file")
            fd = os.open(target, flags, dir_fd=where)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # swapped for a link since _resolve looked
                raise UnsafeFile(self.path / name, "became a link while read") from None
            raise OsFailure(exc, "opening", path=self.path / name) from None
        finally:
            if where != self.fd:
                os.close(where)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise UnsafeFile(self.path / name, f"{kind_of(mode)}, not a regular file")
        return os.fdopen(fd, "rb")

    def _resolve(self, name: str) -> tuple[int, str]:
        """(directory descriptor, name) to open: this directory's, or a snapshot's blobs."""
        try:
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError as exc:
            raise OsFailure(exc, "reading", path=self.path / name) from None
        if not stat.S_ISLNK(info.st_mode):
            return self.fd, name
        try:
            link = os.readlink(name, dir_fd=self.fd)
        except OSError as exc:  # swapped for a file since the stat: read it again
            raise OsFailure(exc, "reading", path=self.path / name) from None
        blob = HF_BLOB.fullmatch(link)
        if blob:
            blobs = self._snapshot_blobs()
            if blobs is not None:
                return blobs, blob.group(1)
        if "/" in link or link in (".", ".."):
            raise UnsafeFile(
                self.path / name,
                f"a link to {shown(link)}, out of the directory; refused "
                "(copy the file in, or point patchkit at the directory that holds it)",
            )
        try:
            info = os.stat(link, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:  # a dangling link is the file's problem, not a crash
            raise FileProblem(
                self.path / name, f"a link to {shown(link)}, which is not there"
            ) from None
        except OSError as exc:
            raise OsFailure(exc, "reading", path=self.path / link) from None
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeFile(self.path / name, f"a link to a link ({shown(link)}); refused")
        return self.fd, link

    def _snapshot_blobs(self) -> int | None:
        """The blobs directory of the Hugging Face cache repository this directory is a
        snapshot of (REPO/snapshots/REV, its files links to ../../blobs/HASH, as
        huggingface_hub writes them), held by descriptor; None if it is not one. Checked
        on the descriptors, not the path's words: this directory's parent is REPO's
        `snapshots`, and `blobs` is a real directory beside it."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        opened = []
        try:
            parent = os.open("..", flags, dir_fd=self.fd)
            opened.append(parent)
            repo = os.open("..", flags, dir_fd=parent)
            opened.append(repo)
            snapshots = os.stat("snapshots", dir_fd=repo, follow_symlinks=False)
            here = os.fstat(parent)
            if (snapshots.st_dev, snapshots.st_ino) != (here.st_dev, here.st_ino):
                return None
            return os.open("blobs", flags, dir_fd=repo)
        except OSError:
            return None
        finally:
            for fd in opened:
                os.close(fd)

    def read_bytes(self, name: str, limit: int, what: str) -> bytes:
        """The bytes of ``name`` (opened as :meth:`open` does), at most ``limit`` of them;
        a larger file is refused in one line, not read."""
        with self.open(name) as f:
            size = os.fstat(f.fileno()).st_size
            if size <= limit:
                raw = f.read(limit + 1)
                size = len(raw)  # it may have grown since the fstat
        if size > limit:
            raise OversizedFile(
                self.path / name,
                f"{size} bytes, larger than the {limit} bytes allowed; not {what}",
                limit=limit,
            )
        return raw

    def read_json(self, name: str, what: str) -> dict:
        """A JSON object from ``name``, read capped; one line naming the file if not."""
        raw = self.read_bytes(name, CONFIG_BYTES, what)
        try:
            data = decode_user_json(raw, CONFIG_BYTES)
        except ValueError as exc:
            raise FileProblem(self.path / name, f"not JSON patchkit reads: {exc}") from None
        if not isinstance(data, dict):
            raise FileProblem(self.path / name, f"not a JSON object ({what} expected)")
        return data


def about(exc: PatchkitError, path: Path) -> str:
    """What a failure says about the file at ``path``: its detail alone when it is a
    :class:`FileProblem` of that file (a finding names the file already), else all of it."""
    if isinstance(exc, FileProblem) and str(exc.path) == str(path):
        return exc.detail
    return str(exc)
