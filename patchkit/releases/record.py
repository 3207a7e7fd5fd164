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

from patchkit.errors import PatchkitError

ALGORITHMS = ("sha256", "sha384", "sha512")  # the wheel format forbids md5 and sha1
UNLISTED = ("RECORD", "RECORD.jws", "RECORD.p7s")  # of the dist-info: not hashed in RECORD


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
        entries[path] = (algorithm, value, int(size) if size.strip().isdigit() else None)
    return entries


def check_member(name: str, content: bytes, record: dict, what: str) -> None:
    """``content`` is what RECORD says ``name`` holds (a dist-info's RECORD itself excepted)."""
    if name.endswith("/") or (".dist-info/" in name and name.rsplit("/", 1)[1] in UNLISTED):
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
