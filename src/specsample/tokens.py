"""Helpers over sequences of token ids, shared by drafters and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of a and b: how many draft tokens the text took up."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
