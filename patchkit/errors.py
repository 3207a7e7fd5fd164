"""User-facing errors.

Every failure a user can cause (bad input, drifted files, a busy lock) is a
PatchkitError: the CLI prints its message as one line and exits 1, with no
traceback. The message says what happened, why, and the next command.
"""


class PatchkitError(Exception):
    """A failure the user can act on; printed as one line, exit status 1."""


class HunkMismatch(PatchkitError):
    """A hunk's expected lines are not in the file (zero fuzz)."""

    def __init__(self, path: str, hunk_index: int, header: str, detail: str):
        self.path = path
        self.hunk_index = hunk_index
        self.header = header
        self.detail = detail
        super().__init__(f"{path}: hunk #{hunk_index} ({header}) {detail}")
