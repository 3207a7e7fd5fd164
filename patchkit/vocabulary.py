"""The words patchkit uses for states and actions, one set for every command and for JSON.

A patch has one state (what ``status`` says); a run of ``apply`` or
``revert`` reports the state each patch is in afterwards and what the run
did to it. The same words appear in text, in JSON and in doctor.
"""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """A string enum (Python 3.10 has no StrEnum): compares and prints as its value."""

    def __str__(self) -> str:
        return self.value


class PatchState(Word):
    """What a patch is on a tree."""

    NEEDED = "needed"  # the pristine text it expects is there: apply will patch it
    APPLIED = "applied"  # patchkit's patched text is there
    UPSTREAM = "upstream"  # this release already has the fix
    NOT_APPLICABLE = "not-applicable"  # the release's design makes it meaningless
    CONFLICT = "conflict"  # neither pristine nor patched
    # on a release the catalogue has not tested: a hunk does not fit a file that is the
    # wheel's own (its RECORD hash), or the release no longer ships the file
    CHANGED_UPSTREAM = "changed-upstream"
    OPT_IN = "opt-in"  # an opt-in patch (a diagnostic) not applied: only --only ID applies it


class Action(Word):
    """What one run did to a patch."""

    APPLIED = "applied"
    REVERTED = "reverted"
    WOULD_APPLY = "would-apply"  # --dry-run
    NONE = "none"  # the run left it as it was


class FileFinding(Word):
    """What one file's chain of records finds on disk."""

    APPLIED = "applied"  # the top record's bytes are there
    STALE = "stale"  # back to before the stack, or the installed release's own file
    EDITED = "edited"  # something else, on the release the records were made on
    FOREIGN = "foreign"  # another release's RECORD, and not its file either


class Verdict(Word):
    """Doctor's judgement of one bug on this machine."""

    EXPOSED = "exposed"
    PROTECTED = "protected"
    NOT_AFFECTED = "not-affected"
    UNKNOWN = "unknown"
