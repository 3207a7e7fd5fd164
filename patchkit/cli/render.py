"""What every command's output shares: one way to print, wrapping, and the JSON contract.

Each command's rows and JSON live with that command (:mod:`patchkit.cli.commands`); the
words of every reason are :mod:`patchkit.cli.words`'. What they share is here.

One way to print: every line for stdout goes through :func:`out` (a report's
text and its JSON alike), every line for stderr through :func:`warn`, and both
escape control characters (:func:`patchkit.terminal.printable`, the one rule
for text on its way to a terminal): a file name, an index's answer, a model's
config, an adapter's name or a probe record in a line never reaches the
terminal raw, whichever command prints it. A line is one line: a newline in
it is escaped too, so text with several lines (JSON) is given line by line.
Text that must be filtered otherwise (the canary's API key) is filtered on the
way into them, never printed some other way.

Every command's JSON is one document (:func:`emit_json`): ``"format"`` (the contract's
version, :data:`FORMAT`) and ``"command"`` first, and every message an object with its
code (:func:`message`); docs/json.md says the rules, docs/json/ has a schema per command.
No object below the CLI carries a ``to_json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import textwrap

import click

from patchkit.cli.words import its_own_words, say
from patchkit.codes import Code, Reason
from patchkit.terminal import printable

# The JSON contract's version: a key renamed or removed, or a code renamed or removed,
# bumps it (docs/json/CHANGELOG.md); an added key or code does not.
FORMAT = 1

# `from patchkit.cli.render import printable` stays valid: it is patchkit.terminal's


class ReportLost(Exception):
    """stdout could not take a line of the report: a full disk, a reader that left (EPIPE).

    Not an OSError, so that no handler meant for the tree's files takes it for one:
    the CLI decides what it means from what the command had done by then.
    """

    def __init__(self, cause: OSError):
        self.cause = cause
        super().__init__(cause.strerror or str(cause))


def out(line: str = "") -> None:
    """Write one line of a report to stdout, escaped (:func:`printable`): every line of
    every report goes through here."""
    try:
        click.echo(printable(line))
    except OSError as exc:
        raise ReportLost(exc) from None


def warn(line: str) -> None:
    """One line on stderr, escaped (:func:`printable`); a stderr that cannot take it
    costs the line, not the command."""
    try:
        click.echo(printable(line), err=True)
    except OSError:
        pass


def out_lines(text: str) -> None:
    """Text of several lines (a JSON document), each line through :func:`out`."""
    for line in text.split("\n"):
        out(line)


def emit_json(command: str, data: dict) -> None:
    """A command's JSON on stdout, in the versioned contract (docs/json.md): first
    ``"format"`` and ``"command"`` (as typed: "adapter check"), then the command's own
    keys. json.dumps escapes every control character inside a string, so its lines pass
    :func:`out` unchanged and the document stays valid JSON."""
    out_lines(json_text(document(command, data)))


def json_text(document: dict) -> str:
    """``document`` as strict JSON: a non-finite float (a distance verify or canary measured
    as inf, a NaN answer) is the string "Infinity", "-Infinity" or "NaN"; Python's own
    bare Infinity and NaN are refused by jq, JavaScript and most other readers."""
    return json.dumps(_finite(document), indent=2, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):  # numpy's floats too
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def document(command: str, data: dict) -> dict:
    """The JSON document of ``command``: the contract's first keys, then ``data``'s."""
    return {"format": FORMAT, "command": command, **data}


def message(reason: Reason | None) -> dict | None:
    """A message in JSON: its code, its words as the text output prints them (escaped,
    :func:`printable`: a reader shows the message, and a path with ESC or a newline in it
    once reached its terminal raw from a warning or a refusal's cause), and the facts the
    words were made from, exact (a nested reason as a message of its own); None stays
    null."""
    if reason is None:
        return None
    facts = {k: _fact(v) for k, v in reason.facts if not (k == "text" and its_own_words(reason))}
    return {"code": str(reason.code), "message": printable(say(reason)), **facts}


def _fact(value):
    if isinstance(value, Reason):
        return message(value)
    if isinstance(value, (tuple, list)):
        return [_fact(v) for v in value]
    if isinstance(value, dict):  # a fact of several parts (canary-failed's models)
        return {k: _fact(v) for k, v in value.items()}
    return value


def messages(reasons) -> list[dict]:
    return [message(r) for r in reasons]


def text_message(code: Code, text: str | None) -> dict | None:
    """A message a command still makes as a line (its code says what kind); '' or None
    is null."""
    return message(Reason.of(code, text=text)) if text else None


def field_values(obj) -> dict:
    """A dataclass's fields as a dict, in their order, values as they are (not walked)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in its number: "1 file", "2 files", "0 files"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


WIDEST = 100  # no text report is wider, on the widest terminal either
NARROWEST = 40  # a terminal narrower than this is wrapped as if it were this wide
COLUMN = 40  # a column narrower than this continues at INDENT instead of under itself
INDENT = 8


def line_width() -> int:
    """The width every text report wraps at (one rule for status, apply, revert and list):
    the terminal's columns (``COLUMNS`` where set), at most 100; 100 where stdout is not a
    terminal (a pipe, a log, a Docker build), so a report reads the same wherever it lands."""
    columns = shutil.get_terminal_size((WIDEST, 24)).columns
    return max(NARROWEST, min(columns, WIDEST))


LAYOUT = re.compile(r"[ \t\n]+")  # the whitespace that wrapping reflows


def wrap(first: str, text: str, under: int | None = None) -> list[str]:
    """``first`` then ``text`` filled to :func:`line_width`, the next lines under column
    ``under`` (default: where ``text`` starts) or at INDENT when that leaves too little room.
    A word (a path, a URL, a command) is never split; one longer than the line stays whole.

    Spaces, tabs and newlines are reflowed; any other control character (``\r``, ESC)
    is escaped first (:func:`printable`), so it is shown, never taken for a space."""
    width = line_width()
    first = printable(first)
    column = len(first) if under is None else under
    if width - column < COLUMN:
        column = INDENT
    lines = textwrap.wrap(
        _commands_whole(" ".join(printable(word) for word in LAYOUT.split(text) if word)),
        width,
        initial_indent=first,
        subsequent_indent=" " * column,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return [line.replace(KEPT_SPACE, " ") for line in lines] or [first.rstrip()]


KEPT_SPACE = "\ue000"  # a private-use character: a space wrapping must not break at
COMMAND = re.compile(r"`[^`]+`")


def _commands_whole(text: str) -> str:
    """``text`` with the spaces inside each `command` made unbreakable, so a command is
    never split over two lines: a user who copies one line of a table copies all of it
    (a reinstall broken after "-m" ran the pip on PATH when pasted). A command longer
    than the line stays whole, as a long word does. ``text`` cannot hold KEPT_SPACE
    itself: :func:`printable` has escaped it, as every private-use character."""
    return COMMAND.sub(lambda found: found.group().replace(" ", KEPT_SPACE), text)


def blocks(text: str) -> list[str]:
    """``text``'s paragraphs and list items, each on one line: a line that starts with "- "
    is an item of its own, an indented line continues the one before, a blank line or an
    unindented line after an item starts a paragraph. A catalogue entry's list (one line
    per release range) then stays a list instead of running into its neighbours."""
    parts: list[str] = []
    fresh = True
    for line in text.split("\n"):  # not splitlines(): a \r or \x1c is escaped, not a break
        words = line.strip()
        if not words:
            fresh = True
            continue
        after_item = bool(parts) and parts[-1].startswith("- ") and not line[0].isspace()
        if fresh or words.startswith("- ") or after_item:
            parts.append(words)
        else:
            parts[-1] += " " + words
        fresh = False
    return parts


def wrap_blocks(first: str, text: str) -> list[str]:
    """:func:`wrap` for text with list items: the first paragraph after ``first``, each
    further paragraph at INDENT, each item at INDENT as "- " with its next lines under
    its text."""
    parts = blocks(text) or [""]
    if parts[0].startswith("- "):
        lines, rest = [first.rstrip()], parts
    else:
        lines, rest = wrap(first, parts[0], INDENT), parts[1:]
    for part in rest:
        if part.startswith("- "):
            lines += wrap(" " * INDENT + "- ", part[2:], INDENT + 2)
        else:
            lines += wrap(" " * INDENT, part, INDENT)
    return lines
