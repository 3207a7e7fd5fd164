"""User-facing errors: each a kind of failure with its code and its facts.

Every failure a user can cause (bad input, drifted files, a busy lock) is a
PatchkitError: the CLI prints its line and exits 1, with no traceback. The line
says what happened, why, and the next command; it is made where the error is
raised. The error is a value all the same: its class names the kind (``code``, one
of :class:`patchkit.codes.Code`) and it carries the facts the line was made from
(``facts``: a path, a patch, a hunk, a URL; a lower error it quotes, as a fact of
its own), so ``--json`` gives a tool the kind and its fields, not only a sentence
(docs/json.md). The base class is never raised itself, and every kind names its
code (tests/test_errors_are_typed.py).
"""

from __future__ import annotations

import os
from typing import ClassVar

from patchkit.codes import Code, Line, Reason


class PatchkitError(Exception):
    """A failure the user can act on; printed as one line, exit status 1 (``exit_code``).

    ``line`` is the sentence as the raise site makes it; ``facts`` are JSON's kinds of
    value, a path (kept as text), a reason, or a lower PatchkitError (kept as its reason).
    """

    code: ClassVar[Code]  # the kind's: each subclass names its own
    exit_code = 1

    def __init__(self, line: str, /, **facts: object):
        super().__init__(line)
        self.facts = {name: fact(value) for name, value in facts.items()}

    @property
    def reason(self) -> Reason:
        """The error as a message: its code, its facts, and its line as its words."""
        return Line.of(self.code, text=str(self), **self.facts)

    def reworded(self, line: str, **facts: object) -> PatchkitError:
        """This error (its kind, its facts, and ``facts``) said with ``line``: the words a
        caller puts around it, as ``--model: `` before a model file's problem."""
        other = type(self).__new__(type(self), line)
        other.__dict__.update(self.__dict__)
        other.args = (line,)
        other.facts = {**self.facts, **{name: fact(value) for name, value in facts.items()}}
        return other


def fact(value: object) -> object:
    """A fact as a message holds it: JSON's kinds of value as they are, a lower error as
    its reason, a list as a tuple, anything else (a path, a version) as its text: an
    error's document must never fail to print for a fact JSON cannot hold."""
    if value is None or isinstance(value, (str, int, float, Reason)):
        return value
    if isinstance(value, PatchkitError):
        return value.reason
    if isinstance(value, (list, tuple)):
        return tuple(fact(v) for v in value)
    if isinstance(value, dict):
        return {str(k): fact(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return os.fsdecode(value)
    return str(value)


class Refused(PatchkitError):
    """A refusal made below the command line, as data: its :class:`patchkit.codes.Reason`.

    The words are the command line's (:mod:`patchkit.cli.words`), made when it prints
    the error; ``str()`` gives the code and facts, for a log or a debugger.
    """

    def __init__(self, reason: Reason):
        super().__init__(str(reason))
        self._reason = reason

    @property
    def code(self) -> Code:  # type: ignore[override]  # the reason's
        return self._reason.code

    @property
    def reason(self) -> Reason:
        return self._reason


class FileProblem(PatchkitError):
    """What is wrong with one file: ``path`` and ``detail`` apart, so a report that names
    the file already (a finding's file column) says the detail alone. Itself, a file of
    an adapter's or a model's directory that patchkit cannot use; a kind of file of its
    own (a catalogue file, vLLM's dist-info, a safetensors file) is a subclass."""

    code = Code.FILE_UNUSABLE

    def __init__(self, path, detail: str, **facts: object):
        super().__init__(f"{path}: {detail}", path=path, detail=detail, **facts)
        self.path = path
        self.detail = detail


class UnsafeFile(FileProblem):
    """A file of the user's directory that patchkit does not read: a link out of the
    directory (or to a link), or no regular file (a FIFO would hang the read)."""

    code = Code.UNSAFE_PATH


class OversizedFile(FileProblem):
    """A file of the user's directory larger than its reader's bound (``limit``, bytes)."""

    code = Code.FILE_TOO_LARGE


class UsageProblem(PatchkitError):
    """A bad option value found where it is used: one line, exit status 2 like click's."""

    code = Code.USAGE
    exit_code = 2


class HunkMismatch(PatchkitError):
    """A hunk's expected lines are not in the file (zero fuzz)."""

    code = Code.HUNK_MISMATCH

    def __init__(self, path: str, hunk_index: int, header: str, detail: str):
        super().__init__(
            f"{path}: hunk #{hunk_index} ({header}) {detail}",
            path=path,
            hunk=hunk_index,
            header=header,
            detail=detail,
        )
        self.path = path
        self.hunk_index = hunk_index
        self.header = header
        self.detail = detail


class OsFailure(PatchkitError):
    """An OSError while ``doing`` something, as :func:`os_error_line` words it (or in the
    ``line`` of a caller that says more); its facts are the path, the error's name
    (``errno``: "ENOSPC") and the system's words."""

    code = Code.OS_ERROR

    def __init__(
        self,
        exc: OSError,
        doing: str,
        too_long: str = "--target path",
        path=None,
        line: str | None = None,
    ):
        import errno

        super().__init__(
            line or os_error_line(exc, doing, too_long, path),
            path=exc.filename or path,
            errno=errno.errorcode.get(exc.errno) if exc.errno else None,
            error=exc.strerror or str(exc),
        )


def cause_of(exc: BaseException, doing: str) -> Reason:
    """A lower error as the message a reason quotes in its fact ``cause`` (docs/json.md: a
    fact that is itself a reason is a message): a PatchkitError's own reason, an OSError as
    :class:`OsFailure` words it (``doing``: what it interrupted), anything else its words."""
    if isinstance(exc, PatchkitError):
        return exc.reason
    if isinstance(exc, OSError):
        return OsFailure(exc, doing).reason
    return Line.of(Code.INTERNAL_ERROR, text=f"{type(exc).__name__}: {exc}")


def os_error_line(
    exc: OSError, doing: str, too_long: str = "--target path", path: object = None
) -> str:
    """One line for an OSError while ``doing`` something: what, where, and advice that fits.

    Full disks, over-long paths, read-only file systems and missing
    permissions each get their own next step, instead of one generic hint.
    ``too_long`` names what to shorten when a path is too long (the option
    or variable the path came from). ``path`` names the file when the error
    does not (a read() that fails carries no file name, an open() does).
    """
    import errno

    where = exc.filename or path or "the tree"
    advice = {
        errno.ENOSPC: "no space left on the device; free some space and run the command again",
        errno.EDQUOT: "the disk quota is exhausted; free some space and run the command again",
        errno.ENAMETOOLONG: "the path (or one of its names) is longer than this file system "
        f"allows; use a shorter {too_long}",
        errno.EROFS: "the file system is read-only; patch the image at build time, or remount "
        "it writable",
        errno.EACCES: "permission denied; run patchkit as the user that owns the vLLM install "
        "(root in a Docker image)",
        errno.EPERM: "operation not permitted; run patchkit as the user that owns the vLLM "
        "install (root in a Docker image)",
    }.get(exc.errno, exc.strerror or str(exc))
    return f"{doing} {where} failed: {advice}"
