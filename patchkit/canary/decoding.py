"""An answer's Content-Encoding undone piece by piece, with a cap on every byte it makes.

A cap checked after each decoded chunk is no cap: `Content-Encoding: gzip,
gzip` turns 3,477 bytes into one 4 GB chunk before anything counts it. Here
each stage (one coding of the stack, decoded last-applied first) asks zlib
for at most PIECE bytes at a time (`decompressobj.decompress(data,
max_length)`) and hands every piece on before asking for the next, and the
bytes in, between the stages and out each count against the cap. Memory
stays at the cap plus a piece per stage, whatever the server stacks.

Supported: gzip (x-gzip; several members, as RFC 1952 allows), deflate
(zlib-wrapped as RFC 9110 says, or raw as some servers send it) and
identity. The canary asks for no other; anything else is refused by name.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

PIECE = 64 * 1024
MAX_CODINGS = 4  # gzip, gzip, gzip, gzip is already no server's answer
GZIP_WBITS = zlib.MAX_WBITS | 16
ACCEPTED = "gzip, deflate"


class DecodeError(Exception):
    """The answer cannot be decoded (an unknown or broken coding); str() says which."""


class TooLarge(DecodeError):
    """More bytes than the cap, at some stage of the decoding."""


class Inflate:
    """One gzip or deflate coding, decoded in pieces of at most PIECE bytes."""

    def __init__(self, name: str):
        self.name = name
        self.wbits = GZIP_WBITS if name == "gzip" else zlib.MAX_WBITS
        self.stream = zlib.decompressobj(self.wbits)
        self.started = False  # no output yet: a raw deflate stream may still be tried

    def feed(self, data: bytes) -> Iterator[bytes]:
        while True:
            if self.stream.eof:
                data = self.next_member(self.stream.unused_data + data)
                if not data:
                    return
            try:
                out = self.stream.decompress(data, PIECE)
            except zlib.error as exc:
                if self.name == "deflate" and not self.started and self.wbits > 0:
                    self.wbits, self.stream = -zlib.MAX_WBITS, zlib.decompressobj(-zlib.MAX_WBITS)
                    continue  # the same bytes again, as a raw deflate stream
                raise DecodeError(f"broken {self.name} data ({exc})") from None
            data = self.stream.unconsumed_tail
            if out:
                self.started = True
                yield out
            if not data and len(out) < PIECE and not self.stream.eof:
                return  # all input taken, nothing pending

    def next_member(self, rest: bytes) -> bytes:
        """What follows the end of a stream: a next gzip member, or nothing at all."""
        if not rest:
            self.stream = _Ended()
            return b""
        if self.name != "gzip":
            raise DecodeError(f"data after the end of the {self.name} stream")
        self.stream = zlib.decompressobj(self.wbits)
        return rest

    def finish(self) -> None:
        """The body ended: a stream cut short is broken, not a shorter answer."""
        if self.started and not self.stream.eof:
            raise DecodeError(f"the {self.name} stream is cut short")


class _Ended:
    """A finished stream that has seen all its input (no further member started)."""

    eof, unused_data, unconsumed_tail = True, b"", b""


class Identity:
    name = "identity"

    def feed(self, data: bytes) -> Iterator[bytes]:
        if data:
            yield data

    def finish(self) -> None:
        pass


def stages(content_encoding: list[str]) -> list:
    """The decoders for the Content-Encoding header values, the last-applied coding first."""
    names = [n.strip().lower() for v in content_encoding for n in v.split(",") if n.strip()]
    if len(names) > MAX_CODINGS:
        raise DecodeError(f"{len(names)} stacked content codings (at most {MAX_CODINGS})")
    made = []
    for name in reversed(names):
        if name in ("gzip", "x-gzip"):
            made.append(Inflate("gzip"))
        elif name == "deflate":
            made.append(Inflate("deflate"))
        elif name == "identity":
            made.append(Identity())
        else:
            raise DecodeError(f"Content-Encoding {name[:40]!r} is not supported")
    return made


class CappedBody:
    """Raw chunks in, decoded bytes kept, every stage's byte count held under ``cap``.

    ``check`` runs between pieces (the deadline), so decoding a large answer
    cannot outlast the run either.
    """

    def __init__(self, content_encoding: list[str], cap: int, check: Callable[[], None]):
        self.stages = stages(content_encoding)
        self.cap, self.check = cap, check
        self.counts = [0] * (len(self.stages) + 1)  # raw, then after each stage
        self.parts: list[bytes] = []

    def feed(self, raw: bytes) -> None:
        self._push(0, raw)

    def _push(self, level: int, data: bytes) -> None:
        self.counts[level] += len(data)
        if self.counts[level] > self.cap:
            raise TooLarge(f"larger than {self.cap} bytes")
        self.check()
        if level == len(self.stages):
            self.parts.append(data)
            return
        for piece in self.stages[level].feed(data):
            self._push(level + 1, piece)

    def finish(self) -> bytes:
        for stage in self.stages:
            stage.finish()
        return b"".join(self.parts)
