"""Losslessness of batched decoding (batch.py): requests sampled together in one batch follow the
target's distribution exactly.

As tests/test_lossless.py, with the same tiny target and draft model, exact enumeration and
chi-square test (fixed seeds, ALPHA, N_SAMPLES): here the N_SAMPLES requests run SLOTS at a time,
each joining as soon as a slot is free, so every pass scores the rows of several requests at
different steps of their text, each verified with its own draft and the draws of one shared
generator. The real sampler must pass and a sampler broken on purpose must fail.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from specsample.batch import Batch, Request
from specsample.models.llama import LlamaTarget
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource
from specsample.verify import ChainVerifier
from specsample.verify.check import accept_all

from conftest import needs_kernels
from test_lossless import ALPHA, K, N_SAMPLES, PARAMS, PROMPT, SEQ_LEN, VOCAB, chi_square_p, exact_distribution, make_drafter, models  # noqa: F401

pytestmark = needs_kernels
SLOTS = 8


class ForkingDrafter:
    """test_lossless's drafters, forked as batch.py needs (`drafters.base.Forks`): each fork drafts
    with a target of its own over the same draft model."""

    is_lookup = False

    def __init__(self, kind: str, draft_model) -> None:
        self.kind, self.draft_model = kind, draft_model
        self.inner = make_drafter(kind, draft_model)

    def fork(self) -> ForkingDrafter:
        return ForkingDrafter(self.kind, self.draft_model)

    def begin(self, prompt_ids, params):
        self.inner.begin(prompt_ids, params)

    def propose(self, k, random):
        return self.inner.propose(k, random)

    def observe(self, tokens):
        self.inner.observe(tokens)


def batch_counts(target_model, drafter, params, seed: int, verifier: ChainVerifier = ChainVerifier()) -> np.ndarray:
    """Counts [VOCAB**SEQ_LEN] of N_SAMPLES sequences decoded SLOTS at a time, all drawing from one generator."""
    batch = Batch(LlamaTarget.from_hf(target_model).slots(SLOTS), drafter, lambda: FixedK(K),
                  eos_token_ids=frozenset(), verifier=verifier)
    random = GeneratorSource(torch.Generator().manual_seed(seed))
    index = {s: i for i, s in enumerate(itertools.product(range(VOCAB), repeat=SEQ_LEN))}
    counts, tokens, waiting, sizes = np.zeros(VOCAB**SEQ_LEN), {}, N_SAMPLES, []
    while waiting or batch.running:
        while waiting and not batch.full:
            request = Request(PROMPT, params, SEQ_LEN, random)
            tokens[request] = []
            batch.add(request)
            waiting -= 1
        sizes.append(len(batch.running))
        for request, new in batch.step():
            tokens[request] += new
            if request.done:
                counts[index[tuple(tokens.pop(request))]] += 1
    assert np.mean(sizes) > SLOTS - 1  # the batch ran (nearly) full
    return counts


def test_batched_sampling_matches_target_distribution(models):  # noqa: F811
    target_model, draft_model = models
    params = PARAMS["t0.7-top_p0.9"]
    observed = batch_counts(target_model, ForkingDrafter("draft-model", draft_model), params, seed=4321)
    assert observed.sum() == N_SAMPLES
    p = chi_square_p(observed, exact_distribution(target_model, params))
    assert p > ALPHA, f"p = {p:.2e}"


def test_broken_batched_sampler_is_rejected(models):  # noqa: F811
    target_model, draft_model = models
    params = PARAMS["t1"]
    observed = batch_counts(target_model, ForkingDrafter("draft-model", draft_model), params, seed=4321,
                            verifier=ChainVerifier(sample=accept_all))
    p = chi_square_p(observed, exact_distribution(target_model, params))
    assert p < ALPHA, f"accept_all passed: p = {p:.2e}"
