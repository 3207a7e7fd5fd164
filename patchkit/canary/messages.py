"""The canary's messages: reasons (patchkit.codes.Reason) that carry their words.

The canary's codes are among the command line's TEXT codes (patchkit/cli/words.py):
a message's words are made here, where the facts are at hand, as the ``text``
fact; text output prints them, ``--json`` writes the message object (its code,
the words as ``message``, the other facts beside them).
"""

from __future__ import annotations

from patchkit.codes import Code, Reason


def say(code: Code, text: str, **facts) -> Reason:
    """A message: its code, its words and the facts they were made from."""
    return Reason.of(code, text=text, **facts)


def words(reason: Reason) -> str:
    return reason["text"]
