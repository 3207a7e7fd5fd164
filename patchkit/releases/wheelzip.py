"""A wheel's zip directory and members, read from byte ranges, with every bound checked.

A zip ends with its directory: the end record (and for zip64 its locator
and zip64 end record) says where the central directory is; the central
directory lists each member's name, sizes, CRC and where its local header
starts. fetch reads the file's tail, then the directory, then only the
spans of the members it wants: from a member's local header to the next
member's (or the directory), so a data descriptor after the data is in the
span too and the span never needs the local header's own lengths first.

Nothing here trusts the file: the directory must lie inside the file and
before its end record, every member before the directory and apart from
the others, a member's local header must name it as the directory does, a
member is at most ``MAX_MEMBER`` bytes either way, inflating stops at the
declared size, and the CRC must match. Names are not checked here (the
writer does that with the tree's rules).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from patchkit.codes import Code
from patchkit.errors import PatchkitError

EOCD = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
ZIP64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes, just before the end record
ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # 56 bytes
CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # 46 bytes
LOCAL = struct.Struct("<4s2B4HL2L2H")  # 30 bytes
TAIL = 1 << 16  # the end record (22 bytes) and a comment of up to 65,535 bytes fit
MAX_DIRECTORY = 64 << 20  # vLLM 0.26.0's is 0.5 MB for 4,626 members
MAX_MEMBER = 256 << 20  # the largest Python file of a vLLM wheel is under 1 MB
MAX_ENTRIES = 1_000_000
STORED, DEFLATED = 0, 8

Read = Callable[[int, int], bytes]  # bytes [start, end) of the file


class BadWheel(PatchkitError):
    """The zip structure of a wheel is broken or hostile: ``wheel`` names it."""

    code = Code.WHEEL_INVALID


@dataclass(frozen=True)
class Member:
    name: str
    raw_name: bytes
    offset: int  # the local header's
    compressed: int
    size: int
    crc: int
    method: int
    flags: int


@dataclass(frozen=True)
class CentralDirectory:
    offset: int
    size: int
    count: int


def locate_directory(
    tail: bytes, tail_start: int, total: int, read: Read, what: str
) -> CentralDirectory:
    """Where the central directory is, from the last bytes of the file (``tail``)."""
    at = _end_record(tail, what)
    _, disk, cd_disk, _, count, size, offset, _ = EOCD.unpack_from(tail, at)
    end_record = tail_start + at
    if disk != 0 or cd_disk != 0:
        raise BadWheel(f"fetch: {what} is a multi-part zip", wheel=what)
    locator_at = at - ZIP64_LOCATOR.size
    if locator_at >= 0 and tail[locator_at : locator_at + 4] == b"PK\x06\x07":
        count, size, offset, end_record = _zip64(tail, tail_start, locator_at, total, read, what)
    if count > MAX_ENTRIES or size > MAX_DIRECTORY:
        raise BadWheel(
            f"fetch: {what}'s directory lists {count:,} members in {size:,} bytes", wheel=what
        )
    if offset + size > end_record or offset + size > total:
        raise BadWheel(
            f"fetch: {what}'s directory ({offset:,}+{size:,}) lies outside the file "
            f"({total:,} bytes, end record at {end_record:,})",
            wheel=what,
        )
    return CentralDirectory(offset, size, count)


def _end_record(tail: bytes, what: str) -> int:
    """The end record's position: its signature, with a comment length that ends the file."""
    at = len(tail) - EOCD.size
    while at >= 0:
        at = tail.rfind(b"PK\x05\x06", 0, at + 4)
        if at < 0:
            break
        if at + EOCD.size + EOCD.unpack_from(tail, at)[-1] == len(tail):
            return at
        at -= 1
    raise BadWheel(
        f"fetch: {what} has no zip end record in its last {len(tail):,} bytes", wheel=what
    )


