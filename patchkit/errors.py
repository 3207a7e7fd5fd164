"""User-facing errors.

Every failure a user can cause (bad input, drifted files, a busy lock) is a
PatchkitError: the CLI prints its message as one line and exits 1, with no
traceback. The message says what happened, why, and the next command.
"""


class PatchkitError(Exception):
    """A failure the user can act on; printed as one line, exit status 1."""


class Refused(PatchkitError):
    """A refusal made below the command line, as data: its :class:`patchkit.codes.Reason`.

    The words are the command line's (:mod:`patchkit.cli.words`), made when it prints
    the error; ``str()`` gives the code and facts, for a log or a debugger.
    """

    def __init__(self, reason):
        self.reason = reason
        super().__init__(str(reason))


class FileProblem(PatchkitError):
    """What is wrong with one file: ``path`` and ``detail`` apart, so a report that names
    the file already (a finding's file column) says the detail alone."""

    def __init__(self, path, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")


class UsageProblem(PatchkitError):
    """A bad option value found where it is used: one line, exit status 2 like click's."""

    exit_code = 2


class HunkMismatch(PatchkitError):
    """A hunk's expected lines are not in the file (zero fuzz)."""

    def __init__(self, path: str, hunk_index: int, header: str, detail: str):
        self.path = path
        self.hunk_index = hunk_index
        self.header = header
        self.detail = detail
        super().__init__(f"{path}: hunk #{hunk_index} ({header}) {detail}")


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
