"""The `ngram-cache` drafter (llama.cpp's n-gram cache rule) keeps its thresholds, and
benchmarks/lookup_rules.py's replay counts an answer's steps and costs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specsample.drafters import REGISTRY, NgramCacheDrafter
from specsample.drafters.ngram_cache import LLAMA_PERCENT
from specsample.sampling import SamplingParams


@pytest.fixture(scope="module")
def rules():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "lookup_rules.py"
    spec = importlib.util.spec_from_file_location("lookup_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drafted(context: list[int], k: int = 4, percent=LLAMA_PERCENT) -> list[int]:
    drafter = NgramCacheDrafter(min_percent=percent)
    drafter.begin(torch.tensor(context), SamplingParams(temperature=0))
    return drafter.lookup(k)


def test_a_repeated_pattern_is_drafted_token_after_token_through_its_own_draft():
    # "1 2" was followed by 3 twice; each drafted token extends the context the next one is looked up in
    assert drafted([1, 2, 3, 1, 2, 3, 1, 2]) == [3, 1, 2, 3]


def test_a_single_token_seen_once_is_not_enough():
    # the last token, 5, was followed once (by 6): 1 occurrence, below llama.cpp's 2 for 1-token n-grams
    assert drafted([5, 6, 7, 5]) == []
    # twice, and the share 2 of 2 passes 66%
    assert drafted([5, 6, 5, 6, 8, 5], k=1) == [6]


def test_a_longer_match_needs_one_occurrence_but_a_share_of_the_counts():
    # "3 4 5" followed once by 9: a 3-token n-gram needs 1 occurrence and 50% (60% for ngram-cache)
    assert drafted([3, 4, 5, 9, 0, 3, 4, 5], k=1) == [9]
    # 1-token "7" (never after 5 before) followed by 1, 2, 2: 2 of 3 (67%) passes llama.cpp's 66%, not
    # ngram-cache's 75%
    assert drafted([0, 7, 1, 3, 7, 2, 4, 7, 2, 5, 7], k=1) == [2]
    assert drafted([0, 7, 1, 3, 7, 2, 4, 7, 2, 5, 7], k=1, percent=NgramCacheDrafter().min_percent) == []
    # followed by 1, 2, 2, 3: 2 of 4 passes neither
    assert drafted([0, 7, 1, 3, 7, 2, 4, 7, 2, 6, 7, 3, 5, 7], k=1) == []


def test_the_drafter_counts_what_the_engine_shows_it_and_forks_empty():
    drafter = REGISTRY["ngram-cache"](None, None)
    drafter.begin(torch.tensor([4, 8, 4]), SamplingParams(temperature=0))
    assert drafter.lookup(2) == []  # "4" followed once
    drafter.observe([8, 4])  # "4 8" twice now, "8 4" twice
    assert drafter.lookup(2) == [8, 4] and drafter.is_lookup
    fork = drafter.fork()
    assert fork.min_percent == drafter.min_percent and not fork.tokens


def test_thresholds_of_another_length_are_refused():
    with pytest.raises(ValueError, match="need 4 thresholds each"):
        NgramCacheDrafter(min_percent=(50, 50))


def test_the_replay_emits_the_answer_and_prices_each_step_by_its_rows(rules):
    rows = [{"category": "qa", "prompt": [1, 2, 3, 1, 2, 3], "answer": [1, 2, 3, 1, 2, 3, 4]}]
    totals = rules.replay(rows, rules.RULES["llama-lookup"](), 4, cost=lambda n: float(n))
    tokens, steps, cost, draft_tokens = totals["overall"]
    assert tokens == 7 and totals["qa"] == totals["overall"]
    assert cost == steps + draft_tokens  # f(1 + d) = 1 + d here
    assert steps < 7  # the repeats were drafted and accepted
