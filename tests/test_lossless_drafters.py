"""The model-free drafters and the K policies keep sampling lossless and greedy output identical.

Reuses the chi-square machinery of test_lossless.py (same N_SAMPLES, same
significance level ALPHA) with a prompt that repeats itself, so that `ngram`
and `suffix` do propose. Each sample gets a fresh policy, as each request
does, so the choice of K, and with it the outcome, is deterministic.
"""

from __future__ import annotations

import pytest
import torch

import test_lossless as lossless
from test_lossless import models  # noqa: F401  (the fixture: target and draft model)
from specsample.drafters import NgramCacheDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specsample.drafters.base import Draft
from specsample.engine import decode
from specsample.models import make_target
from specsample.models.loading import LoadedModel
from specsample.policy import FixedK, HeuristicK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats
from specsample.verify import ChainVerifier

from conftest import drafting_cost_model, tiny_llama

DRAFTERS = {"ngram": NgramDrafter, "suffix": SuffixDrafter, "ngram-cache": NgramCacheDrafter}
POLICIES = {"fixed": FixedK, "heuristic": lambda k: HeuristicK(k_start=k), "cost-model": lambda k: drafting_cost_model()}


def repeating_prompt(model) -> torch.Tensor:
    """[a, b, c, a, b] with c the target's most likely token after it, so the drafters'
    proposal (c) is often accepted."""
    a, b = 3, 9
    candidates = torch.tensor([[a, b, c, a, b] for c in range(lossless.VOCAB)])
    with torch.inference_mode():
        probs = model(candidates).logits[:, -1].softmax(-1)  # [vocab, vocab]
    c = int(probs.diagonal().argmax())
    return torch.tensor([a, b, c, a, b])


@pytest.mark.parametrize(
    ("drafter", "policy", "params", "broken"),
    [("ngram", "heuristic", "t1", False), ("suffix", "cost-model", "t0.7-top_p0.9", False),
     ("ngram-cache", "fixed", "t1", False),
     ("ngram", "heuristic", "t1", True), ("suffix", "cost-model", "t0.7-top_p0.9", True),
     ("ngram-cache", "fixed", "t1", True)],
)
def test_drafter_keeps_the_target_distribution(models, monkeypatch, drafter, policy, params, broken):
    """Chi-square at ALPHA: passes with the real verifier; rejected when a rejected draft token is
    recovered from the target's row instead of the residual (the drafted token can come back)."""
    target_model, _ = models
    monkeypatch.setattr(lossless, "PROMPT", repeating_prompt(target_model))
    monkeypatch.setattr(lossless, "FixedK", POLICIES[policy])
    check_it_drafts(target_model, DRAFTERS[drafter](), POLICIES[policy](lossless.K), lossless.PARAMS[params])
    verifier = ChainVerifier(sample=lossless.reject_without_residual) if broken else ChainVerifier()
    observed = lossless.sampled_counts(target_model, DRAFTERS[drafter](), lossless.PARAMS[params], seed=4321,
                                       verifier=verifier)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, lossless.PARAMS[params]))
    assert (p < lossless.ALPHA) if broken else (p > lossless.ALPHA), f"{drafter} {policy} {params} broken={broken}: p = {p:.2e}"


def check_it_drafts(target_model, drafter, policy, params) -> None:
    """The test would be vacuous if the drafter never proposed, or the target never accepted."""
    stats = Stats()
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        for _ in decode(
            lossless.as_target(target_model), drafter, policy, lossless.PROMPT, params,
            max_new_tokens=lossless.SEQ_LEN, eos_token_ids=frozenset(), random=GeneratorSource(generator), stats=stats,
        ):
            pass
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0


GREEDY_VOCAB = 64
GREEDY_PROMPT = torch.tensor([5, 17, 33, 2, 60, 8, 5, 17, 33, 2, 41, 5, 17])


def greedy(model, drafter, policy, stats: Stats) -> list[int]:
    target = make_target(LoadedModel(model, None, "tiny", frozenset(), 0.0))
    steps = decode(
        target, drafter, policy, GREEDY_PROMPT, SamplingParams(temperature=0), max_new_tokens=60,
        eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats,
    )
    return [t for step in steps for t in step]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_output_is_the_target_alone(drafter, policy):
    model = tiny_llama(GREEDY_VOCAB, seed=3)
    alone = greedy(model, NoDrafter(), FixedK(0), Stats())
    stats = Stats()
    assert greedy(model, DRAFTERS[drafter](), POLICIES[policy](4), stats) == alone
    assert stats.accepted_tokens > 0


class ConfidentPrefixK(FixedK):
    """K fixed, but only the draft's prefix up to its first token of confidence below THRESHOLD is
    verified: a cut that depends on the draft tokens drawn, as the cost model's does."""

    THRESHOLD = 0.3

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.kept: list[int] = []

    def keep(self, confidence: torch.Tensor) -> int:
        low = (confidence < self.THRESHOLD).nonzero()
        self.kept.append(int(low[0]) if len(low) else len(confidence))
        return self.kept[-1]


class DrawnTokenConfidence:
    """Broken on purpose: reports as confidence the probability of the token drawn, which is known only
    after the draw, so a cut on it verifies some draws more often than others."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def begin(self, prompt_ids, params):
        self.inner.begin(prompt_ids, params)

    def propose(self, k, random):
        draft = self.inner.propose(k, random)
        drawn = draft.probs.gather(1, draft.tokens[:, None])[:, 0]  # [k]
        return Draft(draft.tokens, draft.probs, drawn)

    def observe(self, tokens):
        self.inner.observe(tokens)


@pytest.mark.parametrize("broken", [False, True])
def test_verifying_a_confident_prefix_keeps_the_target_distribution(models, monkeypatch, broken):
    """Chi-square at ALPHA: the draft model's drafts verified up to their first unconfident token pass;
    the same cut on the drawn token's own probability is rejected."""
    target_model, draft_model = models
    params = lossless.PARAMS["t1"]

    def drafter():
        inner = lossless.make_drafter("draft-model", draft_model)
        return DrawnTokenConfidence(inner) if broken else inner

    policy = ConfidentPrefixK(lossless.K)
    check_it_drafts(target_model, drafter(), policy, params)
    assert set(policy.kept) == {0, 1, 2}  # empty, partial and whole drafts all occur
    monkeypatch.setattr(lossless, "FixedK", ConfidentPrefixK)
    observed = lossless.sampled_counts(target_model, drafter(), params, seed=99)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, params))
    assert (p < lossless.ALPHA) if broken else (p > lossless.ALPHA), f"broken={broken}: p = {p:.2e}"
