"""The `ngram` drafter (prompt lookup) against brute force on random token strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specsample.drafters.ngram import NgramDrafter
from specsample.sampling import SamplingParams


def brute_lookup(context: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The longest suffix (max_n down to min_n) found earlier with a continuation; copy from its
    latest occurrence, reading the copy's own output once it runs past the end of the context."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        starts = [s for s in range(n, len(context)) if context[s - n : s] == context[-n:]]
        if starts:
            text = list(context)
            for i in range(k):
                text.append(text[max(starts) + i])
            return text[len(context) :]
    return []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.lists(st.integers(0, 3), max_size=10),
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_lookup_matches_brute_force(prompt, output, k, max_n, shorter):
    min_n = max(1, max_n - shorter)
    drafter = NgramDrafter(max_n, min_n)
    drafter.begin(torch.tensor(prompt), SamplingParams())
    for token in output:
        drafter.observe([token])
    expected = brute_lookup(prompt + output, k, max_n, min_n)
    assert drafter.propose(k, torch.Generator()).tokens.tolist() == expected


def test_accepted_draft_tokens_join_the_context():
    drafter = NgramDrafter(max_n=2)
    drafter.begin(torch.tensor([5, 6, 7, 8, 5, 6]), SamplingParams())
    assert drafter.propose(2, torch.Generator()).tokens.tolist() == [7, 8]
    drafter.observe([7, 9])  # context 5 6 7 8 5 6 7 9
    assert drafter.propose(2, torch.Generator()).tokens.tolist() == []


def test_a_short_period_continues_past_the_end():
    drafter = NgramDrafter()
    drafter.begin(torch.tensor([1, 2, 1, 2]), SamplingParams())
    assert drafter.propose(5, torch.Generator()).tokens.tolist() == [1, 2, 1, 2, 1]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=2, min_n=3)
