"""The server's JSON, read field by field with the type each field must have.

Everything the canary reads comes from a server that may be hostile or
broken: an `id` that is a list, a `usage` that is a list, a log-probability
that is a string, JSON nested a million deep. Each read here either returns
the value with its type or raises `WrongShape` with one line naming the field
(`choices[0].logprobs.token_logprobs[3] is a str, not a number`), which the
canary turns into a finding; and every text that came from the server goes
through `one_line` before it is printed.
"""

from __future__ import annotations

import json

from patchkit.terminal import printable

SERVER_TEXT = 200  # characters of the server's own text in a line (an error message, a name)
LINE = 280  # one printed line: with "patchkit: error: " it stays within 300 characters


class WrongShape(Exception):
    """A field the canary reads has the wrong type; str() is one line naming it."""


def one_line(text: str, limit: int = SERVER_TEXT) -> str:
    """``text`` with control characters escaped (a newline, ESC, a bidi mark: as Python
    writes them in a literal) and cut to ``limit`` characters, marked with an ellipsis."""
    head = text[: limit * 2]  # escaping only lengthens: no need to look further
    escaped = printable(head)
    if len(escaped) > limit:
        return escaped[: limit - 1] + "…"
    return escaped


def parse(body: str) -> object:
    """JSON, or None when the body is not JSON (nested too deeply, or not JSON at all).

    The body is already bounded (MAX_BODY); depth is not, and json.loads
    recurses. NaN and Infinity literals are accepted: some proxies write
    them, and the canary judges them as values.
    """
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _wrong(where: str, value: object, wanted: str) -> WrongShape:
    return WrongShape(f"{where} is {type_name(value)}, not {wanted}")


def _typed(value: object, where: str, optional: bool, kind: type, wanted: str):
    """``value`` when it is a ``kind`` (or None and ``optional``); else WrongShape at ``where``."""
    if value is None and optional:
        return None
    if not isinstance(value, kind):
        raise _wrong(where, value, wanted)
    return value


def obj(value: object, where: str, optional: bool = False) -> dict | None:
    return _typed(value, where, optional, dict, "an object")


def text(value: object, where: str, optional: bool = False) -> str | None:
    return _typed(value, where, optional, str, "a string")


def count(value: object, where: str, optional: bool = False) -> int | None:
    """A non-negative integer (a bool is no count, though Python calls it an int)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(where, value, "a non-negative integer")
    if value < 0:
        raise WrongShape(f"{where} is negative ({value})")
    return value


def items(value: object, where: str, optional: bool = False) -> list | None:
    return _typed(value, where, optional, list, "a list")


def counts(value: object, where: str, optional: bool = False) -> list[int] | None:
    """A list of non-negative integers (token ids)."""
    found = items(value, where, optional)
    if found is not None:
        for index, item in enumerate(found):
            count(item, f"{where}[{index}]")
    return found


def texts(value: object, where: str, optional: bool = False) -> list[str] | None:
    found = items(value, where, optional)
    if found is not None:
        for index, item in enumerate(found):
            text(item, f"{where}[{index}]")
    return found


def numbers(value: object, where: str) -> list[float | None]:
    """A list whose entries are numbers or null (vLLM writes null where a step has none)."""
    found = items(value, where)
    for index, item in enumerate(found):
        if item is not None and (isinstance(item, bool) or not isinstance(item, int | float)):
            raise _wrong(f"{where}[{index}]", item, "a number")
    return found
