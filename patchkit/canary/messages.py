"""One message of the canary: its code, its words, and the facts the words were made from.

Text output prints the words; ``--json`` writes the object (the JSON
contract's message: ``{"code", "message", ...facts}``), so a script reads
the code and the facts, never the words.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from patchkit.codes import Code


@dataclass(frozen=True)
class Message:
    code: Code
    message: str
    facts: dict = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return self.message

    def json(self) -> dict:
        return {"code": self.code.value, "message": self.message, **self.facts}


def say(code: Code, message: str, **facts) -> Message:
    return Message(code, message, facts)
