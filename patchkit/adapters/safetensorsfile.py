"""safetensors files for the merged reference: read lazily and checked, written plainly.

The format is an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte offsets, then the raw bytes. A model's
shards and an adapter are the user's files, so every header entry is checked
(a dtype name, a shape, offsets inside the file, a byte count that fits the
shape) and the header is read capped before anything is parsed; the file is
opened only when it is a regular file, and read again only if it is still
the same file. torch is imported inside functions only, so `patchkit verify`
plans a merge (headers only) before it needs torch.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from patchkit.codes import Code
from patchkit.errors import FileProblem, OsFailure, PatchkitError, UnsafeFile
from patchkit.fs.files import decode_user_json
from patchkit.fs.safepath import kind_of


class SafetensorsInvalid(FileProblem):
    """A weights file that is no safetensors file patchkit reads (a header it refuses, a
    tensor outside the file or over another's bytes, a file cut short): ``path``,
    ``detail``."""

    code = Code.SAFETENSORS_INVALID


class DtypeUnsupported(PatchkitError):
    """A tensor type patchkit does not convert (``dtype``: its safetensors or torch name)."""

    code = Code.DTYPE_UNSUPPORTED


# Byte size of each safetensors dtype.
_DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# The largest safetensors header and model.safetensors.index.json read. Both
# hold one entry per tensor, about 100-150 bytes: a 5 GB shard of a per-expert
# MoE checkpoint, or a per-expert adapter of every expert of a 256-expert model
# (89,000 tensors), stays under 16 MB, and an index of 300,000 tensors under
# 32 MiB. A header parsed into Python objects takes several times its bytes,
# so the cap is also what bounds the memory a hostile file can take.
MANIFEST_BYTES = 32 << 20
# Tensor dimensions (PyTorch tensors have at most 64; the product of the shape
# stays a small integer).
_MAX_DIMS = 64


def torch_dtype(name: str):
    import torch

    table = {
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F64": torch.float64,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
    if name not in table:
        raise DtypeUnsupported(
            f"safetensors dtype {name} cannot be read as a torch tensor here", dtype=name
        )
    return table[name]


def dtype_name(dtype) -> str:
    import torch

    table = {
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.float64: "F64",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    if dtype not in table:
        raise DtypeUnsupported(
            f"torch dtype {dtype} has no safetensors name here", dtype=str(dtype)
        )
    return table[dtype]


# A shape shows at most this many dimensions: a header may declare 64 dimensions of
# 2**62 (a zero-sized tensor holds no bytes), a 4 kB line in every message naming it.
SHOWN_DIMS = 6


def dims(shape) -> str:
    """'(2048, 16)'; past SHOWN_DIMS dimensions '(1, 2, 3, 4, 5, 6, ... 64 dimensions)'."""
    shown_dims = ", ".join(str(d) for d in shape[:SHOWN_DIMS])
    if len(shape) > SHOWN_DIMS:
        return f"({shown_dims}, ... {len(shape)} dimensions)"
    return f"({shown_dims})"


def tensor_bytes(t) -> bytes:
    """The raw bytes of a CPU tensor (no numpy needed)."""
    t = t.detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; begin/end are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """A safetensors file read lazily: the header at open, tensor bytes on request.

    ``opener`` opens the file (a regular file, for reading, in binary): by
    default by its path; `adapter check` passes one that opens it through the
    adapter directory's descriptor and refuses a link out of it.
    """

    def __init__(self, path: Path, opener=None):
        self.path = Path(path)
        self._opener = opener or (lambda: _open_regular(self.path))
        try:
            with self._opener() as f:
                info = os.fstat(f.fileno())
                self.size, self._identity = info.st_size, (info.st_dev, info.st_ino)
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsInvalid(
                        self.path, "not a safetensors file (shorter than 8 bytes)"
                    )
                (length,) = struct.unpack("<Q", head)
                if length > MANIFEST_BYTES or 8 + length > self.size:
                    raise SafetensorsInvalid(
                        self.path,
                        f"not a safetensors file patchkit reads (header length "
                        f"{length} in a file of {self.size} bytes; at most {MANIFEST_BYTES})",
                    )
                raw = f.read(length)
        except OSError as exc:
            raise OsFailure(exc, "reading", path=self.path) from exc
        try:
            header = decode_user_json(raw, MANIFEST_BYTES)
        except ValueError as exc:
            raise SafetensorsInvalid(self.path, f"safetensors header unusable: {exc}") from None
        if not isinstance(header, dict):
            raise SafetensorsInvalid(self.path, "safetensors header is not a JSON object")
        self.header_bytes = head + raw
        self.data_start = 8 + length
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise SafetensorsInvalid(self.path, "safetensors __metadata__ is not a JSON object")
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            info = self._tensor_info(name, entry)
            size = _DTYPE_SIZES.get(info.dtype)
            if size is not None and info.numel * size != info.nbytes:
                raise SafetensorsInvalid(
                    self.path,
                    f"{shown(name)} is {info.dtype} {dims(info.shape)} but "
                    f"holds {info.nbytes} bytes",
                )
            self.tensors[name] = info
        self._refuse_overlaps()
        self._handle = None

    def _refuse_overlaps(self) -> None:
        """No two tensors share bytes, as the safetensors library itself requires: a header
        of many tensors over one stretch of the file would have every reader scan that
        stretch once per tensor (34 MB of header, 1.6 TB to read)."""
        ranges = sorted((t.begin, t.end, n) for n, t in self.tensors.items() if t.end > t.begin)
        for (_, end, first), (begin, _, second) in zip(ranges, ranges[1:], strict=False):
            if begin < end:
                raise SafetensorsInvalid(
                    self.path,
                    f"{shown(second)} overlaps {shown(first)} (bytes from "
                    f"{begin - self.data_start}); safetensors tensors never share bytes",
                )

    def _tensor_info(self, name: str, entry: object) -> TensorInfo:
        """One header entry, checked: a dtype name, a shape and two offsets inside the file."""
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
        if not (
            isinstance(dtype, str)
            and _counts(shape)
            and len(shape) <= _MAX_DIMS
            and _counts(offsets)
            and len(offsets) == 2
        ):
            raise SafetensorsInvalid(
                self.path,
                f"header entry {shown(name)} is not "
                "{dtype: name, shape: [counts], data_offsets: [begin, end]}",
            )
        begin, end = offsets
        info = TensorInfo(name, dtype, tuple(shape), self.data_start + begin, self.data_start + end)
        if begin > end or info.end > self.size:
            raise SafetensorsInvalid(
                self.path,
                f"{shown(name)} lies outside the file (bytes {begin}..{end} of "
                f"{self.size - self.data_start})",
            )
        return info

    def _file(self):
        """The file again for its tensors' bytes: the same file the header came from."""
        if self._handle is None:
            handle = self._opener()
            info = os.fstat(handle.fileno())
            if (info.st_dev, info.st_ino) != self._identity:
                handle.close()
                raise FileProblem(self.path, "replaced since its header was read")
            self._handle = handle
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_bytes(self, begin: int, length: int) -> bytearray:
        buf = bytearray(length)
        self.read_into(begin, memoryview(buf))
        return buf

    def read_into(self, begin: int, buf: memoryview) -> None:
        """Fill ``buf`` from byte ``begin`` on (a file cut short since its header: one line)."""
        f = self._file()
        f.seek(begin)
        got = 0
        while got < len(buf):
            n = f.readinto(buf[got:])
            if not n:
                raise SafetensorsInvalid(self.path, f"truncated at byte {begin + got}")
            got += n

    def read_rows(self, name: str, row0: int, nrows: int):
        """Rows [row0, row0 + nrows) of a tensor viewed as (rows, shape[-1])."""
        import torch

        info = self.tensors[name]
        cols = info.shape[-1] if info.shape else 1
        item = _DTYPE_SIZES[info.dtype]
        dtype = torch_dtype(info.dtype)
        if nrows * cols == 0:
            return torch.empty((nrows, cols), dtype=dtype)
        buf = self.read_bytes(info.begin + row0 * cols * item, nrows * cols * item)
        return torch.frombuffer(buf, dtype=dtype).reshape(nrows, cols)

    def tensor(self, name: str):
        """A whole tensor in its stored dtype (for adapter factors and small tensors)."""
        import torch

        info = self.tensors[name]
        dtype = torch_dtype(info.dtype)
        if info.numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(self.read_bytes(info.begin, info.nbytes), dtype=dtype).reshape(
            info.shape
        )


def _open_regular(path: Path):
    """A regular file opened for reading; never waits on a FIFO, never opens a device.

    The type is checked before the open (a device is not opened at all) and on
    the descriptor (what was opened is what is read): a FIFO named like a weight
    file hung the read.
    """
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return os.fdopen(fd, "rb")
        os.close(fd)
    raise UnsafeFile(path, f"{kind_of(mode)}, not a regular file")


def _counts(value: object) -> bool:
    """A JSON list of non-negative integers (no bools, no floats)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def shown(value: object, width: int = 80) -> str:
    """A value from a user's file for a one-line message: its repr (escaped), cut to width."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def save_safetensors(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    """Write tensors (in the given order) as a safetensors file."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        data = tensor_bytes(t)
        header[name] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)
