"""An adapter or model directory opened once, its files opened through its descriptor.

The directory is the user's, and so is every name in it: a file is opened
with ``openat`` on the directory's descriptor, never by a path string, so a
directory renamed or swapped halfway does not send the reads elsewhere. A
link is followed only when it names a file beside it (``adapter_model.safetensors
-> v2.safetensors``); one that leads out of the directory (``../../secret``,
``/dev/zero``) or through a subdirectory is refused in one line, as is
anything that is not a regular file (a FIFO would hang the read, a device
never ends).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from patchkit.adapters.safetensorsfile import shown
from patchkit.errors import PatchkitError, os_error_line
from patchkit.fs.files import decode_user_json
from patchkit.fs.safepath import kind_of

# adapter_config.json and config.json: PEFT's and transformers' are a few kB,
# a rank_pattern naming every module of a large model tens of kB.
CONFIG_BYTES = 1 << 20


class Directory:
    """A directory held open by descriptor; its files opened relative to it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise PatchkitError(os_error_line(exc, "opening", path=self.path)) from None

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
        """The regular file ``name`` (or the file beside it that a link names), for reading."""
        target = self._resolve(name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(target, flags, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # swapped for a link since _resolve looked
                raise PatchkitError(f"{self.path / name}: became a link while read") from None
            raise PatchkitError(os_error_line(exc, "opening", path=self.path / name)) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise PatchkitError(f"{self.path / name}: {kind_of(mode)}, not a regular file")
        return os.fdopen(fd, "rb")

    def _resolve(self, name: str) -> str:
        try:
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError as exc:
            raise PatchkitError(os_error_line(exc, "reading", path=self.path / name)) from None
        if not stat.S_ISLNK(info.st_mode):
            return name
        try:
            link = os.readlink(name, dir_fd=self.fd)
        except OSError as exc:  # swapped for a file since the stat: read it again
            raise PatchkitError(os_error_line(exc, "reading", path=self.path / name)) from None
        if "/" in link or link in (".", ".."):
            raise PatchkitError(
                f"{self.path / name}: a link to {shown(link)}, out of the directory; refused "
                "(copy the file in, or point patchkit at the directory that holds it)"
            )
        try:
            info = os.stat(link, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:  # a dangling link is the file's problem, not a crash
            raise PatchkitError(
                f"{self.path / name}: a link to {shown(link)}, which is not there"
            ) from None
        except OSError as exc:
            raise PatchkitError(os_error_line(exc, "reading", path=self.path / link)) from None
        if stat.S_ISLNK(info.st_mode):
            raise PatchkitError(f"{self.path / name}: a link to a link ({shown(link)}); refused")
        return link

    def read_bytes(self, name: str, limit: int, what: str) -> bytes:
        """The bytes of ``name`` (opened as :meth:`open` does), at most ``limit`` of them;
        a larger file is refused in one line, not read."""
        with self.open(name) as f:
            size = os.fstat(f.fileno()).st_size
            if size <= limit:
                raw = f.read(limit + 1)
                size = len(raw)  # it may have grown since the fstat
        if size > limit:
            raise PatchkitError(
                f"{self.path / name}: {size} bytes, larger than the {limit} bytes allowed; "
                f"not {what}"
            )
        return raw

    def read_json(self, name: str, what: str) -> dict:
        """A JSON object from ``name``, read capped; one line naming the file if not."""
        raw = self.read_bytes(name, CONFIG_BYTES, what)
        try:
            data = decode_user_json(raw, CONFIG_BYTES)
        except ValueError as exc:
            raise PatchkitError(f"{self.path / name}: not JSON patchkit reads: {exc}") from None
        if not isinstance(data, dict):
            raise PatchkitError(f"{self.path / name}: not a JSON object ({what} expected)")
        return data
