"""Parse unified diffs and apply them to text with zero fuzz.

unidiff does the parsing; applying is ours, so that the rules are exactly the
ones patchkit promises:

* every context and removed line must match exactly (no fuzz);
* a hunk may sit at an offset from its stated line, since code moves between
  vLLM releases; the nearest exact match wins and the offset is reported;
* CRLF diffs parse, CRLF files match line by line and keep their endings;
* files can be created (``--- /dev/null``) and deleted (``+++ /dev/null``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import PurePosixPath

import unidiff
from unidiff.constants import LINE_TYPE_NO_NEWLINE

from patchkit.engine.safepath import checked_relpath
from patchkit.errors import HunkMismatch, PatchkitError

DEV_NULL = "/dev/null"


@dataclass(frozen=True)
class Hunk:
    """One hunk: the lines it expects (old) and the lines it leaves (new)."""

    index: int  # 1-based position within its file's hunks
    header: str  # "@@ -250,7 +250,9 @@", for messages
    source_start: int  # 1-based line where ``old`` starts in the original
    target_start: int
    old: tuple[str, ...]
    new: tuple[str, ...]
    old_ends_without_newline: bool = False
    new_ends_without_newline: bool = False

    def reversed(self) -> Hunk:
        return replace(
            self,
            source_start=self.target_start,
            target_start=self.source_start,
            old=self.new,
            new=self.old,
            old_ends_without_newline=self.new_ends_without_newline,
            new_ends_without_newline=self.old_ends_without_newline,
        )


@dataclass(frozen=True)
class FilePatch:
    """The hunks for one file; ``path`` is relative to the dir holding vllm/."""

    path: str
    hunks: tuple[Hunk, ...]
    creates: bool = False
    deletes: bool = False

    @property
    def kind(self) -> str:
        """creates, deletes or changes: what applying it does to the file."""
        return "creates" if self.creates else "deletes" if self.deletes else "changes"

    def reversed(self) -> FilePatch:
        return FilePatch(
            path=self.path,
            hunks=tuple(h.reversed() for h in self.hunks),
            creates=self.deletes,
            deletes=self.creates,
        )


@dataclass(frozen=True)
class Placement:
    """Where a hunk applied: its 1-based line and the offset from its header."""

    path: str
    hunk: int
    line: int
    offset: int


def parse_diff(text: str, origin: str) -> list[FilePatch]:
    """Parse a -p1 unified diff (``a/vllm/...``) into FilePatches.

    ``origin`` names the diff file in error messages.
    """
    text = text.replace("\r\n", "\n")
    try:
        patch_set = unidiff.PatchSet(text)
    except unidiff.UnidiffParseError as exc:
        raise PatchkitError(f"{origin}: malformed unified diff: {exc}") from None
    if not patch_set:
        raise PatchkitError(f"{origin}: no file changes found in the diff")
    files = []
    for patched in patch_set:
        creates = patched.source_file == DEV_NULL
        deletes = patched.target_file == DEV_NULL
        name = patched.source_file if deletes else patched.target_file
        path = _strip_prefix(name, origin)
        hunks = tuple(_convert_hunk(i, h) for i, h in enumerate(patched, start=1))
        if not hunks:
            raise PatchkitError(f"{origin}: {path}: no hunks (binary or empty diff?)")
        for hunk in hunks:
            if not hunk.old and not creates:
                raise PatchkitError(
                    f"{origin}: {path}: hunk #{hunk.index} ({hunk.header}) has no "
                    "context lines, so its place cannot be checked; regenerate "
                    "the diff with context (diff -u)"
                )
        files.append(FilePatch(path, hunks, creates=creates, deletes=deletes))
    return files


def created_file_patch(path: str, text: str) -> FilePatch:
    """The new-file hunk of a file a patch adds, made from the file's text."""
    lines = text.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    hunk = Hunk(
        index=1,
        header=f"@@ -0,0 +1,{len(lines)} @@",
        source_start=0,
        target_start=1,
        old=(),
        new=tuple(lines),
        new_ends_without_newline=not ends_with_newline,
    )
    return FilePatch(path, (hunk,), creates=True)


def _strip_prefix(name: str, origin: str) -> str:
    """Strip the a/ or b/ prefix (-p1) and refuse paths that leave the tree."""
    parts = PurePosixPath(name).parts
    if len(parts) < 2 or parts[0] not in ("a", "b"):
        raise PatchkitError(f"{origin}: path {name!r} is not of the form a/vllm/... or b/vllm/...")
    return checked_relpath("/".join(parts[1:]), f"{origin}: {name}")


def _convert_hunk(index: int, hunk: unidiff.Hunk) -> Hunk:
    old: list[str] = []
    new: list[str] = []
    old_no_eol = new_no_eol = False
    previous = None
    for line in hunk:
        value = line.value[:-1] if line.value.endswith("\n") else line.value
        if line.line_type == LINE_TYPE_NO_NEWLINE:
            old_no_eol |= previous in (" ", "-")
            new_no_eol |= previous in (" ", "+")
            continue
        if line.line_type in (" ", "-"):
            old.append(value)
        if line.line_type in (" ", "+"):
            new.append(value)
        previous = line.line_type
    header = (
        f"@@ -{hunk.source_start},{hunk.source_length} +{hunk.target_start},{hunk.target_length} @@"
    )
    return Hunk(
        index=index,
        header=header,
        source_start=hunk.source_start,
        target_start=hunk.target_start,
        old=tuple(old),
        new=tuple(new),
        old_ends_without_newline=old_no_eol,
        new_ends_without_newline=new_no_eol,
    )


