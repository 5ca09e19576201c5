"""benchmarks/lookup_rules.py: its port of llama.cpp's n-gram cache drafting (`common_ngram_cache_draft`
over the context cache) keeps llama.cpp's thresholds, and its replay counts an answer's steps and costs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def rules():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "lookup_rules.py"
    spec = importlib.util.spec_from_file_location("lookup_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drafted(rules, context: list[int], k: int = 4) -> list[int]:
    cache = rules.NgramCache()
    cache.begin(context)
    return cache.propose(k)


def test_a_repeated_pattern_is_drafted_token_after_token_through_its_own_draft(rules):
    # "1 2" was followed by 3 twice; each drafted token extends the context the next one is looked up in
    assert drafted(rules, [1, 2, 3, 1, 2, 3, 1, 2]) == [3, 1, 2, 3]


def test_a_single_token_seen_once_is_not_enough(rules):
    # the last token, 5, was followed once (by 6): 1 occurrence, below llama.cpp's 2 for 1-token n-grams
    assert drafted(rules, [5, 6, 7, 5]) == []
    # twice, and the share 2 of 2 passes 66%
    assert drafted(rules, [5, 6, 5, 6, 8, 5], k=1) == [6]


def test_a_longer_match_needs_one_occurrence_but_half_the_counts(rules):
    # "3 4 5" followed once by 9: a 3-token n-gram needs 1 occurrence and 50%
    assert drafted(rules, [3, 4, 5, 9, 0, 3, 4, 5], k=1) == [9]
    # 1-token "7" followed by 1, 2, 2: 2 of 3 (67%) passes 66%; followed by 1, 2, 2, 3: 2 of 4 does not
    assert drafted(rules, [7, 1, 7, 2, 7, 2, 7], k=1) == [2]
    assert drafted(rules, [7, 1, 7, 2, 7, 2, 7, 3, 7], k=1) == []


def test_the_replay_emits_the_answer_and_prices_each_step_by_its_rows(rules):
    rows = [{"category": "qa", "prompt": [1, 2, 3, 1, 2, 3], "answer": [1, 2, 3, 1, 2, 3, 4]}]
    totals = rules.replay(rows, rules.NgramCache(), 4, cost=lambda n: float(n))
    tokens, steps, cost, draft_tokens = totals["overall"]
    assert tokens == 7 and totals["qa"] == totals["overall"]
    assert cost == steps + draft_tokens  # f(1 + d) = 1 + d here
    assert steps < 7  # the repeats were drafted and accepted
