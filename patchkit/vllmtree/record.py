"""A wheel's RECORD, read once for everyone: fetch checks the members it keeps against
it, and a tree's RECORD says which files are the wheel's own.

RECORD is CSV, one row per file: its path, ``ALGORITHM=DIGEST`` (urlsafe base64
without padding) and its size, where the last two may be empty (RECORD itself,
files made at install). PEP 376 lets ALGORITHM be any that hashlib offers; the
wheel format (PEP 427) asks for sha256 or stronger and pip writes sha256. So
every algorithm hashlib knows is read, and a sha256 row is read as it always was:
its digest, as hex, is what state.json and the journals compare files with.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import io
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from patchkit.identity import sha256_bytes


class RecordUnreadable(ValueError):
    """RECORD is not CSV; the text is the csv module's own."""


@dataclass(frozen=True)
class RecordRow:
    """One row of RECORD, its fields as written."""

    path: str
    hash: str  # "ALGORITHM=DIGEST", or "" for a row without one
    size: str  # decimal bytes, or ""

    @property
    def algorithm(self) -> str:
        """The hash's algorithm as RECORD names it ("sha256"); "" without a hash."""
        return self.hash.partition("=")[0] if self.hash else ""

    @property
    def known(self) -> bool:
        """Whether the row names a hash this Python can compute."""
        return self.algorithm in hashlib.algorithms_available

    def digest(self) -> bytes | None:
        """The digest's bytes; None when the algorithm is unknown or the value is not a
        digest of that algorithm (not base64, or the wrong length)."""
        if not self.known:
            return None
        value = self.hash.partition("=")[2]
        try:
            raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        except (binascii.Error, ValueError):
            return None
        # shake_* have no fixed length: any length of output is their digest
        size = hashlib.new(self.algorithm).digest_size
        return raw if raw and (size == 0 or len(raw) == size) else None

    def matches(self, data: bytes) -> bool:
        """Whether ``data`` is the file this row describes (by its hash; size not read)."""
        raw = self.digest()
        return raw is not None and _hash(self.algorithm, data, len(raw)) == raw


def _hash(algorithm: str, data: bytes, length: int) -> bytes:
    found = hashlib.new(algorithm, data)
    if algorithm.startswith("shake_"):
        return found.digest(length)
    return found.digest()


def read_rows(text: str) -> dict[str, RecordRow]:
    """RECORD's rows by path (a path listed twice: its last row), empty rows skipped;
    RecordUnreadable when the text is not CSV."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise RecordUnreadable(str(exc)) from None
    return {
        row[0]: RecordRow(*(row + ["", ""])[:3])
        for row in rows
        if row  # a blank line
    }


class WheelRecord(Mapping[str, str]):
    """A tree's RECORD as each file's sha256 (hex), the form patchkit compares files in.

    A sha256 row gives it as written. A row of another algorithm gives it from the
    tree's own file when that file matches the row (the same bytes, so the same
    sha256), read when first asked; when it does not match, a value no sha256 equals
    (``sha384:<hex>``): the file on disk is not the wheel's. A row without a hash, or
    of an algorithm hashlib does not know, says nothing about the file's bytes and is
    left out.
    """

    def __init__(self, rows: dict[str, RecordRow], read: Callable[[str], bytes | None]):
        self._rows = {path: row for path, row in rows.items() if row.known}
        self._read = read
        self._sha256: dict[str, str] = {}

    @classmethod
    def empty(cls) -> WheelRecord:
        """The RECORD of a tree that has none (a checkout): it vouches for no file."""
        return cls({}, lambda relpath: None)

    def row(self, relpath: str) -> RecordRow | None:
        """The row a file's hash comes from (None: RECORD vouches for nothing there)."""
        return self._rows.get(relpath)

    def __getitem__(self, relpath: str) -> str:
        if relpath not in self._sha256:
            self._sha256[relpath] = self._wheel_sha256(self._rows[relpath])
        return self._sha256[relpath]

    def _wheel_sha256(self, row: RecordRow) -> str:
        if row.algorithm == "sha256":
            return row.digest().hex()  # checked when the tree was read
        data = self._read(row.path)
        if data is not None and row.matches(data):
            return sha256_bytes(data)
        return f"{row.algorithm}:{row.digest().hex()}"

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)
