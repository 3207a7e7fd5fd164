"""What the NaN this project fixes looks like from outside, shared by verify and canary.

NaN logits make greedy decoding pick token id 0, which Qwen's tokenizer
renders as ``!``: a run of id 0 is the ``!!!!!!`` answer users report.
"""

from __future__ import annotations

# How many token-id-0 tokens in a row are the "!!!!" symptom. Two thresholds, for
# two kinds of text a healthy model answers, each kept at the value it was made with:
#
# verify decodes 16 tokens after prompts of random ids drawn from the plain
# vocabulary, id 0 never among them, on a model it serves itself, with a reference
# beside it: nothing makes a healthy model repeat id 0 there, so a short run is
# already the symptom.
ZERO_RUN_RANDOM = 3
# canary asks a live server to continue English prose (32 tokens) and must never
# raise a false alarm on a healthy production model; `!` (id 0 in Qwen
# tokenizers) is ordinary punctuation there and "!!!" can be a real answer, but 8 in
# a row never comes from a sane model continuing English prose.
ZERO_RUN_PROSE = 8


def longest_zero_run(ids: list[int]) -> int:
    """The longest run of token id 0 in ``ids``."""
    longest = current = 0
    for token in ids:
        current = current + 1 if token == 0 else 0
        longest = max(longest, current)
    return longest
