"""A wheel's RECORD: each file's hash and size, the check of every member fetch keeps.

The zip's CRC only says the bytes arrived as the zip holds them; RECORD
(each file's hash, sha256 as pip writes it, checked as pip checks on install)
says they are the bytes the wheel was built with. A member fetch keeps that
RECORD does not list, or lists with another hash or size, or with md5 or sha1
(which the wheel format forbids), stops the fetch. RECORD itself is read by
patchkit.vllmtree.record, the reader a tree's RECORD goes through too.
"""

from __future__ import annotations

import re

from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.vllmtree.record import RecordRow, RecordUnreadable, read_rows

FORBIDDEN = ("md5", "sha1")  # the wheel format forbids them; any other hashlib algorithm is read
SIZE = re.compile(r"[0-9]{1,15}")  # ASCII digits: str.isdigit() takes '²', which int() refuses


class RecordMismatch(PatchkitError):
    """A member and the wheel's RECORD disagree (or RECORD cannot be read): ``wheel``."""

    code = Code.RECORD_MISMATCH


def parse_record(data: bytes, what: str) -> dict[str, RecordRow]:
    """RECORD's rows by path (patchkit.vllmtree.record, the one reader), each size checked."""
    try:
        rows = read_rows(data.decode("utf-8"))
    except (UnicodeDecodeError, RecordUnreadable) as exc:
        raise RecordMismatch(f"fetch: {what}'s RECORD cannot be read: {exc}", wheel=what) from None
    for row in rows.values():
        _size(row.size, row.path, what)
    return rows


def _size(field: str, path: str, what: str) -> int | None:
    """A row's size: None where RECORD leaves it empty; a field that is no number is refused."""
    if not field.strip():
        return None
    if not SIZE.fullmatch(field.strip()):
        raise RecordMismatch(
            f"fetch: {what}'s RECORD gives {path[:100]!r} the size {field[:20]!r}, not a number",
            wheel=what,
        )
    return int(field)


def check_member(name: str, content: bytes, record: dict[str, RecordRow], what: str) -> None:
    """``content`` is what RECORD says ``name`` holds (every member but RECORD itself, which
    the caller never passes; a directory entry has no content)."""
    if name.endswith("/"):
        return
    row = record.get(name)
    if row is None:
        raise RecordMismatch(
            f"fetch: {what}: {name[:100]} is not in the wheel's RECORD", wheel=what
        )
    if not row.known or row.algorithm in FORBIDDEN:
        raise RecordMismatch(
            f"fetch: {what}: RECORD hashes {name[:100]} with {row.algorithm[:20]!r}, not sha256",
            wheel=what,
        )
    size = _size(row.size, name, what)
    if size is not None and size != len(content):
        raise RecordMismatch(
            f"fetch: {what}: {name[:100]} is {len(content):,} bytes, RECORD says {size:,}",
            wheel=what,
        )
    if not row.matches(content):
        raise RecordMismatch(
            f"fetch: {what}: {name[:100]} does not match its hash in RECORD", wheel=what
        )
