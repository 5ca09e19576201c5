"""`A+B` drafters: lossless, greedy-identical whichever drafter drafts a step, built from `--drafter`.

The chi-square test reuses test_lossless.py's machinery (N_SAMPLES samples,
significance level ALPHA) with a prompt that repeats itself, so that `suffix`
drafts some steps and the draft model the others; a fallback whose choice
reads the draft model's draw is rejected.
"""

from __future__ import annotations

import re

import pytest
import torch

import test_lossless as lossless
from test_lossless import models  # noqa: F401  (the fixture: target and draft model)
from specsample.drafters import DraftModelDrafter, FallbackDrafter, LayerSkipDrafter, NoDrafter, SuffixDrafter, make_drafter
from specsample.drafters.base import Draft
from specsample.drafters.quantized import QuantizedDrafter
from specsample.engine import decode
from specsample.models import make_target
from specsample.models.loading import LoadedModel
from specsample.models.quantize import int8_target
from specsample.policy import FixedK, HeuristicK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats
from test_head import head_drafter
from test_lossless_drafters import GREEDY_PROMPT, GREEDY_VOCAB, check_it_drafts, repeating_prompt

from conftest import tiny_llama


class DrawDependentFallback(FallbackDrafter):
    """Broken on purpose: verifies the draft model's draft only when it drew its own most likely
    token, else the lookup draft; the choice reads the draw, so the draft is no longer drawn
    from the draft_probs it carries."""

    def propose(self, k, random):
        draft = self.second.propose(k, random)
        if draft.probs[0, draft.tokens[0]] == draft.probs[0].max():
            self.second_steps += 1
            return draft
        self.first_steps += 1
        return self.first.propose(k, random)


@pytest.mark.parametrize("broken", [False, True])
def test_suffix_then_draft_model_keeps_the_target_distribution(models, monkeypatch, broken):
    target_model, draft_model = models
    monkeypatch.setattr(lossless, "PROMPT", repeating_prompt(target_model))
    params = lossless.PARAMS["t1"]

    def drafter() -> FallbackDrafter:
        kind = DrawDependentFallback if broken else FallbackDrafter
        return kind(SuffixDrafter(), lossless.make_drafter("draft-model", draft_model))

    probe = drafter()
    check_it_drafts(target_model, probe, FixedK(lossless.K), params)
    assert probe.first_steps > 0 and probe.second_steps > 0
    observed = lossless.sampled_counts(target_model, drafter(), params, seed=2024)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, params))
    assert (p < lossless.ALPHA) if broken else (p > lossless.ALPHA), f"broken={broken}: p = {p:.2e}"


SECONDS = {
    "draft-model": lambda loaded, target: DraftModelDrafter(make_target(loaded)),
    "layerskip": lambda loaded, target: LayerSkipDrafter(target, loaded.model, skip=[1, 2]),
    "quantized": lambda loaded, target: QuantizedDrafter(int8_target(loaded.model, target.max_length), target),
    "head": lambda loaded, target: head_drafter(loaded, target, subset=48),
}
POLICIES = {"fixed": lambda: FixedK(4), "heuristic": lambda: HeuristicK(k_start=4)}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("second", list(SECONDS))
def test_greedy_output_is_the_target_alone(second, policy):
    """Each kind of second drafter keeps its own state (a cache, the target's cache, features) in step
    over the steps it did not draft."""
    loaded = LoadedModel(tiny_llama(GREEDY_VOCAB, seed=3, layers=4), None, "tiny", frozenset(), 0.0)

    def greedy(drafter, policy, stats) -> list[int]:
        target = make_target(loaded)
        steps = decode(
            target, drafter(target), policy, GREEDY_PROMPT, SamplingParams(temperature=0), max_new_tokens=60,
            eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats,
        )
        return [t for step in steps for t in step]

    made: list[FallbackDrafter] = []

    def fallback(target) -> FallbackDrafter:
        made.append(FallbackDrafter(SuffixDrafter(), SECONDS[second](loaded, target), min_tokens=2))
        return made[-1]

    stats = Stats()
    assert greedy(fallback, POLICIES[policy](), stats) == greedy(lambda t: NoDrafter(), FixedK(0), Stats())
    assert made[0].first_steps > 0 and made[0].second_steps > 0 and stats.accepted_tokens > 0


def test_a_short_lookup_draft_gives_way_to_the_second_drafter():
    class Fixed:
        is_lookup = True

        def __init__(self, tokens):
            self.tokens, self.observed = tokens, []

        def begin(self, prompt_ids, params):
            pass

        def propose(self, k, random):
            return Draft(torch.tensor(self.tokens[:k]), None)

        def observe(self, tokens):
            self.observed.append(tokens)

    first, second = Fixed([7]), Fixed([1, 2, 3])
    drafter = FallbackDrafter(first, second, min_tokens=2)
    random = GeneratorSource(torch.Generator())
    assert drafter.propose(4, random).tokens.tolist() == [1, 2, 3]  # one token is short of 2
    assert drafter.propose(1, random).tokens.tolist() == [1]  # at K = 1 too: the match decides, not K
    first.tokens = [7, 8]
    assert drafter.propose(4, random).tokens.tolist() == [7, 8]
    assert drafter.propose(1, random).tokens.tolist() == [7]  # a match long enough, cut to K
    drafter.observe([7, 5])
    assert first.observed == second.observed == [[7, 5]]


def test_the_command_line_names_build_a_fallback():
    model = tiny_llama(GREEDY_VOCAB, seed=3)
    loaded = LoadedModel(model, None, "tiny", frozenset(), 0.0)
    target = make_target(loaded)
    drafter = make_drafter("ngram+suffix", loaded, target)
    assert isinstance(drafter, FallbackDrafter)
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        make_drafter("suffix+nope", loaded, target)
    for half in ("suffix+", "+suffix"):
        with pytest.raises(ValueError, match=f"names two drafters.*got {re.escape(repr(half))}"):
            make_drafter(half, loaded, target)
    with pytest.raises(ValueError, match="must be a lookup drafter .* got 'DraftModelDrafter'"):
        FallbackDrafter(DraftModelDrafter(target), SuffixDrafter())  # the property, not the name, decides
