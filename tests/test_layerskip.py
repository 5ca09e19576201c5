"""The `layerskip` drafter: lossless, greedy output identical to transformers generate, and a
calibration that leaves the shared cache as it found it.

The chi-square test reuses test_lossless.py's machinery (N_SAMPLES samples,
significance level ALPHA) on a 4-layer tiny target whose drafter skips its
two middle layers; the drafter shares the target's KV cache, so the engine
is handed that same target.
"""

from __future__ import annotations

import pytest
import torch

import test_lossless as lossless
from specsample.drafters import LayerSkipDrafter, make_drafter
from specsample.drafters.layerskip import NO_SKIP, Candidate, best_candidate
from specsample.engine import decode
from specsample.models import TransformersTarget
from specsample.models.loading import LoadedModel
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats
from test_lossless_drafters import GREEDY_PROMPT, GREEDY_VOCAB, check_it_drafts

from conftest import drafting_cost_model, tiny_llama


@pytest.fixture(scope="module")
def deep_model():
    return tiny_llama(lossless.VOCAB, seed=0, init_scale=lossless.INIT_SCALE, layers=4)


def test_layerskip_keeps_the_target_distribution(deep_model, monkeypatch):
    target = lossless.as_target(deep_model)
    monkeypatch.setattr(lossless, "as_target", lambda model: target)  # the drafter drafts in this target's cache
    params = lossless.PARAMS["t0.7-top_p0.9"]
    check_it_drafts(deep_model, LayerSkipDrafter(target, deep_model, skip=[1, 2]), FixedK(lossless.K), params)
    observed = lossless.sampled_counts(deep_model, LayerSkipDrafter(target, deep_model, skip=[1, 2]), params, seed=99)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(deep_model, params))
    assert p > lossless.ALPHA, f"layerskip: p = {p:.2e}"


def generate_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding: the reference."""
    mask = torch.ones(1, prompt.shape[0], dtype=torch.long)
    out = model.generate(prompt[None], attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, prompt.shape[0] :].tolist()


def greedy_with(name: str, model, policy, stats: Stats) -> list[int]:
    """Greedy decoding through the engine with the registered drafter `name` on the fast backend."""
    loaded = LoadedModel(model, None, "tiny", frozenset(), 0.0)
    target = lossless.as_target(model)
    return greedy_decode(target, make_drafter(name, loaded, target), policy, stats)


def greedy_decode(target, drafter, policy, stats: Stats) -> list[int]:
    """The engine's greedy tokens for GREEDY_PROMPT, 60 of them."""
    steps = decode(
        target, drafter, policy, GREEDY_PROMPT, SamplingParams(temperature=0),
        max_new_tokens=60, eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats,
    )
    return [t for step in steps for t in step]


def with_a_dead_layer(model, layer: int):
    """The model with one layer that adds nothing to the residual stream: skipping it changes no output."""
    with torch.no_grad():
        model.model.layers[layer].self_attn.o_proj.weight.zero_()
        model.model.layers[layer].mlp.down_proj.weight.zero_()
    return model


@pytest.mark.parametrize("policy", [lambda: FixedK(3), drafting_cost_model])
def test_greedy_output_is_transformers_generate(policy):
    model = tiny_llama(GREEDY_VOCAB, seed=3, layers=4)
    target = lossless.as_target(model)
    stats = Stats()
    tokens = greedy_decode(target, LayerSkipDrafter(target, model, skip=[1, 2]), policy(), stats)
    assert tokens == generate_greedy(model, GREEDY_PROMPT, 60)
    assert stats.drafted_tokens > 0


def test_calibration_skips_the_layer_that_does_nothing():
    """A layer that changes no output is the one to skip: the calibrated drafter drafts without it."""
    model = with_a_dead_layer(tiny_llama(GREEDY_VOCAB, seed=3, layers=4), 2)
    stats = Stats()
    assert greedy_with("layerskip", model, FixedK(3), stats) == generate_greedy(model, GREEDY_PROMPT, 60)
    assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens


def test_calibration_leaves_the_cache_as_it_found_it():
    """After calibrating, the target continues exactly as if nothing had run in its cache."""
    model = tiny_llama(GREEDY_VOCAB, seed=3, layers=6)
    target = lossless.as_target(model)
    target.prefill(GREEDY_PROMPT[:-1])
    expected = target.score(GREEDY_PROMPT[-1:])
    target.prefill(GREEDY_PROMPT[:-1])
    drafter = LayerSkipDrafter(target, model)
    drafter.begin(GREEDY_PROMPT, SamplingParams(temperature=0))
    assert target.length == GREEDY_PROMPT.shape[0] - 1
    assert torch.equal(target.score(GREEDY_PROMPT[-1:]), expected)
    assert all(0 < i < 5 for i in drafter.skip)  # first and last layers are kept
    assert drafter.skip in {c.skip for c in [NO_SKIP, *drafter.candidates]}


def test_calibration_skips_nothing_unless_a_skip_set_beats_plain_decoding():
    slow = [Candidate((3,), 0.6, 0.9, 0.95), Candidate((3, 4), 0.3, 0.8, 0.9)]
    assert best_candidate(slow) == NO_SKIP
    assert best_candidate([*slow, Candidate((2, 3, 4), 0.7, 0.5, 1.2)]).skip == (2, 3, 4)


def test_a_drafter_that_skips_nothing_drafts_nothing():
    """Skipping no layer would draft with the target itself: every step is a plain one, the output the same."""
    model = tiny_llama(GREEDY_VOCAB, seed=3, layers=4)
    target = lossless.as_target(model)
    stats = Stats()
    tokens = greedy_decode(target, LayerSkipDrafter(target, model, skip=[]), FixedK(3), stats)
    assert tokens == generate_greedy(model, GREEDY_PROMPT, 60)
    assert stats.drafted_tokens == 0 and stats.steps == 60


def test_the_transformers_backend_is_refused():
    model = tiny_llama(GREEDY_VOCAB, seed=3, layers=4)
    with pytest.raises(ValueError, match="layerskip needs a target backend that runs a subset of its layers"):
        LayerSkipDrafter(TransformersTarget(model), model)