def _zip64(tail, tail_start, locator_at, total, read, what):
    _, _, record_at, _ = ZIP64_LOCATOR.unpack_from(tail, locator_at)
    if record_at + ZIP64_EOCD.size > tail_start + locator_at:
        raise BadWheel(f"fetch: {what}'s zip64 end record lies outside the file", wheel=what)
    if record_at >= tail_start:
        record = tail[record_at - tail_start : record_at - tail_start + ZIP64_EOCD.size]
    else:
        record = read(record_at, record_at + ZIP64_EOCD.size)
    fields = ZIP64_EOCD.unpack(record)
    if fields[0] != b"PK\x06\x06":
        raise BadWheel(
            f"fetch: {what}'s zip64 end record is not where its locator says", wheel=what
        )
    _, _, _, _, disk, cd_disk, _, count, size, offset = fields
    if disk != 0 or cd_disk != 0:
        raise BadWheel(f"fetch: {what} is a multi-part zip", wheel=what)
    return count, size, offset, record_at


def read_directory(data: bytes, directory: CentralDirectory, what: str) -> list[Member]:
    """The members the central directory lists, each checked to lie before it."""
    members, at = [], 0
    for _ in range(directory.count):
        if at + CENTRAL.size > len(data):
            raise BadWheel(f"fetch: {what}'s directory ends inside an entry", wheel=what)
        fields = CENTRAL.unpack_from(data, at)
        if fields[0] != b"PK\x01\x02":
            raise BadWheel(
                f"fetch: {what}'s directory has a broken entry at byte {at:,}", wheel=what
            )
        flags, method, crc = fields[5], fields[6], fields[9]
        compressed, size = fields[10], fields[11]
        name_len, extra_len, comment_len, offset = fields[12], fields[13], fields[14], fields[18]
        end = at + CENTRAL.size + name_len + extra_len + comment_len
        if end > len(data):
            raise BadWheel(f"fetch: {what}'s directory ends inside an entry", wheel=what)
        raw = data[at + CENTRAL.size : at + CENTRAL.size + name_len]
        extra = data[at + CENTRAL.size + name_len : at + CENTRAL.size + name_len + extra_len]
        size, compressed, offset = _zip64_extra(extra, size, compressed, offset, raw, what)
        name = raw.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
        members.append(Member(name, raw, offset, compressed, size, crc, method, flags))
        at = end
    if at != len(data):
        raise BadWheel(
            f"fetch: {what}'s directory holds {len(data) - at:,} bytes past its entries", wheel=what
        )
    _check_layout(members, directory, what)
    return members


def _zip64_extra(extra, size, compressed, offset, raw, what):
    """Sizes and offset that do not fit 32 bits come from the zip64 extra field (0x0001)."""
    wanted = [v == 0xFFFFFFFF for v in (size, compressed, offset)]
    if not any(wanted):
        return size, compressed, offset
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, at)
        if at + 4 + length > len(extra):
            break  # a field longer than the extra data holding it
        if tag == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            result = [size, compressed, offset]
            for i, needed in enumerate(wanted):
                if needed:
                    if not values:
                        break
                    result[i] = values.pop(0)
            else:
                return tuple(result)
            break
        at += 4 + length
    raise BadWheel(f"fetch: {what}: member {raw[:80]!r} lacks its zip64 sizes", wheel=what)


def _check_layout(members: list[Member], directory: CentralDirectory, what: str) -> None:
    """Every local header before the directory, no two at one place, names unique."""
    names, offsets = set(), set()
    for member in members:
        if member.name in names:
            raise BadWheel(f"fetch: {what} holds {member.name[:80]!r} twice", wheel=what)
        if member.offset in offsets:
            raise BadWheel(
                f"fetch: {what}: two members start at byte {member.offset:,}", wheel=what
            )
        if member.offset + LOCAL.size + len(member.raw_name) > directory.offset:
            raise BadWheel(
                f"fetch: {what}: member {member.name[:80]!r} lies past the directory", wheel=what
            )
        names.add(member.name)
        offsets.add(member.offset)


