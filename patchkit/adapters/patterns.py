"""PEFT's module patterns (rank_pattern / alpha_pattern keys), matched in linear time.

PEFT (``get_pattern_key``, ``src/peft/utils/other.py``) and vLLM 0.32+
(``PEFTHelper._match_pattern``, ``vllm/lora/peft_helper.py`` in the 0.33.0
wheel, where ``re`` is the ``regex`` package: ``import regex as re``) give a
module the value of the first key for which ``re.match(rf"(.*\\.)?({key})$",
name)`` succeeds. Both ``re`` and ``regex`` backtrack: a key such as
``(.|.)*(.|.)*(.|.)*Q`` never finishes against a module name of 40 characters.
:func:`compile_peft_key` builds that same pattern text and parses it here
into a Thompson automaton, which is run over
the name as a set of states (each set's steps cached, as RE2 does): time
proportional to the name's length times the pattern's size, whatever the
pattern. Whether a name matches is all PEFT asks, and that does not depend on
greedy or lazy quantifiers or on the order of alternatives, so the answer is
the one ``re.match`` gives when it ends.

What cannot be decided without backtracking (backreferences, lookarounds,
possessive quantifiers, atomic groups, conditionals), inline flags, word
boundaries and named groups are refused with ValueError, as is what ``re``
itself refuses (``(``, ``*a``, ``[z-a]``), and a pattern of more than
:data:`MAX_STATES` states (counted repeats are unrolled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# States of one compiled pattern; `a{500}` unrolls to 500 of them. PEFT's keys are
# module paths with a `\d+` or an alternation: tens of states. Each step touches at most
# this many, so time and memory per character stay small.
MAX_STATES = 1_000
# Groups nested deeper than this are refused (the parser recurses per group).
MAX_NESTING = 100
# Cached steps of one pattern; past this the cache starts over (memory stays bounded:
# 1024 sets of at most MAX_STATES states).
MAX_CACHED = 1024
# States one pattern may visit over all the names it is asked about (a few seconds of
# Python at most). A hostile key on hostile names stops here with ValueError instead of
# taking minutes: the work is linear, but names and patterns come from the same files.
MAX_WORK = 5_000_000

_SPECIAL = set(".^$*+?{}[]\\|()")
_CATEGORIES = {
    "d": lambda c: c.isdecimal(),
    "w": lambda c: c.isalnum() or c == "_",
    "s": lambda c: c.isspace(),
}
_ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}


@dataclass(frozen=True)
class CharSet:
    """The characters one step accepts: ranges, categories (\\d \\w \\s and negations), negated."""

    ranges: tuple[tuple[int, int], ...] = ()
    categories: tuple[tuple[str, bool], ...] = ()  # (letter, negated)
    negated: bool = False

    def has(self, ch: str) -> bool:
        code = ord(ch)
        found = any(lo <= code <= hi for lo, hi in self.ranges) or any(
            _CATEGORIES[letter](ch) != negated for letter, negated in self.categories
        )
        return found != self.negated


ANY_BUT_NEWLINE = CharSet(ranges=((10, 10),), negated=True)


@dataclass
class _State:
    kind: str  # "char", "split", "assert", "accept"
    chars: CharSet | None = None
    out: list[int] = field(default_factory=list)
    anchor: str = ""  # "start", "end" (\Z), "dollar" ($)


class _Nfa:
    def __init__(self) -> None:
        self.states: list[_State] = []

    def add(self, state: _State) -> int:
        if len(self.states) >= MAX_STATES:
            raise ValueError(f"a pattern of more than {MAX_STATES} states (counted repeats)")
        self.states.append(state)
        return len(self.states) - 1


class _Parser:
    """Python's ``re`` syntax (sre_parse) for the regular subset, into an AST of tuples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def peek(self, n: int = 0) -> str | None:
        i = self.pos + n
        return self.text[i] if i < len(self.text) else None

    def take(self) -> str:
        ch = self.text[self.pos]
        self.pos += 1
        return ch

    def fail(self, what: str) -> ValueError:
        # no position: it would count in PEFT's wrapper, not in the user's key
        return ValueError(what)

    def parse(self):
        tree = self.alternation(0)
        if self.peek() is not None:  # only a ")" stops an alternation early
            raise self.fail("unbalanced parenthesis")
        return tree

    def alternation(self, depth: int):
        if depth > MAX_NESTING:
            raise self.fail(f"groups nested more than {MAX_NESTING} deep")
        branches = [self.sequence(depth)]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence(depth))
        return ("alt", branches) if len(branches) > 1 else branches[0]

    def sequence(self, depth: int):
        items: list = []
        while self.peek() is not None and self.peek() not in "|)":
            if self.quantifier_here():
                raise self.fail("nothing to repeat")
            item = self.atom(depth)
            while self.quantifier_here():
                if item[0] == "assert":
                    raise self.fail("nothing to repeat")
                item = ("repeat", item, *self.quantifier())
                if self.quantifier_here():
                    raise self.fail("multiple repeat")
            items.append(item)
        return ("seq", items)

    def quantifier_here(self) -> bool:
        ch = self.peek()
        return ch in ("*", "+", "?") or (ch == "{" and self._braces() is not None)

    def _braces(self) -> tuple[int, int | None, int] | None:
        """(min, max or None, length) of a {m,n} here, or None where "{" is a literal."""
        text, i = self.text, self.pos + 1
        if i < len(text) and text[i] == "}":
            return None
        j = i
        while j < len(text) and text[j].isascii() and text[j].isdigit():
            j += 1
        lo, hi = text[i:j], None
        if j < len(text) and text[j] == ",":
            k = j + 1
            while k < len(text) and text[k].isascii() and text[k].isdigit():
                k += 1
            hi, j = text[j + 1 : k], k
        else:
            hi = lo
        if j >= len(text) or text[j] != "}":
            return None
        low = int(lo) if lo else 0
        high = int(hi) if hi else None
        return low, high, j + 1 - self.pos

    def quantifier(self) -> tuple[int, int | None]:
        ch = self.peek()
        if ch == "{":
            low, high, length = self._braces()
            self.pos += length
            if high is not None and high < low:
                raise self.fail("min repeat greater than max repeat")
            if max(low, high or 0) > MAX_STATES:
                raise self.fail(f"a repeat count above {MAX_STATES}")
        else:
            self.take()
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if self.peek() == "?":  # lazy: the same strings match
            self.take()
        elif self.peek() == "+":
            raise self.fail("a possessive quantifier (it changes what matches by not backtracking)")
        return low, high

    def atom(self, depth: int):
        ch = self.take()
        if ch == "(":
            if self.peek() == "?":
                if self.text.startswith("?:", self.pos):
                    self.pos += 2
                else:
                    raise self.fail("(?...) other than (?:...) (lookarounds, flags, named groups)")
            inner = self.alternation(depth + 1)
            if self.peek() != ")":
                raise self.fail("missing ), unterminated subpattern")
            self.take()
            return inner
        if ch == ".":
            return ("char", ANY_BUT_NEWLINE)
        if ch == "^":
            return ("assert", "start")
        if ch == "$":
            return ("assert", "dollar")
        if ch == "[":
            return ("char", self.char_class())
        if ch == "\\":
            return self.escape(in_class=False)
        return ("char", _literal(ch))

    def escape(self, in_class: bool):
        ch = self.peek()
        if ch is None:
            raise self.fail("bad escape (end of pattern)")
        self.take()
        if ch.lower() in _CATEGORIES:
            return ("char", CharSet(categories=((ch.lower(), ch.isupper()),)))
        if not in_class and ch in "AZ":
            return ("assert", "start" if ch == "A" else "end")
        if ch in _ESCAPED:
            return ("char", _literal(_ESCAPED[ch]))
        if in_class and ch == "b":
            return ("char", _literal("\b"))
        if ch in "xuU":
            return ("char", _literal(self.hex_digits({"x": 2, "u": 4, "U": 8}[ch])))
        if ch == "0":
            digits = ""
            while len(digits) < 2 and (self.peek() or "x") in "01234567":
                digits += self.take()
            return ("char", _literal(chr(int(digits or "0", 8))))
        if ch.isascii() and ch.isdigit():
            raise self.fail("a backreference or octal escape")
        if ch.isascii() and ch.isalpha():
            raise self.fail(f"bad or unsupported escape \\{ch}")
        return ("char", _literal(ch))

    def hex_digits(self, count: int) -> str:
        digits = self.text[self.pos : self.pos + count]
        if len(digits) != count or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise self.fail("incomplete hexadecimal escape")
        self.pos += count
        code = int(digits, 16)
        if code > 0x10FFFF:
            raise self.fail("bad escape (beyond U+10FFFF)")
        return chr(code)

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        if negated:
            self.take()
        ranges: list[tuple[int, int]] = []
        categories: list[tuple[str, bool]] = []
        first = True
        while True:
            ch = self.peek()
            if ch is None:
                raise self.fail("unterminated character set")
            if ch == "]" and not first:
                self.take()
                break
            first = False
            low = self.class_item()
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                self.take()
                high = self.class_item()
                if isinstance(low, CharSet) or isinstance(high, CharSet):
                    raise self.fail("bad character range")
                if ord(high) < ord(low):
                    raise self.fail("bad character range")
                ranges.append((ord(low), ord(high)))
            elif isinstance(low, CharSet):
                categories.extend(low.categories)
            else:
                ranges.append((ord(low), ord(low)))
        return CharSet(tuple(ranges), tuple(categories), negated)

    def class_item(self) -> str | CharSet:
        ch = self.take()
        if ch != "\\":
            return ch
        _, chars = self.escape(in_class=True)
        if chars.categories:
            return chars
        return chr(chars.ranges[0][0])


