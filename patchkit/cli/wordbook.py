"""A table of codes and the functions that make their words, and the decorator that
fills it: :mod:`patchkit.cli.words` keeps one, and so does each words module it takes
in (doctor's, the model runner's), so a module nests its own reasons without importing
words.py back."""

from __future__ import annotations

from collections.abc import Callable

from patchkit.codes import Code, Reason

Words = Callable[[Reason, str], str]


def registrar(table: dict[Code, Words]):
    """The decorator ``words(*codes)`` that registers a function in ``table``."""

    def words(*codes: Code):
        """Register the function that makes the words of ``codes``."""

        def register(make: Callable) -> Callable:
            for code in codes:
                table[code] = make
            return make

        return register

    return words
