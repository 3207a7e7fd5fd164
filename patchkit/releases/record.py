"""A wheel's RECORD: each file's hash and size, the check of every member fetch keeps.

The zip's CRC only says the bytes arrived as the zip holds them; RECORD
(sha256 of each file, as pip checks on install) says they are the bytes the
wheel was built with. A member fetch keeps that RECORD does not list, or
lists with another hash or size, stops the fetch.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re

from patchkit.errors import PatchkitError

ALGORITHMS = ("sha256", "sha384", "sha512")  # the wheel format forbids md5 and sha1
SIZE = re.compile(r"[0-9]{1,15}")  # ASCII digits: str.isdigit() takes '²', which int() refuses


class RecordMismatch(PatchkitError):
    """A member and the wheel's RECORD disagree."""


def parse_record(data: bytes, what: str) -> dict[str, tuple[str, str, int | None]]:
    """path -> (algorithm, urlsafe base64 digest, size or None)."""
    try:
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise RecordMismatch(f"fetch: {what}'s RECORD cannot be read: {exc}") from None
    entries = {}
    for row in rows:
        if not row:
            continue
        path, digest, size = (row + ["", ""])[:3]
        algorithm, _, value = digest.partition("=")
        entries[path] = (algorithm, value, _size(size, path, what))
    return entries


def _size(field: str, path: str, what: str) -> int | None:
    """A row's size: None where RECORD leaves it empty; a field that is no number is refused."""
    if not field.strip():
        return None
    if not SIZE.fullmatch(field.strip()):
        raise RecordMismatch(
            f"fetch: {what}'s RECORD gives {path[:100]!r} the size {field[:20]!r}, not a number"
        )
    return int(field)


def check_member(name: str, content: bytes, record: dict, what: str) -> None:
    """``content`` is what RECORD says ``name`` holds (every member but RECORD itself, which
    the caller never passes; a directory entry has no content)."""
    if name.endswith("/"):
        return
    entry = record.get(name)
    if entry is None:
        raise RecordMismatch(f"fetch: {what}: {name[:100]} is not in the wheel's RECORD")
    algorithm, expected, size = entry
    if algorithm not in ALGORITHMS:
        raise RecordMismatch(
            f"fetch: {what}: RECORD hashes {name[:100]} with {algorithm[:20]!r}, not sha256"
        )
    if size is not None and size != len(content):
        raise RecordMismatch(
            f"fetch: {what}: {name[:100]} is {len(content):,} bytes, RECORD says {size:,}"
        )
    actual = base64.urlsafe_b64encode(hashlib.new(algorithm, content).digest()).rstrip(b"=")
    if actual.decode() != expected.rstrip("="):
        raise RecordMismatch(f"fetch: {what}: {name[:100]} does not match its hash in RECORD")
