"""Losslessness: speculative sampling reproduces the target's distribution exactly.

For a tiny target and draft (vocabulary 16), the exact target distribution
over every sequence of SEQ_LEN new tokens is enumerated from the target's own
forward passes; N_SAMPLES sequences drawn through the engine are compared with
it by chi-square tests at significance level ALPHA, of the joint distribution and
of each prefix's marginal (Bonferroni). The real sampler must pass (p > ALPHA) and
samplers broken on purpose must be rejected (p < ALPHA), one of them only by a
4% bias of its acceptance test.
Seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import specsample.engine as engine
from specsample.drafters import DraftModelDrafter
from specsample.drafters.base import Draft
from specsample.models import make_target
from specsample.models.loading import LoadedModel
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, RandomSource, SamplingParams, probs_from_logits, sample
from specsample.stats import Stats
from specsample.verify import ChainVerifier, Verdict, leading_true
from specsample.verify.chain import rejection_sample
from specsample.verify.check import accept_all, sequence_chi_square_p

from conftest import tiny_llama

ALPHA = 1e-3
N_SAMPLES = 50_000
SEQ_LEN = 3
VOCAB = 16
PROMPT = torch.tensor([1, 2])
INIT_SCALE = 0.3  # next-token distributions neither flat nor point masses
K = 2

PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k3": SamplingParams(temperature=1.0, top_k=3),
}


def chi_square_p(observed: np.ndarray, probs: np.ndarray, vocab: int = VOCAB) -> float:
    """The test of counts of the vocab**length sequences: the joint distribution and each prefix's marginal
    (`verify.check.sequence_chi_square_p`, Bonferroni over the SEQ_LEN tests), so that a flaw at one position
    is not lost among the joint test's thousand bins."""
    return sequence_chi_square_p(observed, probs, vocab)


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A draft model that resembles the target: its weights plus Gaussian noise."""
    draft = tiny_llama(model.config.vocab_size, seed=seed, init_scale=INIT_SCALE)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return draft


class PointMassDrafter:
    """Proposes the draft model's argmax tokens without probabilities (a point mass),
    as model-free drafters do: the proposal is a deterministic function of the context."""

    def __init__(self, inner: DraftModelDrafter) -> None:
        self.inner = inner

    def begin(self, prompt_ids, params):
        self.inner.begin(prompt_ids, SamplingParams(temperature=0))

    def propose(self, k, random):
        return Draft(self.inner.propose(k, random).tokens, None)

    def observe(self, tokens):
        self.inner.observe(tokens)


def as_target(model):
    return make_target(LoadedModel(model, None, "tiny", frozenset(), 0.0))


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(VOCAB, seed=0, init_scale=INIT_SCALE)
    return target, noisy_copy(target, scale=0.1, seed=1)  # acceptance about 0.6


def exact_distribution(model, params: SamplingParams, length: int = SEQ_LEN) -> np.ndarray:
    """P(x_1..x_length | PROMPT) under the transformed target, over all vocab**length sequences."""
    seqs = torch.tensor(list(itertools.product(range(model.config.vocab_size), repeat=length)))  # [V^L, L]
    inputs = torch.cat([PROMPT.expand(len(seqs), -1), seqs], 1)  # [V^L, prompt + L]
    with torch.inference_mode():
        logits = model(inputs).logits[:, len(PROMPT) - 1 : -1]  # [V^L, L, vocab]
    probs = probs_from_logits(logits, params)
    picked = probs.gather(-1, seqs[..., None])[..., 0]  # [V^L, L]
    return picked.double().prod(-1).numpy()


def one_generator(seed: int) -> Iterator[RandomSource]:
    """Every sample draws from one generator, as requests without a seed do."""
    return itertools.repeat(GeneratorSource(torch.Generator().manual_seed(seed)))


def sampled_counts(
    target_model,
    drafter,
    params: SamplingParams,
    seed: int,
    verifier: ChainVerifier = ChainVerifier(),
    sources: Callable[[int], Iterator[RandomSource]] = one_generator,
    length: int = SEQ_LEN,
    k: int = K,
) -> np.ndarray:
    """Counts [vocab**length] of N_SAMPLES sequences of `length` tokens through the engine drafting `k` at a
    time, sample i with the i-th of `sources(seed)`."""
    target, vocab = as_target(target_model), target_model.config.vocab_size
    counts = Counter()
    for _, random in zip(range(N_SAMPLES), sources(seed)):
        tokens = [
            t for step in engine.decode(
                target, drafter, FixedK(k), PROMPT, params, max_new_tokens=length,
                eos_token_ids=frozenset(), random=random, stats=Stats(), verifier=verifier,
            ) for t in step
        ]
        counts[tuple(tokens)] += 1
    index = {s: i for i, s in enumerate(itertools.product(range(vocab), repeat=length))}
    out = np.zeros(vocab**length)
    for seq, c in counts.items():
        out[index[seq]] = c
    return out


def make_drafter(kind: str, draft_model):
    inner = DraftModelDrafter(as_target(draft_model))
    return inner if kind == "draft-model" else PointMassDrafter(inner)


@pytest.mark.parametrize("kind", ["draft-model", "point-mass"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_sampling_matches_target_distribution(models, kind, name):
    target_model, draft_model = models
    params = PARAMS[name]
    observed = sampled_counts(target_model, make_drafter(kind, draft_model), params, seed=1234)
    p = chi_square_p(observed, exact_distribution(target_model, params))
    assert p > ALPHA, f"{kind} {name}: p = {p:.2e}"


def reject_without_residual(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """A broken sampler: right acceptance test, but recovers from target_probs instead of the residual."""
    k = draft_tokens.shape[0]
    positions = torch.arange(k)
    draft_p = torch.ones(k) if draft_probs is None else draft_probs[positions, draft_tokens]
    target_p = torch.stack([target_probs[i][token] for i, token in enumerate(draft_tokens.tolist())]) if k else torch.ones(0)
    ok = torch.rand(k, generator=generator) * draft_p < target_p
    accepted = int(leading_true(ok))
    return Verdict(accepted, sample(target_probs[accepted], generator))


def biased_acceptance(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """A broken sampler only slightly wrong: its draft probabilities divided by 1.04, so a draft token is
    accepted when u q < 1.04 p and the residual is max(0, p - q / 1.04) (the joint test alone passed it)."""
    return rejection_sample(draft_tokens, None if draft_probs is None else draft_probs / 1.04, target_probs, generator)


@pytest.mark.parametrize("broken", [accept_all, reject_without_residual, biased_acceptance])
def test_broken_sampler_is_rejected(models, broken):
    target_model, draft_model = models
    params = PARAMS["t1"]
    drafter = make_drafter("draft-model", draft_model)
    observed = sampled_counts(target_model, drafter, params, seed=1234, verifier=ChainVerifier(sample=broken))
    p = chi_square_p(observed, exact_distribution(target_model, params))
    assert p < ALPHA, f"{broken.__name__} passed: p = {p:.2e}"


DEEP_VOCAB, DEEP_LENGTH, DEEP_K = 8, 5, 4  # 32,768 sequences of 5 tokens; the first step drafts 4


@pytest.fixture(scope="module")
def deep_models():
    target = tiny_llama(DEEP_VOCAB, seed=0, init_scale=INIT_SCALE)
    return target, noisy_copy(target, scale=0.1, seed=1)


def deep_p(models, kind: str, verifier: ChainVerifier = ChainVerifier()) -> float:
    """The chi-square p-value of N_SAMPLES sequences of DEEP_LENGTH tokens drafted DEEP_K at a time at
    temperature 1: verification at every draft index, the bonus after four accepted tokens included."""
    target_model, draft_model = models
    params = PARAMS["t1"]
    observed = sampled_counts(target_model, make_drafter(kind, draft_model), params, seed=99, verifier=verifier,
                              length=DEEP_LENGTH, k=DEEP_K)
    return chi_square_p(observed, exact_distribution(target_model, params, DEEP_LENGTH), DEEP_VOCAB)


@pytest.mark.parametrize("kind", ["draft-model", "point-mass"])
def test_long_chains_match_target_distribution(deep_models, kind):
    p = deep_p(deep_models, kind)
    assert p > ALPHA, f"{kind}: p = {p:.2e}"


def biased_from_third(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """A broken sampler right at the first two draft indices and wrong only from the third on (its draft
    probabilities there divided by 1.2), which no test of K = 2 can see."""
    if draft_probs is not None:
        scale = torch.ones(draft_tokens.shape[0])
        scale[2:] = 1 / 1.2
        draft_probs = draft_probs * scale[:, None]
    return rejection_sample(draft_tokens, draft_probs, target_probs, generator)


def test_long_chains_reject_a_sampler_broken_from_the_third_draft_token(deep_models):
    p = deep_p(deep_models, "draft-model", ChainVerifier(sample=biased_from_third))
    assert p < ALPHA, f"biased_from_third passed: p = {p:.2e}"
