"""The canary's prompt: deterministic English prose of a given length, with no tokenizer.

The canary runs where vLLM is not installed, so it cannot count tokens; the
prompt is built from common words that BPE vocabularies hold whole, one
token per word and per punctuation mark, and each answer's
`usage.prompt_tokens` says the real count.
"""

from __future__ import annotations

import random
import re

DEFAULT_PROMPT_TOKENS = 2000
NEW_TOKENS = 32  # greedy tokens asked of every model

_SUBJECTS = (
    "The old lighthouse keeper", "A young engineer", "The village baker", "Our neighbour",
    "The river pilot", "A tired nurse", "The school librarian", "My grandmother",
    "The orchestra conductor", "A travelling merchant", "The night watchman", "Her brother",
    "The apprentice carpenter", "A retired sailor", "The museum guide", "The farmer's daughter",
)  # fmt: skip

_VERBS = (
    "carried", "repaired", "painted", "described", "counted", "borrowed", "measured",
    "planted", "cleaned", "remembered", "explained", "collected", "followed", "opened",
    "wrapped", "studied", "sold", "watched", "built", "tested",
)  # fmt: skip

_OBJECTS = (
    "a wooden chair", "the broken clock", "seven copper pans", "an old map of the coast",
    "the letters from the city", "a basket of green apples", "the heavy iron gate",
    "a small blue boat", "the winter coats", "a box of candles", "the garden fence",
    "two bags of flour", "the station bell", "a long wool scarf", "the kitchen window",
)  # fmt: skip

_PLACES = (
    "near the harbour", "behind the market", "in the quiet library", "along the north road",
    "under the bridge", "at the top of the hill", "beside the mill", "in the crowded square",
    "across the valley", "inside the warm kitchen", "by the frozen lake", "on the morning train",
)  # fmt: skip

_TIMES = (
    "before sunrise", "late in the evening", "on a rainy Tuesday", "after the long winter",
    "during the spring fair", "just after lunch", "on the first day of autumn",
    "while the bells rang", "when the snow stopped", "at half past nine",
)  # fmt: skip

_REASONS = (
    "because the mayor had asked for it", "so that the children could see it",
    "although nobody had noticed", "since the weather was finally calm",
    "because the old one had worn out", "as the whole town expected",
    "even though it took most of the day", "because a storm was coming",
)  # fmt: skip


def prompt_text(tokens: int) -> str:
    """Deterministic, varied English prose of about ``tokens`` tokens, with no tokenizer.

    Built from common words that BPE vocabularies hold whole (with their
    leading space), so the estimate is one token per word and per punctuation
    mark; `usage.prompt_tokens` in each answer tells the real count. Varied
    so the model has something to continue and no run of repeats, and the
    same on every run (the prefix cache is defeated with `cache_salt`).
    """
    rnd = random.Random(20)  # fixed: the same text every run
    lead = "Here is a long story from a small town. Read it and continue it."
    words, text, paragraph = estimate(lead), [lead, ""], []
    while True:
        sentence = (
            f"{rnd.choice(_TIMES).capitalize()}, {rnd.choice(_SUBJECTS).lower()} "
            f"{rnd.choice(_VERBS)} {rnd.choice(_OBJECTS)} {rnd.choice(_PLACES)}, "
            f"{rnd.choice(_REASONS)}."
            if rnd.random() < 0.5
            else f"{rnd.choice(_SUBJECTS)} {rnd.choice(_VERBS)} {rnd.choice(_OBJECTS)} "
            f"{rnd.choice(_PLACES)} {rnd.choice(_TIMES)}, {rnd.choice(_REASONS)}."
        )
        cost = estimate(sentence)
        if words + cost > tokens - 4 and (paragraph or len(text) > 2):
            break
        paragraph.append(sentence)
        words += cost
        if len(paragraph) == 5:
            text.append(" ".join(paragraph))
            paragraph = []
    if paragraph:
        text.append(" ".join(paragraph))
    return "\n".join(text) + "\nThe next morning,"


def estimate(text: str) -> int:
    """Tokens of ``text`` by the rule prompt_text relies on: a word or a punctuation mark each."""
    return len(re.findall(r"\w+|[^\w\s]", text))
