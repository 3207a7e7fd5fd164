"""PEFT's pattern keys without backtracking (patchkit/adapters/patterns.py).

PEFT's get_pattern_key and vLLM 0.32+'s PEFTHelper._match_pattern (read in the
0.33.0 wheel, vllm/lora/peft_helper.py) take the first key with
``re.match(rf"(.*\\.)?({key})$", name)``. The matcher must say what that says
for every key it accepts (checked against Python's re on generated patterns
and on the keys PEFT's docs show), refuse what it cannot match without
backtracking, and finish on the keys that make re backtrack for ever
(checked under RLIMIT_CPU in a child, not with a clock).
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest

from patchkit.adapters.patterns import MAX_STATES, Matcher, compile_peft_key


def peft_match(key: str, name: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", name) is not None


NAMES = [
    "model.decoder.layers.0.encoder_attn.k_proj",
    "model.decoder.layers.10.encoder_attn.k_proj",
    "base.model.decoder.layers.0.encoder_attn.k_proj",
    "model.layers.0.self_attn.q_proj",
    "model.layers.17.self_attn.q_proj",
    "model.layers.x.self_attn.q_proj",
    "model.language_model.layers.3.self_attn.q_proj",
    "model.language_model.layers.3.self_attn.xq_proj",
    "model.language_model.layers.3.mlp.down_proj",
    "model.language_model.layers.1.mlp.experts.gate_up_proj",
    "q_proj",
    "lm_head",
    "model.layers.0.self_attn.q_proj\n",
]

# (key, names it matches, as PEFT decides): the keys of PEFT's docs (LoraConfig's
# rank_pattern help: "model.decoder.layers.0.encoder_attn.k_proj"), anchored and
# \d+ forms, plain module names, alternations and classes.
EXPECTED = [
    ("model.decoder.layers.0.encoder_attn.k_proj", {0, 2}),
    ("^model.decoder.layers.0.encoder_attn.k_proj", {0}),
    (r"model.layers.\d+.self_attn.q_proj", {3, 4, 12}),
    (r"^model\.layers\.\d+\.self_attn\.q_proj$", {3, 4, 12}),
    ("q_proj", {3, 4, 5, 6, 10, 12}),
    ("self_attn.q_proj", {3, 4, 5, 6, 12}),
    ("layers.3.mlp.down_proj", {8}),
    ("down_proj|lm_head", {8, 11}),
    (r"layers\.[0-2]\.self_attn\.q_proj", {3, 12}),
    ("experts.gate_up_proj", {9}),
    ("proj", set()),  # a suffix must start at a "." boundary
    ("", set()),
]


@pytest.mark.parametrize(("key", "expected"), EXPECTED)
def test_real_world_keys_match_the_modules_peft_gives_them(key, expected):
    got = {i for i, name in enumerate(NAMES) if compile_peft_key(key).match(name)}
    assert got == expected
    assert got == {i for i, name in enumerate(NAMES) if peft_match(key, name)}


ATOMS = ["a", "b", ".", r"\.", r"\d", r"\w", r"\s", r"\D", "[ab]", "[^a]", "[a-c.]", r"[\d-]",
         "^", "$", r"\A", r"\Z", "x", "_", "1", r"\n", "{", "}", "]", "-", r"\x61"]  # fmt: skip
QUANTIFIERS = ["*", "+", "?", "{2}", "{1,2}", "{,2}", "{2,}", "{,}", "*?", "+?", "??", "{0}"]


def generated(rnd: random.Random, depth: int = 0) -> str:
    roll = rnd.random()
    if depth > 3 or roll < 0.35:
        return rnd.choice(ATOMS)
    if roll < 0.55:
        return generated(rnd, depth + 1) + generated(rnd, depth + 1)
    if roll < 0.7:
        return f"({generated(rnd, depth + 1)}|{generated(rnd, depth + 1)})"
    if roll < 0.8:
        return f"(?:{generated(rnd, depth + 1)}){rnd.choice(QUANTIFIERS)}"
    if roll < 0.85:  # a stray parenthesis: PEFT's wrapper then parses differently
        return rnd.choice([")", "(", ")("]) + generated(rnd, depth + 1)
    return generated(rnd, depth + 1) + rnd.choice(QUANTIFIERS)


def test_generated_keys_match_exactly_what_re_matches():
    """2,000 generated keys (alternations, nested and counted quantifiers, anchors,
    classes, stray parentheses) on 12 names each: where re compiles the key and the
    matcher accepts it, they agree on every name; a key re refuses is refused too."""
    rnd = random.Random(20261201)
    compared = refused_by_both = 0
    for _ in range(2000):
        key = generated(rnd)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # re's FutureWarning on "[[" and the like
                expected = re.compile(rf"(.*\.)?({key})$")
        except re.error:
            expected = None
        try:
            matcher = compile_peft_key(key)
        except ValueError:
            assert expected is None or "+" in key, key  # only possessive forms are ours alone
            refused_by_both += expected is None
            continue
        assert expected is not None, f"{key!r} is accepted here but re refuses it"
        for _ in range(12):
            name = "".join(rnd.choice("ab.x_1\n ") for _ in range(rnd.randint(0, 9)))
            assert matcher.match(name) == (expected.match(name) is not None), (key, name)
            compared += 1
    assert compared > 15000 and refused_by_both > 50  # the generator exercises both sides


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("(", "missing ), unterminated subpattern"),
        ("a)", "unbalanced parenthesis"),
        ("*a", "nothing to repeat"),
        ("a**", "multiple repeat"),
        ("^*a", "nothing to repeat"),
        ("[z-a]", "bad character range"),
        ("[ab", "unterminated character set"),
        ("a{3,2}", "min repeat greater than max repeat"),
        (r"\x6", "incomplete hexadecimal escape"),
        (r"\q", "bad or unsupported escape \\q"),
        (r"(a)\1", "a backreference"),
        ("(?<=self_attn.)q_proj", "(?...) other than (?:...)"),
        ("(?=q)q_proj", "(?...) other than (?:...)"),
        ("(?P<n>q)_proj", "(?...) other than (?:...)"),
        ("(?i)Q_PROJ", "(?...) other than (?:...)"),
        ("(?>a+)b", "(?...) other than (?:...)"),
        ("q.*+", "a possessive quantifier"),
        (r"\bq_proj", "bad or unsupported escape \\b"),
        ("((a{100}){100}){100}", f"more than {MAX_STATES} states"),
        ("a{99999999999}", f"a repeat count above {MAX_STATES}"),
        ("(" * 150 + "a" + ")" * 150, "groups nested more than 100 deep"),
    ],
)
def test_keys_that_need_backtracking_or_are_not_patterns_are_refused(key, words):
    with pytest.raises(ValueError) as err:
        compile_peft_key(key)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_dollar_also_matches_before_a_final_newline_as_in_re():
    for pattern, text in [("a$", "a\n"), ("a$\n", "a\n"), ("a\\Z", "a\n"), ("a$$", "a\n\n")]:
        assert Matcher(pattern).match(text) == (re.match(pattern, text) is not None)


BACKTRACKING = [
    "(.|.)*(.|.)*(.|.)*Q",  # the key: re never ends on a 46-character name
    "(a*)*b",
    "((a|aa)+)+c",
    "(.*.*.*.*.*)*=",
    "(\\w+\\.?)+!",
]


def test_keys_that_make_re_backtrack_for_ever_finish_under_a_cpu_limit():
    """Each key against a 5,000-character name (re needs exponential time even for
    40): in a child limited to 20 s of CPU, which SIGXCPU kills if any one backtracks."""
    code = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_CPU, (20, 20))
        from patchkit.adapters.patterns import compile_peft_key
        for key in {BACKTRACKING!r}:
            for name in ("a" * 5000, "model.layers.1.self_attn.q_proj" * 160):
                print(key, len(name), compile_peft_key(key).match(name))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != -signal.SIGXCPU, "killed by the CPU limit: it backtracked"
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [
        f"{BACKTRACKING[0]} 5000 False",
        f"{BACKTRACKING[0]} 4960 False",
    ]
    assert len(result.stdout.strip().splitlines()) == 2 * len(BACKTRACKING)


def test_the_backtracking_keys_agree_with_re_where_re_still_ends():
    """On names short enough for re (6 characters: at 12, re took minutes on the fourth)."""
    for key in BACKTRACKING:
        for name in ("aaaaab", "aaaaaa", "x.y.Q", "a.a.c", "a=a=", "ab.c!"):
            assert compile_peft_key(key).match(name) == peft_match(key, name), (key, name)


@pytest.mark.parametrize("key", ["(a?){6000}", "((a?){90}){60}", "(a?){1000}"])
def test_patterns_of_more_states_than_a_module_path_needs_are_refused(key):
    """These compiled to 5,400-12,000 states and took 7-11 s and 2 GB against one
    3,000-character name; a PEFT key is a module path of tens of states."""
    with pytest.raises(ValueError, match="states|repeat count"):
        compile_peft_key(key)


def test_a_pattern_asked_about_many_hostile_names_stops_at_its_work_limit(monkeypatch):
    """Linear per name is not bounded over a hostile adapter's many long names: the
    matcher counts the states it visits and gives up past MAX_WORK, in one ValueError
    (here with a small MAX_WORK, so the test does not spend the real one)."""
    from patchkit.adapters import patterns

    monkeypatch.setattr(patterns, "MAX_WORK", 200_000)
    matcher = compile_peft_key("(a?){400}")
    rng = random.Random(7)
    with pytest.raises(ValueError, match="module path"):
        for _ in range(10_000):
            matcher.match(".".join("a" * rng.randrange(1, 400) for _ in range(8)))
    assert patterns.MAX_WORK < matcher.work <= patterns.MAX_WORK + patterns.MAX_STATES


def test_real_keys_over_a_large_model_stay_far_below_the_work_limit():
    from patchkit.adapters import patterns

    names = [f"base_model.model.model.language_model.layers.{layer}.{module}.{expert}"
             for layer in range(64) for module in ("mlp.experts", "self_attn.q_proj")
             for expert in range(64)]  # fmt: skip
    for key in (r"model.layers.\d+.self_attn.q_proj", r"(q|k|v)_proj", r".*\.layers\.(1|2)\..*"):
        matcher = compile_peft_key(key)
        for name in names:
            matcher.match(name)
        assert matcher.work < patterns.MAX_WORK // 100, (key, matcher.work)
