"""Reading settings files and writing patchkit's own cache, without hanging or half-writing.

(Files of a vLLM tree go through :class:`patchkit.fs.safepath.Root` instead.)
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import tempfile
from pathlib import Path

from patchkit.fs.safepath import kind_of

MAX_SETTINGS_BYTES = 1 << 20
# Objects and arrays nested deeper than this in a model's or adapter's JSON are
# refused: real ones nest 2-5 deep, and code that walks them stays far from
# Python's recursion limit.
MAX_USER_JSON_DEPTH = 64
# Integers outside what safetensors and PyTorch store (int64, and u64 offsets).
_INT_RANGE = (-(1 << 63), 1 << 64)
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_json_file(path: Path, limit: int = MAX_SETTINGS_BYTES, *, user: bool = False) -> object:
    """A JSON file; ValueError unless it is a regular file of at most ``limit`` bytes
    (read as :func:`read_regular` reads it). OSError when absent.

    A settings file or one of patchkit's own (the default) is never read
    through a symbolic link. ``user`` is for a model's or adapter's file: a
    link is followed (a Hugging Face cache snapshot is all links into
    ``blobs/``), what it reaches is checked all the same, and the content must
    pass :func:`decode_user_json` (every number usable, nesting bounded).
    """
    try:
        raw = read_regular(path, limit, follow=user)
    except IsADirectoryError:
        raise ValueError(f"{kind_of(stat.S_IFDIR)}, not a regular file") from None
    decode = decode_user_json if user else decode_json
    return decode(raw, limit)


def read_user_json(path: Path, limit: int = MAX_SETTINGS_BYTES) -> object:
    """:func:`read_json_file` with ``user=True``, by the name verify/ calls it."""
    return read_json_file(path, limit, user=True)


def open_regular(path: Path | str, limit: int, *, follow: bool = True) -> int:
    """A descriptor of ``path``, a regular file of at most ``limit`` bytes.

    The file is looked at before it is opened (a device is never opened),
    opened with O_NONBLOCK (a FIFO swapped in since the look does not block)
    and looked at again on the descriptor (the same inode, still regular, still
    within ``limit``). ``follow`` False: never through a symbolic link.
    ValueError when it is anything else; OSError when it cannot be looked at
    (FileNotFoundError when absent, IsADirectoryError for a directory).
    """
    info = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    _check_regular(info, limit)
    nofollow = 0 if follow else os.O_NOFOLLOW
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow | os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != (info.st_dev, info.st_ino):
            raise ValueError("replaced while it was opened")
        _check_regular(found, limit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path | str, limit: int, *, follow: bool = True) -> bytes:
    """The bytes of ``path`` as :func:`open_regular` admits it; never more than ``limit``."""
    with os.fdopen(open_regular(path, limit, follow=follow), "rb") as handle:
        raw = handle.read(limit + 1)
    if len(raw) > limit:  # grew since it was looked at
        raise ValueError(f"larger than the {limit} bytes allowed")
    return raw


def _check_regular(info: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{kind_of(info.st_mode)}, not a regular file")
    if info.st_size > limit:
        raise ValueError(f"{info.st_size} bytes, larger than the {limit} bytes allowed")


def decode_json(raw: bytes, limit: int) -> object:
    """JSON from bytes; ValueError (never RecursionError) for anything too big, deep or odd."""
    if len(raw) > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None


def decode_user_json(raw: bytes, limit: int) -> object:
    """JSON from bytes as :func:`decode_json` reads it, every number usable, nesting bounded.

    ``1e400`` reads as inf and NaN/Infinity are accepted by Python's json: both
    are refused here, as are integers beyond 64 bits (a rank of 10**400 raised
    OverflowError in the scale) and nesting deeper than
    :data:`MAX_USER_JSON_DEPTH`. The ValueError is one line and names the key,
    e.g. ``rank_pattern["q_proj"]``, or the line and column of bad syntax.
    """
    if len(raw) > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_bounded_int)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_USER_JSON_DEPTH}") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    problem = _unusable(data)
    if problem is not None:
        raise ValueError(problem)
    return data


class _LongInteger(int):
    """An integer written with more digits than any in range: kept as its digit count, so
    the key can be named (Python's int() refuses 4,300 digits, with no key)."""


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    return _LongInteger(digits) if digits > 20 else int(text)


def _unusable(data: object) -> str | None:
    """The first key (in file order) whose value is too deep or a number out of range.

    A depth-first walk holding one iterator per open container: memory is the
    nesting depth, not the element count (a list of a million numbers nested
    sixty deep once cost gigabytes as one key path string per element), and a
    key path is spelt only for a container entered or a value refused.
    """
    if not isinstance(data, (dict, list)):
        return _bad_number(data, "the value")
    stack = [(_children(data), "", 1)]
    while stack:
        children, where, depth = stack[-1]
        item = next(children, None)
        if item is None:
            stack.pop()
            continue
        key, value = item
        if isinstance(value, (dict, list)):
            path = _key_path(where, key)
            if depth + 1 > MAX_USER_JSON_DEPTH:
                return f"{path}: nested deeper than {MAX_USER_JSON_DEPTH}"
            stack.append((_children(value), path, depth + 1))
        elif type(value) in (float, int, _LongInteger):
            problem = _bad_number(value, None)
            if problem is not None:
                return f"{_key_path(where, key)} {problem}"
    return None


def _children(value: dict | list):
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def _bad_number(value: object, where: str | None) -> str | None:
    """What is wrong with a number (prefixed by ``where`` when given), or None."""
    if type(value) is float and not math.isfinite(value):
        problem = f"is {value}, not a finite number"
    elif type(value) is _LongInteger:
        problem = f"is an integer of {int(value)} digits, out of range"
    elif type(value) is int and not _INT_RANGE[0] <= value < _INT_RANGE[1]:
        problem = f"is {value}, an integer out of range"
    else:
        return None
    return f"{where} {problem}" if where else problem


def _key_path(where: str, key: str | int) -> str:
    """rank_pattern["q_proj"], text_config.rope_scaling, architectures[0]; long keys cut."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    if _PLAIN_KEY.fullmatch(key) and len(key) <= 64:
        return f"{where}.{key}" if where else key
    shown = json.dumps(key if len(key) <= 64 else key[:61] + "...")
    return f"{where}[{shown}]"


def write_cache_file(path: Path, data: bytes) -> None:
    """Write a file of patchkit's own cache atomically (a unique temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
