"""The copy bounds: exact counts on hand-made answers, and their order on random ones."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import torch

from specsample.bench.copy_bound import all_matches, any_copy, bounds, ngram_bound, replay
from specsample.drafters.ngram import NgramDrafter, copy_from
from specsample.sampling import SamplingParams
from specsample.tokens import common_prefix


def test_an_answer_that_repeats_its_prompt_is_copied_k_tokens_a_step():
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]
    # any copy: [1 2 3 4] accepted + 5 emitted, then [6 7 8] (the answer ends): 2 steps.
    assert replay(prompt, output, 4, any_copy).steps == 2
    # ngram: the last token, 9, never occurred before: no draft, so 1 is emitted alone; then
    # "1" matches and [2 3 4 5] is accepted + 6; then [7 8]: 3 steps.
    assert ngram_bound(prompt, output, 4).steps == 3


def test_text_never_seen_is_one_token_a_step():
    b = bounds([1, 2, 3], [7, 8, 9, 10], 4)
    assert all(bound.steps == 4 and bound.mean_accepted_length == 1.0 for bound in b.values())


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=30), st.lists(st.integers(0, 3), min_size=1, max_size=8),
       st.integers(1, 8))
def test_each_step_s_candidates_are_ordered(context, truth, k):
    """Per step, the ngram drafter's proposal is among all matches' candidates, which are among any copy's."""
    truth = truth[:k]
    drafter = NgramDrafter()
    drafter.begin(torch.tensor(context), SamplingParams(temperature=0))
    ngram = common_prefix(drafter.lookup(k), truth)
    matches = max((common_prefix(c, truth) for c in all_matches(context, truth)), default=0)
    copies = max((common_prefix(c, truth) for c in any_copy(context, truth)), default=0)
    assert ngram <= matches <= copies
    suffix_matches = [  # all matches by their definition: every suffix length, every earlier occurrence
        copy_from(context, end, len(truth))
        for n in range(1, len(context)) for end in range(n, len(context)) if context[end - n : end] == context[-n:]
    ]
    assert matches == max((common_prefix(c, truth) for c in suffix_matches), default=0)
