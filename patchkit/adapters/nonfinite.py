"""NaN and Inf in a safetensors tensor, read in fixed chunks and judged by its bits.

Every floating type vLLM can load a LoRA factor from is scanned: BF16, F16,
F32, F64 and the two 8-bit floats (F8_E4M3, whose only non-finite value is
NaN, and F8_E5M2). With the sign bit cleared, an element's bits are its
magnitude in order (IEEE 754; bfloat16 is float32's upper 16 bits): Inf is
the smallest non-finite pattern and everything above it is NaN. vLLM casts
a factor into the LoRA dtype (a bfloat16 model's is bf16) when it loads
it, so a F32 or F64 value past bfloat16's largest (3.39e38) is counted too:
finite in the file, Inf once served (``beyond``).

The bits are judged a byte lane at a time with the standard library's C
loops, no numpy and no float conversion: the lane ``buf[k::size]`` holds
byte k of every element (little-endian, as safetensors stores them),
``bytes.translate`` turns each byte into a 0/1 flag, and "magnitude above a
bound" is decided from the lowest lane up as big integers (above on this
lane, or equal on it and above on the lanes below). A chunk whose top lane
has no element that could be past the bound (a finite weight below 2**113
never is) is passed after one slice, one translate and one search; only a
chunk with a candidate pays for the rest. Memory is one chunk and a few
copies of a fraction of it, whatever the tensor's size.

Where numpy is importable, a chunk with a candidate is judged by numpy on the
whole words instead (the same rule, one vectorised pass): an adapter that is
Inf throughout then reads at the common path's speed rather than the big
integers' (the 5 s/GB target holds for it too); without numpy the standard
library's path gives the same answer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache

from patchkit.adapters.safetensorsfile import SafetensorsFile, TensorInfo

CHUNK_BYTES = 8 << 20
BF16_LARGEST = (2 - 2**-7) * 2.0**127  # bfloat16 0x7F7F, 3.39e38


@dataclass(frozen=True)
class _Layout:
    """One dtype's magnitudes (bits with the sign cleared): the largest finite, Inf (the
    largest finite where the type has no Inf: above it is NaN), and the largest judged
    fine (bfloat16's largest, where the type holds larger ones)."""

    size: int
    finite: int
    inf: int
    limit: int
    word: str  # numpy's unsigned word of the size
    unpack: str = ""  # struct's format of the value, for a finite one shown


_LAYOUTS = {
    "BF16": _Layout(2, 0x7F7F, 0x7F80, 0x7F7F, "<u2"),
    "F16": _Layout(2, 0x7BFF, 0x7C00, 0x7BFF, "<u2"),
    "F32": _Layout(4, 0x7F7FFFFF, 0x7F800000, 0x7F7F0000, "<u4", "<f"),
    "F64": _Layout(8, 0x7FEFFFFFFFFFFFFF, 0x7FF0000000000000, 0x47EFE00000000000, "<u8", "<d"),
    "F8_E5M2": _Layout(1, 0x7B, 0x7C, 0x7B, "<u1"),
    "F8_E4M3": _Layout(1, 0x7E, 0x7E, 0x7E, "<u1"),  # e4m3fn: no Inf, 0x7F is NaN
}
FLOATS = tuple(_LAYOUTS)


@cache
def _table(test: str, bound: int, top: bool) -> bytes:
    """A translate table: byte -> 1 when it is ``test`` ("gt", "eq", "ge") ``bound``, else 0;
    on the top lane the sign bit is cleared first."""
    out = bytearray(256)
    for b in range(256):
        v = b & 0x7F if top else b
        out[b] = v > bound if test == "gt" else v == bound if test == "eq" else v >= bound
    return bytes(out)


@dataclass(frozen=True)
class Nonfinite:
    """The bad values of one tensor: how many of each, and the first one's flat index."""

    nan: int
    inf: int
    first: int
    first_value: str  # "nan", "inf", "-inf", or the value of one past bfloat16 ("-1e+39")
    beyond: int = 0  # finite in the file, past bfloat16's largest: Inf once cast to bf16

    @property
    def count(self) -> int:
        return self.nan + self.inf + self.beyond


def scan(st: SafetensorsFile, info: TensorInfo, chunk_bytes: int = CHUNK_BYTES) -> Nonfinite | None:
    """The bad values of a tensor of a type in FLOATS, or None when every value is fine."""
    return scan_values(st, info, chunk_bytes)[0]


def scan_values(
    st: SafetensorsFile, info: TensorInfo, chunk_bytes: int = CHUNK_BYTES
) -> tuple[Nonfinite | None, bool]:
    """:func:`scan`'s answer, and whether every value is zero (+0 or -0): a LoRA factor
    that is all zero makes its module's B @ A zero, the adapter a no-op there. Read in the
    same pass; a chunk is tested for zeros only while every one before it was zero."""
    size = _LAYOUTS[info.dtype].size
    per_chunk = max(chunk_bytes // size, 1)
    buf = bytearray(min(per_chunk, info.numel) * size)
    view = memoryview(buf)
    nan = inf = beyond = 0
    first, first_value = -1, ""
    zero = True
    for start in range(0, info.numel, per_chunk):
        n = min(per_chunk, info.numel - start)
        st.read_into(info.begin + start * size, view[: n * size])
        data = bytes(view[: n * size]) if n < per_chunk else buf
        zero = zero and _all_zero(data, size)
        found = _chunk(data, info.dtype)
        if found is None:
            continue
        c_nan, c_inf, c_beyond, c_first, c_value = found
        nan, inf, beyond = nan + c_nan, inf + c_inf, beyond + c_beyond
        if first < 0:
            first, first_value = start + c_first, c_value
    bad = Nonfinite(nan, inf, first, first_value, beyond) if first >= 0 else None
    return bad, zero


def _all_zero(data, size: int) -> bool:
    """Every element +0 or -0: each byte is 0, but the top byte, which may be the sign alone
    (0x80); counted by the C loops of bytes.count."""
    return data.count(0) + data[size - 1 :: size].count(0x80) == len(data)


def _numpy():
    """numpy, or None where it is not installed (the check needs only the stdlib)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


Found = tuple[int, int, int, int, str]  # NaN, Inf, beyond, first bad index, its value


def _chunk(data, dtype: str) -> Found | None:
    """(NaN count, Inf count, beyond count, first bad index, its value) of one chunk, or None."""
    layout = _LAYOUTS[dtype]
    size = layout.size
    top_bound = (layout.limit >> (8 * (size - 1))) & 0x7F
    if b"\x01" not in data[size - 1 :: size].translate(_table("ge", top_bound, True)):
        return None
    np = _numpy()
    if np is not None:
        return _chunk_numpy(np, data, dtype)
    return _chunk_bits(data, dtype)


def _value(data, index: int, layout: _Layout, nan: bool, nonfinite: bool) -> str:
    """The first bad element as the finding shows it: nan, inf, -inf, or the number."""
    at = index * layout.size
    if nan:
        return "nan"
    negative = data[at + layout.size - 1] & 0x80
    if nonfinite:
        return "-inf" if negative else "inf"
    (number,) = struct.unpack_from(layout.unpack, data, at)
    return f"{number:.4g}"


def _chunk_numpy(np, data, dtype: str) -> Found | None:
    """_chunk's answer from numpy on whole words."""
    layout = _LAYOUTS[dtype]
    word = np.dtype(layout.word).type
    values = np.frombuffer(data, dtype=layout.word)
    magnitude = values & word((1 << (8 * layout.size - 1)) - 1)
    where = np.flatnonzero(magnitude > word(layout.limit))
    if not where.size:
        return None
    bad = magnitude[where]
    nonfinite = bad > word(layout.finite)
    nan = bad > word(layout.inf)
    nans = int(np.count_nonzero(nan))
    nonfinites = int(np.count_nonzero(nonfinite))
    first = int(where[0])
    value = _value(data, first, layout, bool(nan[0]), bool(nonfinite[0]))
    return nans, nonfinites - nans, int(where.size) - nonfinites, first, value


def _chunk_bits(data, dtype: str) -> Found | None:
    """_chunk's answer from the byte lanes as big integers (no numpy)."""
    layout = _LAYOUTS[dtype]
    over = _above(data, layout.size, layout.limit)
    if not over:
        return None
    nonfinite = over if layout.finite == layout.limit else _above(data, layout.size, layout.finite)
    nan = nonfinite if layout.inf == layout.finite else _above(data, layout.size, layout.inf)
    first = ((over & -over).bit_length() - 1) // 8  # element i's flag is bit 8 * i
    flag = 1 << (8 * first)
    value = _value(data, first, layout, bool(nan & flag), bool(nonfinite & flag))
    nans, nonfinites = nan.bit_count(), nonfinite.bit_count()
    return nans, nonfinites - nans, over.bit_count() - nonfinites, first, value


def _above(data, size: int, bound: int) -> int:
    """Flags as one integer (bit 8 * i for element i): the element's magnitude is above
    ``bound``. From the lowest lane up: above on this lane, or equal on it and above below."""
    above = 0
    for lane in range(size):
        byte, top = (bound >> (8 * lane)) & 0xFF, lane == size - 1
        column = data[lane::size]
        gt = int.from_bytes(column.translate(_table("gt", byte, top)), "little")
        if above:
            gt |= int.from_bytes(column.translate(_table("eq", byte, top)), "little") & above
        above = gt
    return above
