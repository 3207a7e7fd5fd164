"""NaN and Inf in a safetensors tensor, read in fixed chunks and judged by its bits.

A float is NaN or Inf exactly when its exponent bits are all ones (IEEE 754;
bfloat16 is float32's upper 16 bits, so the rule is the same on a uint16),
NaN when its mantissa is also non-zero. The bits are judged a byte lane at a
time with the standard library's C loops, no numpy and no float
conversion: the lane ``buf[k::size]`` holds byte k of every element
(little-endian, as safetensors stores them), ``bytes.translate`` turns each
byte into a 0/1 flag (its exponent bits all set; its mantissa bits non-zero),
and the flags of the lanes are ANDed or ORed as big integers. A chunk whose
top lane has no element with those exponent bits (a finite weight below
2**127 never has them) is passed after one slice, one translate and one
search; only a chunk with a candidate pays for the rest. Memory is one chunk
and a few copies of a quarter or half of it, whatever the tensor's size.

Where numpy is importable, a chunk with a candidate is judged by numpy on the
whole words instead (the same bit rule, one vectorised pass): an adapter that
is Inf throughout then reads at the common path's speed rather than the big
integers' (the 5 s/GB target holds for it too); without numpy the standard
library's path gives the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from patchkit.adapters.safetensorsfile import SafetensorsFile, TensorInfo

CHUNK_BYTES = 8 << 20


def _table(mask: int, all_bits: bool) -> bytes:
    """A translate table: byte -> 1 when (all of / any of) ``mask``'s bits are set, else 0."""
    return bytes(int((b & mask) == mask if all_bits else bool(b & mask)) for b in range(256))


# dtype -> (bytes per element, [(lane, exponent mask)], [(lane, mantissa mask)]); the first
# exponent lane is the top byte, whose flag alone finds the candidates.
_LAYOUTS = {
    "BF16": (2, [(1, 0x7F), (0, 0x80)], [(0, 0x7F)]),
    "F16": (2, [(1, 0x7C)], [(1, 0x03), (0, 0xFF)]),
    "F32": (4, [(3, 0x7F), (2, 0x80)], [(2, 0x7F), (1, 0xFF), (0, 0xFF)]),
}
FLOATS = tuple(_LAYOUTS)
_EXP = {m: _table(m, True) for _, lanes, _ in _LAYOUTS.values() for _, m in lanes}
_MAN = {m: _table(m, False) for _, _, lanes in _LAYOUTS.values() for _, m in lanes}


@dataclass(frozen=True)
class Nonfinite:
    """The bad values of one tensor: how many of each, and the first one's flat index."""

    nan: int
    inf: int
    first: int
    first_value: str  # "nan", "inf" or "-inf"

    @property
    def count(self) -> int:
        return self.nan + self.inf


def scan(st: SafetensorsFile, info: TensorInfo, chunk_bytes: int = CHUNK_BYTES) -> Nonfinite | None:
    """The NaN/Inf of a F32/F16/BF16 tensor, or None when every value is finite."""
    size = _LAYOUTS[info.dtype][0]
    per_chunk = max(chunk_bytes // size, 1)
    buf = bytearray(min(per_chunk, info.numel) * size)
    view = memoryview(buf)
    nan = inf = 0
    first, first_value = -1, ""
    for start in range(0, info.numel, per_chunk):
        n = min(per_chunk, info.numel - start)
        st.read_into(info.begin + start * size, view[: n * size])
        found = _chunk(bytes(view[: n * size]) if n < per_chunk else buf, info.dtype)
        if found is None:
            continue
        c_nan, c_inf, c_first, c_value = found
        nan, inf = nan + c_nan, inf + c_inf
        if first < 0:
            first, first_value = start + c_first, c_value
    return Nonfinite(nan, inf, first, first_value) if first >= 0 else None


# dtype -> (numpy word, exponent mask, mantissa mask, sign bit) of the same rule.
_WORDS = {
    "BF16": ("<u2", 0x7F80, 0x007F, 0x8000),
    "F16": ("<u2", 0x7C00, 0x03FF, 0x8000),
    "F32": ("<u4", 0x7F800000, 0x007FFFFF, 0x80000000),
}


def _numpy():
    """numpy, or None where it is not installed (the check needs only the stdlib)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _chunk(data, dtype: str) -> tuple[int, int, int, str] | None:
    """(NaN count, Inf count, first bad index, its value) of one chunk, or None."""
    size, exp_lanes, man_lanes = _LAYOUTS[dtype]
    top_lane, top_mask = exp_lanes[0]
    top = data[top_lane::size].translate(_EXP[top_mask])
    if b"\x01" not in top:
        return None
    np = _numpy()
    if np is not None:
        return _chunk_numpy(np, data, dtype)
    return _chunk_bits(data, dtype, top)


def _chunk_numpy(np, data, dtype: str) -> tuple[int, int, int, str] | None:
    """_chunk's answer from numpy on whole words."""
    word, exponent, mantissa, sign = _WORDS[dtype]
    values = np.frombuffer(data, dtype=word)
    where = np.flatnonzero((values & exponent) == exponent)
    if not where.size:
        return None
    nan = (values[where] & mantissa) != 0
    nans = int(np.count_nonzero(nan))
    first = int(where[0])
    value = "nan" if nan[0] else ("-inf" if int(values[first]) & sign else "inf")
    return nans, int(where.size) - nans, first, value


def _chunk_bits(data, dtype: str, top: bytes) -> tuple[int, int, int, str] | None:
    """_chunk's answer from the byte lanes as big integers (no numpy)."""
    size, exp_lanes, man_lanes = _LAYOUTS[dtype]
    top_lane = exp_lanes[0][0]
    n = len(top)
    bad = int.from_bytes(top, "little")
    for lane, mask in exp_lanes[1:]:
        bad &= int.from_bytes(data[lane::size].translate(_EXP[mask]), "little")
    if not bad:
        return None
    mantissa = 0
    for lane, mask in man_lanes:
        mantissa |= int.from_bytes(data[lane::size].translate(_MAN[mask]), "little")
    nan_flags = bad & mantissa
    flags = bad.to_bytes(n, "little")
    count = n - flags.count(0)
    nans = n - (nan_flags.to_bytes(n, "little").count(0))
    first = n - len(flags.lstrip(b"\x00"))  # little-endian: element i is byte i
    is_nan = (nan_flags >> (8 * first)) & 1
    negative = data[first * size + top_lane] & 0x80
    value = "nan" if is_nan else ("-inf" if negative else "inf")
    return nans, count - nans, first, value