@dataclass
class _Text:
    """A file split into lines without endings, with its ending style."""

    lines: list[str]
    eol: str
    final_newline: bool

    @classmethod
    def parse(cls, text: str) -> _Text:
        eol = "\r\n" if "\r\n" in text else "\n"
        body = text.split("\n")
        final_newline = body[-1] == ""
        if final_newline:
            body.pop()
        lines = [line[:-1] if line.endswith("\r") else line for line in body]
        return cls(lines, eol, final_newline)

    def render(self) -> str:
        if not self.lines:
            return ""
        text = self.eol.join(self.lines)
        return text + self.eol if self.final_newline else text


def apply_file_patch(text: str | None, file_patch: FilePatch) -> tuple[str | None, list[Placement]]:
    """Apply one file's hunks to ``text`` (None: the file does not exist).

    Returns the new text (None: the file is deleted) and where each hunk
    applied. Raises HunkMismatch naming the first hunk that does not match.
    """
    path = file_patch.path
    first = file_patch.hunks[0]
    if file_patch.creates:
        if text is not None:
            raise HunkMismatch(path, 1, first.header, "creates the file, but it exists")
        new = _Text(list(first.new), "\n", not first.new_ends_without_newline)
        return new.render(), [Placement(path, 1, 1, 0)]
    if text is None:
        raise HunkMismatch(path, 1, first.header, "expects the file, but it is missing")
    parsed = _Text.parse(text)
    placements = []
    lower = 0  # hunks apply in order and must not overlap
    shift = 0  # lines added minus removed by the hunks applied so far
    for hunk in file_patch.hunks:
        expected = max(hunk.source_start - 1, 0) + shift
        found = _locate(parsed.lines, hunk.old, expected, lower)
        if found is None:
            raise HunkMismatch(
                path, hunk.index, hunk.header, _why_no_match(parsed, hunk, expected, shift)
            )
        _check_end_of_file(parsed, hunk, found, path)
        end = found + len(hunk.old)
        if end == len(parsed.lines):
            parsed.final_newline = not hunk.new_ends_without_newline
        parsed.lines[found:end] = hunk.new
        placements.append(Placement(path, hunk.index, found + 1, found - expected))
        lower = found + len(hunk.new)
        shift += len(hunk.new) - len(hunk.old)
    if file_patch.deletes:
        if parsed.lines:
            raise HunkMismatch(
                path, first.index, first.header, "deletes the file, but lines would remain"
            )
        return None, placements
    return parsed.render(), placements


def _locate(lines: list[str], old: tuple[str, ...], expected: int, lower: int) -> int | None:
    """Nearest index >= lower where ``old`` occurs exactly, searching outward."""
    last = len(lines) - len(old)
    if last < lower:
        return None
    expected = min(max(expected, lower), last)
    span = max(expected - lower, last - expected)
    for distance in range(span + 1):
        for start in (expected - distance, expected + distance):
            if lower <= start <= last and _matches_at(lines, old, start):
                return start
    return None


def _matches_at(lines: list[str], old: tuple[str, ...], start: int) -> bool:
    return lines[start] == old[0] and tuple(lines[start : start + len(old)]) == old


def _check_end_of_file(parsed: _Text, hunk: Hunk, found: int, path: str) -> None:
    at_end = found + len(hunk.old) == len(parsed.lines)
    if hunk.old_ends_without_newline and not (at_end and not parsed.final_newline):
        raise HunkMismatch(
            path, hunk.index, hunk.header, "expects the file to end without a newline here"
        )


def _why_no_match(parsed: _Text, hunk: Hunk, expected: int, shift: int) -> str:
    """Describe the first differing line at the closest near-match of the hunk.

    Line numbers are the original file's (``shift``: lines added by earlier hunks).
    """
    best, best_score = expected, -1
    for start in range(max(len(parsed.lines) - len(hunk.old) + 1, 1)):
        score = sum(
            1 for i, want in enumerate(hunk.old) if start + i < len(parsed.lines)
            and parsed.lines[start + i] == want
        )  # fmt: skip
        if score > best_score or (
            score == best_score and abs(start - expected) < abs(best - expected)
        ):
            best, best_score = start, score
    for i, want in enumerate(hunk.old):
        line_no = best + i
        have = parsed.lines[line_no] if line_no < len(parsed.lines) else None
        if have != want:
            got = "end of file" if have is None else repr(_clip(have))
            return (
                f"does not match anywhere in the file; closest at line {best + 1 - shift}, "
                f"where line {line_no + 1 - shift} should be {_clip(want)!r} but is {got}"
            )
    return "does not match anywhere in the file (it overlaps the hunk before it)"


def _clip(line: str, width: int = 60) -> str:
    line = line.strip()
    return line if len(line) <= width else line[: width - 3] + "..."