def _literal(ch: str) -> CharSet:
    return CharSet(ranges=((ord(ch), ord(ch)),))


def _emit(nfa: _Nfa, node, nxt: int) -> int:
    """The start state of ``node`` followed by state ``nxt`` (built back to front)."""
    kind = node[0]
    if kind == "char":
        return nfa.add(_State("char", chars=node[1], out=[nxt]))
    if kind == "assert":
        return nfa.add(_State("assert", anchor=node[1], out=[nxt]))
    if kind == "seq":
        for item in reversed(node[1]):
            nxt = _emit(nfa, item, nxt)
        return nxt
    if kind == "alt":
        return nfa.add(_State("split", out=[_emit(nfa, b, nxt) for b in node[1]]))
    _, body, low, high = node
    if high is None:  # body{low,}: low copies, then a loop
        loop = nfa.add(_State("split"))
        nfa.states[loop].out = [_emit(nfa, body, loop), nxt]
        nxt = loop
    else:  # body{low,high}: high-low optional copies after low plain ones
        for _ in range(high - low):
            nxt = nfa.add(_State("split", out=[_emit(nfa, body, nxt), nxt]))
    for _ in range(low):
        nxt = _emit(nfa, body, nxt)
    return nxt


class Matcher:
    """One compiled pattern; :meth:`match` is ``re.match(pattern, text) is not None``."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        tree = _Parser(pattern).parse()
        self._nfa = _Nfa()
        self._accept = self._nfa.add(_State("accept"))
        self._start = _emit(self._nfa, tree, self._accept)
        self._closures: dict = {}
        self._steps: dict = {}
        self.work = 0  # states visited so far, by the steps and closures not cached

    def match(self, text: str) -> bool:
        n = len(text)
        dollar_before = n - 1 if text.endswith("\n") else n
        current = self._closure(frozenset((self._start,)), (True, n == 0, dollar_before <= 0))
        for pos, ch in enumerate(text, start=1):
            if self._accept in current:
                return True
            moved = self._step(current, ch)
            if not moved:
                return False
            current = self._closure(moved, (False, pos == n, pos >= dollar_before))
        return self._accept in current

    def _step(self, states: frozenset, ch: str) -> frozenset:
        key = (states, ch)
        found = self._steps.get(key)
        if found is None:
            self._spend(len(states))
            found = frozenset(
                s.out[0]
                for s in (self._nfa.states[i] for i in states)
                if s.kind == "char" and s.chars.has(ch)
            )
            self._steps[key] = found = self._remember(self._steps, key, found)
        return found

    def _closure(self, states: frozenset, context: tuple[bool, bool, bool]) -> frozenset:
        """Every state reachable without reading a character, at a position of this context
        (at the start, at the end, where $ holds)."""
        key = (states, context)
        found = self._closures.get(key)
        if found is not None:
            return found
        at_start, at_end, dollar = context
        holds = {"start": at_start, "end": at_end, "dollar": dollar}
        seen, todo = set(states), list(states)
        while todo:
            self._spend(1)
            state = self._nfa.states[todo.pop()]
            if state.kind == "split" or (state.kind == "assert" and holds[state.anchor]):
                for target in state.out:
                    if target not in seen:
                        seen.add(target)
                        todo.append(target)
        return self._remember(self._closures, key, frozenset(seen))

    def _spend(self, states: int) -> None:
        self.work += states
        if self.work > MAX_WORK:
            raise ValueError(
                f"matching it against the model's module names takes more than {MAX_WORK:,} "
                "steps; a PEFT key is a module path, not a program"
            )

    @staticmethod
    def _remember(cache: dict, key, value: frozenset) -> frozenset:
        if len(cache) >= MAX_CACHED:
            cache.clear()
        cache[key] = value
        return value


def compile_peft_key(key: str) -> Matcher:
    """The matcher of ``re.match(rf"(.*\\.)?({key})$", name)``, PEFT's and vLLM's rule.

    The key is put into the same text as theirs before parsing, so a key with a
    stray ")" means here what it means there. ValueError when it cannot be matched
    without backtracking, or is not a regular expression.
    """
    return Matcher(rf"(.*\.)?({key})$")
