"""A drafter's cost known before it drafts: measured when a draft model is made, with the target's threads,
and the cost model's K never spent on a drafter whose tokens no acceptance repays (issue 26)."""

from __future__ import annotations

import math

import pytest

from specsample.api import SpecSampler
from specsample.drafters import DraftModelDrafter, make_drafter
from specsample.drafters.base import draft_cost
from specsample.models import load_target, make_target
from specsample.models.loading import bundled_gguf, load_model
from specsample.policy import CostModelK

from test_policy import run_cost_model


class CountedDraftModel(DraftModelDrafter):
    """A draft model drafter that counts how often it is asked to draft."""

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self.proposals = 0

    def propose(self, k, random):
        self.proposals += 1
        return super().propose(k, random)


@pytest.mark.parametrize("relative", [1.0, 1.5, 4.0])
def test_cost_model_never_drafts_with_a_drafter_that_costs_a_target_pass_or_more(relative):
    """Every draft token accepted and verification free: even so a drafter at c >= 1 cannot pay,
    and a policy told its cost before the first step never asks it for a draft."""
    policy = CostModelK(k_max=8)
    policy.see_draft_cost(relative)
    ks = run_cost_model(policy, 60, acceptance=lambda i: 1.0, cost=lambda n: 0.01, draft_cost_per_token=relative * 0.01)
    assert ks == [0] * 60
    assert policy.estimates()["declared_draft_cost"] == relative


def test_cost_model_drafts_with_a_declared_cheap_drafter():
    policy = CostModelK(k_max=8)
    policy.see_draft_cost(0.05)
    ks = run_cost_model(policy, 30, acceptance=lambda i: 1.0, cost=lambda n: 0.01, draft_cost_per_token=0.0005)
    assert ks[-5:] == [8] * 5


def test_a_negative_draft_cost_is_refused():
    with pytest.raises(ValueError, match="draft cost must be >= 0"):
        CostModelK().see_draft_cost(-0.5)


def test_an_unprofitable_drafter_is_never_asked_to_draft_under_auto_and_the_text_is_plain_decodings(tiny_dir, tiny_draft_dir):
    """A real draft model declaring 2 target passes a token: `--k auto` decodes plainly, token for token."""
    loaded = load_model(tiny_dir)
    target = make_target(loaded)
    drafter = CountedDraftModel(make_target(load_model(tiny_draft_dir)), draft_cost=2.0)
    sampler = SpecSampler(loaded, target, drafter)
    plain = SpecSampler(loaded, target, make_drafter("none", loaded, target))
    for prompt in ("w5 w9 w7 w3", "w3 w5 w3 w5 w3", "w12 w40 w7"):
        for temperature, seed in ((0.0, None), (1.0, 7)):
            options = dict(max_new_tokens=24, temperature=temperature, seed=seed, chat=False)
            out = sampler.generate(prompt, k="auto", **options)
            assert out.token_ids == plain.generate(prompt, k=0, **options).token_ids
            assert out.stats.drafted_tokens == 0
    assert drafter.proposals == 0
    assert sampler.policy("auto").estimates()["declared_draft_cost"] == 2.0


@pytest.mark.llamacpp
def test_a_draft_model_runs_with_the_targets_threads_and_declares_its_measured_cost():
    """On llama.cpp the draft model gets the target's thread count (not all cores), and its cost per
    token against a target pass is measured when it is made (a number, not a timing asserted)."""
    loaded, target = load_target(str(bundled_gguf()), "llamacpp", threads=1)
    drafter = make_drafter(str(bundled_gguf()), loaded, target, backend="llamacpp", threads=1)
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.model.n_threads == 1
    cost = draft_cost(drafter)
    assert cost is not None and math.isfinite(cost) and cost > 0
    assert target.length == 0 and drafter.model.length == 0  # the measurement leaves both caches empty


def test_a_cross_vocabulary_drafter_declares_its_measured_cost(tiny_dir, other_vocab_dir):
    loaded = load_model(tiny_dir)
    target = make_target(loaded)
    for spec in (f"text:{other_vocab_dir}", f"intersection:{other_vocab_dir}", str(other_vocab_dir)):
        cost = draft_cost(make_drafter(spec, loaded, target))
        assert cost is not None and math.isfinite(cost) and cost > 0, spec