def spans(members: list[Member], wanted: Iterable[Member], directory: CentralDirectory, what: str):
    """(start, end, member) for each wanted member: its local header up to the next one's."""
    starts = sorted(m.offset for m in members) + [directory.offset]
    following = dict(zip(starts, starts[1:], strict=False))
    out = []
    for member in wanted:
        end = following[member.offset]
        largest = max(member.compressed, member.size)
        if largest > MAX_MEMBER:
            raise BadWheel(
                f"fetch: {what}: member {member.name[:80]!r} is {largest:,} bytes, "
                f"over the {MAX_MEMBER:,} a source file may have",
                wheel=what,
            )
        if member.offset + LOCAL.size + len(member.raw_name) + member.compressed > end:
            raise BadWheel(
                f"fetch: {what}: member {member.name[:80]!r} overlaps the next one", wheel=what
            )
        out.append((member.offset, end, member))
    return sorted(out, key=lambda span: span[0])


def coalesce(member_spans, gap: int, most: int) -> list[tuple[int, int, list]]:
    """Neighbouring spans as one range when less than ``gap`` bytes lie between them,
    up to ``most`` bytes a range (one member may be larger alone)."""
    ranges: list[tuple[int, int, list]] = []
    for start, end, member in member_spans:
        if ranges and start - ranges[-1][1] <= gap and end - ranges[-1][0] <= most:
            first, _, held = ranges[-1]
            ranges[-1] = (first, end, [*held, (start, end, member)])
        else:
            ranges.append((start, end, [(start, end, member)]))
    return ranges


def member_bytes(member: Member, data: bytes, data_start: int, what: str) -> bytes:
    """The member's content, from ``data`` (file bytes from ``data_start``) holding its span."""
    at = member.offset - data_start
    header = data[at : at + LOCAL.size]
    if len(header) != LOCAL.size or header[:4] != b"PK\x03\x04":
        raise BadWheel(f"fetch: {what}: no local header for {member.name[:80]!r}", wheel=what)
    fields = LOCAL.unpack(header)
    name_len, extra_len = fields[10], fields[11]
    if data[at + LOCAL.size : at + LOCAL.size + name_len] != member.raw_name:
        raise BadWheel(
            f"fetch: {what}: the local header of {member.name[:80]!r} names another", wheel=what
        )
    begin = at + LOCAL.size + name_len + extra_len
    stored = data[begin : begin + member.compressed]
    if len(stored) != member.compressed:
        raise BadWheel(f"fetch: {what}: member {member.name[:80]!r} runs past its span", wheel=what)
    content = _decompress(member, stored, what)
    if zlib.crc32(content) != member.crc:
        raise BadWheel(f"fetch: {what}: member {member.name[:80]!r} fails its CRC", wheel=what)
    return content


def _decompress(member: Member, stored: bytes, what: str) -> bytes:
    if member.flags & 0x1:
        raise BadWheel(f"fetch: {what}: member {member.name[:80]!r} is encrypted", wheel=what)
    if member.method == STORED:
        content = stored
    elif member.method == DEFLATED:
        inflater = zlib.decompressobj(-15)
        try:
            content = inflater.decompress(stored, member.size + 1)
        except zlib.error as exc:
            raise BadWheel(
                f"fetch: {what}: member {member.name[:80]!r}: {exc}", wheel=what
            ) from None
    else:
        raise BadWheel(
            f"fetch: {what}: member {member.name[:80]!r} uses compression {member.method}",
            wheel=what,
        )
    if len(content) != member.size:
        raise BadWheel(
            f"fetch: {what}: member {member.name[:80]!r} holds {len(content):,}"
            f"{'+' if len(content) > member.size else ''} bytes, not the {member.size:,} "
            "its directory entry says",
            wheel=what,
        )
    return content
