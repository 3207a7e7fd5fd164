"""The one rule for text on its way to a terminal: control characters escaped.

Text from outside patchkit (a file or directory name, a package index's
answer, a model's config.json, an adapter's name, a probe record, a
server's reply) may hold a control character: ESC starts a terminal
sequence, ``\\r`` overprints the line with what follows, a newline forges a
line of its own, a bidi mark reorders what follows. :func:`printable`
writes each one as Python writes it in a string literal (``\\x1b``,
``\\r``, ``\\n``, ``\\u202e``), so what is shown is what is there.

Every line a command prints goes through it on the way out
(:func:`patchkit.cli.render.out` and :func:`~patchkit.cli.render.warn`), so
no report has to remember to; code that writes to a terminal some other
way (a progress line on stderr) calls it itself. It lives in the lowest
layer so that every layer can.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every character that is not printable (a control character, a
    line or paragraph separator, a bidi or other format mark, a lone surrogate from an
    undecodable file name) written as Python escapes it; printable text, non-ASCII
    letters included, is returned as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
