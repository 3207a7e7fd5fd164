"""What the NaN this project fixes looks like from outside, shared by verify and canary.

NaN logits make greedy decoding pick token id 0, which Qwen's tokenizer
renders as ``!``: a run of id 0 is the ``!!!!!!`` answer users report.
"""

from __future__ import annotations


def longest_zero_run(ids: list[int]) -> int:
    """The longest run of token id 0 in ``ids``."""
    longest = current = 0
    for token in ids:
        current = current + 1 if token == 0 else 0
        longest = max(longest, current)
    return longest
