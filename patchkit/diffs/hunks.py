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

from patchkit.codes import Code
from patchkit.errors import FileProblem, HunkMismatch
from patchkit.fs.safepath import checked_relpath

DEV_NULL = "/dev/null"


class DiffInvalid(FileProblem):
    """A catalogue diff that is no unified diff patchkit applies: ``path`` (the diff) and
    ``detail``; the ``file`` and ``hunk`` it names where it names them."""

    code = Code.CATALOGUE_INVALID


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
    context: tuple[tuple[int, int], ...] = ()  # (index in old, index in new) of context lines

    def reversed(self) -> Hunk:
        return replace(
            self,
            source_start=self.target_start,
            target_start=self.source_start,
            old=self.new,
            new=self.old,
            old_ends_without_newline=self.new_ends_without_newline,
            new_ends_without_newline=self.old_ends_without_newline,
            context=tuple((n, o) for o, n in self.context),
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
        raise DiffInvalid(origin, f"malformed unified diff: {exc}") from None
    if not patch_set:
        raise DiffInvalid(origin, "no file changes found in the diff")
    files = []
    for patched in patch_set:
        creates = patched.source_file == DEV_NULL
        deletes = patched.target_file == DEV_NULL
        name = patched.source_file if deletes else patched.target_file
        path = _strip_prefix(name, origin)
        hunks = tuple(_convert_hunk(i, h) for i, h in enumerate(patched, start=1))
        if not hunks:
            raise DiffInvalid(origin, f"{path}: no hunks (binary or empty diff?)", file=path)
        for hunk in hunks:
            if not hunk.old and not creates:
                raise DiffInvalid(
                    origin,
                    f"{path}: hunk #{hunk.index} ({hunk.header}) has no "
                    "context lines, so its place cannot be checked; regenerate "
                    "the diff with context (diff -u)",
                    file=path,
                    hunk=hunk.index,
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
        raise DiffInvalid(origin, f"path {name!r} is not of the form a/vllm/... or b/vllm/...")
    return checked_relpath("/".join(parts[1:]), f"{origin}: {name}")


def _convert_hunk(index: int, hunk: unidiff.Hunk) -> Hunk:
    old: list[str] = []
    new: list[str] = []
    context: list[tuple[int, int]] = []
    old_no_eol = new_no_eol = False
    previous = None
    for line in hunk:
        value = line.value[:-1] if line.value.endswith("\n") else line.value
        if line.line_type == LINE_TYPE_NO_NEWLINE:
            old_no_eol |= previous in (" ", "-")
            new_no_eol |= previous in (" ", "+")
            continue
        if line.line_type == " ":
            context.append((len(old), len(new)))
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
        context=tuple(context),
    )


@dataclass
class _Text:
    """A file split into lines without endings, each line's own ending kept.

    Why per line: a file that mixes ``\r\n`` and ``\n`` must come back with
    the bytes of every line a hunk does not touch; lines a hunk adds take the
    file's style (``\r\n`` when any line has it, as diffs carry ``\n``).
    """

    lines: list[str]
    crlf: list[bool]  # line i ended in \r\n (not \n); the last line without newline: False
    eol: str
    final_newline: bool

    @classmethod
    def parse(cls, text: str) -> _Text:
        eol = "\r\n" if "\r\n" in text else "\n"
        body = text.split("\n")
        final_newline = body[-1] == ""
        if final_newline:
            body.pop()
        ended = len(body) if final_newline else len(body) - 1  # lines followed by \n
        crlf = [i < ended and line.endswith("\r") for i, line in enumerate(body)]
        lines = [line[:-1] if cr else line for line, cr in zip(body, crlf, strict=True)]
        return cls(lines, crlf, eol, final_newline)

    def replace(self, start: int, end: int, hunk: Hunk) -> None:
        """Lines [start, end) become the hunk's new lines: its context lines keep their
        own endings, the lines it adds take the file's style."""
        endings = [self.eol == "\r\n"] * len(hunk.new)
        for in_old, in_new in hunk.context:
            endings[in_new] = self.crlf[start + in_old]
        self.lines[start:end] = hunk.new
        self.crlf[start:end] = endings

    def render(self) -> str:
        if not self.lines:
            return ""
        endings = ["\r\n" if cr else "\n" for cr in self.crlf]
        parts = [line + ending for line, ending in zip(self.lines, endings, strict=True)]
        if not self.final_newline:
            parts[-1] = self.lines[-1]
        return "".join(parts)


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
        lines = list(first.new)
        new = _Text(lines, [False] * len(lines), "\n", not first.new_ends_without_newline)
        return new.render(), [Placement(path, 1, 1, 0)]
    if text is None:
        raise HunkMismatch(path, 1, first.header, "expects the file, but it is missing")
    parsed = _Text.parse(text)
    placements = []
    lower = 0  # hunks apply in order and must not overlap
    shift = 0  # lines added minus removed by the hunks applied so far
    for hunk in file_patch.hunks:
        # where the code moved to: the offset the hunk before was found at, as GNU patch
        # carries it (a hunk with a plain context such as a closing bracket is sought
        # beside its neighbour, not at the line numbers of the release the diff was made on)
        drift = placements[-1].offset if placements else 0
        expected = max(hunk.source_start - 1, 0) + shift
        found = _locate(parsed.lines, hunk.old, expected + drift, lower)
        if found is None:
            near = max(hunk.source_start - 1, 0) + drift
            why = _why_no_match(_Text.parse(text).lines, hunk, near)
            raise HunkMismatch(path, hunk.index, hunk.header, why)
        _check_end_of_file(parsed, hunk, found, path)
        end = found + len(hunk.old)
        if end == len(parsed.lines):
            parsed.final_newline = not hunk.new_ends_without_newline
        parsed.replace(found, end, hunk)
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


def _why_no_match(lines: list[str], hunk: Hunk, near: int) -> str:
    """Describe the first differing line at the closest near-match of the hunk.

    ``lines`` is the file before any hunk was applied, so the line numbers are
    the file's own; ``near`` is where the hunk should be, counting the offset
    the hunk before it was found at (code moves in blocks between releases).
    """
    start = _closest(lines, hunk.old, near)
    for i, want in enumerate(hunk.old):
        line_no = start + i
        have = lines[line_no] if line_no < len(lines) else None
        if have != want:
            got = "end of file" if have is None else repr(_clip(have))
            return (
                f"does not match anywhere in the file; closest at line {start + 1}, "
                f"where line {line_no + 1} should be {_clip(want)!r} but is {got}"
            )
    return "does not match anywhere in the file (it overlaps the hunk before it)"


SLACK = 8  # lines inserted or removed inside a hunk that a near-match still spans
CANDIDATES = 32  # places the alignment scores, the best by the cheap count first


def _closest(lines: list[str], old: tuple[str, ...], near: int) -> int:
    """The line where the hunk most nearly sits: where its lines line up best.

    A line weighs 1/(how often it occurs in the file), so ``)`` or a blank
    line hardly counts and a distinctive line does. Each occurrence of a hunk
    line proposes a start (its position less its index in the hunk); the
    best-voted starts are scored by a weighted alignment that lets a few
    lines be inserted or removed between the hunk's lines (one line added
    between two context lines must not send the match elsewhere). Ties go
    to the start nearest ``near``. The start is where the alignment's first
    matched line says the hunk begins.
    """
    wanted = set(old)
    positions: dict[str, list[int]] = {line: [] for line in wanted}
    for index, line in enumerate(lines):
        if line in wanted:
            positions[line].append(index)
    weight = {line: 1 / len(found) for line, found in positions.items() if found}
    votes: dict[int, float] = {}
    for offset, line in enumerate(old):
        for index in positions[line]:
            votes[index - offset] = votes.get(index - offset, 0.0) + weight[line]
    if not votes:
        return min(max(near, 0), max(len(lines) - len(old), 0))
    ranked = sorted(votes, key=lambda s: (-votes[s], abs(s - near)))[:CANDIDATES]
    scored = [_aligned(lines, old, s, weight) for s in ranked]
    best = max(scored, key=lambda found: (round(found[0], 9), -abs(found[1] - near)))
    return best[1]


def _aligned(
    lines: list[str], old: tuple[str, ...], start: int, weight: dict[str, float]
) -> tuple[float, int]:
    """(weight of the best in-order alignment of ``old`` around ``start``, where it begins).

    A weighted longest common subsequence of the hunk and the file's lines
    from SLACK before ``start`` to SLACK past the hunk's end.
    """
    low = max(start - SLACK, 0)
    window = lines[low : start + len(old) + SLACK]
    rows, cols = len(old), len(window)
    score = [[0.0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(rows - 1, -1, -1):
        for j in range(cols - 1, -1, -1):
            best = max(score[i + 1][j], score[i][j + 1])
            if old[i] == window[j]:
                best = max(best, weight[old[i]] + score[i + 1][j + 1])
            score[i][j] = best
    i = j = 0
    while i < rows and j < cols:
        if old[i] == window[j] and score[i][j] == weight[old[i]] + score[i + 1][j + 1]:
            return score[0][0], max(low + j - i, 0)  # the first match, less its place in the hunk
        if score[i + 1][j] >= score[i][j + 1]:
            i += 1
        else:
            j += 1
    return score[0][0], start


def _clip(line: str, width: int = 60) -> str:
    line = line.strip()
    return line if len(line) <= width else line[: width - 3] + "..."
