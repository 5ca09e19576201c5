"""Predicted Outputs (`prediction`): drafted from first, the answer unchanged.

The drafter follows the prediction while the answer does, picks it up again after a departure, and a
request with a prediction gives the text the same request gives without one: greedy, seeded, sampled
(chi-square, test_lossless's machinery), alone and batched, and through the server."""

from __future__ import annotations

import re

import pytest
import torch

import test_lossless as lossless
from test_lossless import models  # noqa: F401  (the fixture: target and draft model)
from specsample.drafters import NoDrafter
from specsample.drafters.prediction import PredictionDrafter, with_prediction
from specsample.engine import decode
from specsample.policy import FixedK
from specsample.sampling import CoupledSource, SamplingParams
from specsample.stats import Stats
from specsample.verify import ChainVerifier

from conftest import tiny_llama, tiny_tokenizer


def test_the_drafter_follows_the_prediction_and_picks_it_up_after_a_departure():
    drafter = PredictionDrafter([10, 11, 12, 13, 14, 15, 16, 17], max_n=4, min_n=2)
    drafter.begin(torch.tensor([1, 2]), SamplingParams(0))
    assert drafter.lookup(3) == [10, 11, 12]  # the answer starts as the prediction does
    drafter.extend([10, 11])
    assert drafter.lookup(3) == [12, 13, 14]
    drafter.extend([99])  # an edit: the answer departs
    assert drafter.lookup(3) == []  # "11 99" is nowhere in the prediction
    drafter.extend([13, 14])  # the answer rejoins it
    assert drafter.lookup(2) == [15, 16]
    drafter.extend([15, 16, 17])
    assert drafter.lookup(2) == []  # the prediction is used up


def test_a_repeated_n_gram_resumes_at_or_after_the_cursor():
    drafter = PredictionDrafter([5, 6, 1, 5, 6, 2, 5, 6, 3], max_n=2, min_n=2)
    drafter.begin(torch.tensor([0]), SamplingParams(0))
    drafter.extend([5, 6, 1, 5, 6, 2])  # follows to position 6
    drafter.extend([7, 5, 6])  # departs, then "5 6" again
    assert drafter.lookup(1) == [3]  # its occurrence at or after the cursor, not the first one


def decode_all(model, drafter, params, seed: int, new: int = 24) -> tuple[list[int], Stats]:
    stats = Stats()
    steps = decode(lossless.as_target(model), drafter, FixedK(6), torch.tensor([3, 9, 4]), params,
                   max_new_tokens=new, eos_token_ids=frozenset(), random=CoupledSource(seed), stats=stats)
    return [t for step in steps for t in step], stats


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prediction_changes_the_speed_not_the_text(temperature):
    """Greedy, or seeded (`CoupledSource`): the answer alone; a right prediction is accepted nearly whole, a
    wrong one costs only its rejected tokens."""
    model = tiny_llama(64, seed=3, init_scale=0.5)
    params = SamplingParams(temperature)
    alone, _ = decode_all(model, NoDrafter(), params, seed=1)
    right, stats = decode_all(model, with_prediction(NoDrafter(), alone), params, seed=1)
    assert right == alone
    if temperature == 0:
        assert stats.accepted_tokens >= len(alone) - 4 and stats.steps <= 5
    wrong, stats = decode_all(model, with_prediction(NoDrafter(), [(t + 1) % 64 for t in alone]), params, seed=1)
    assert wrong == alone and stats.drafted_tokens > 0


@pytest.mark.parametrize("name, broken", [("t1", False), ("top_k3", False), ("t1", True)])
def test_a_prediction_keeps_the_target_distribution(models, name, broken):
    """The chi-square test of test_lossless (N_SAMPLES sequences, significance ALPHA) with a prediction of
    the target's three most likely tokens after the prompt, which it drafts at every step; a verifier that
    recovers from the target's row instead of the residual is rejected."""
    target_model, _ = models
    params = lossless.PARAMS[name]
    with torch.inference_mode():
        prediction = target_model.generate(lossless.PROMPT[None], max_new_tokens=3, do_sample=False)[0, 2:].tolist()
    drafter = with_prediction(NoDrafter(), prediction)
    stats = Stats()
    for _, random in zip(range(200), lossless.one_generator(0)):
        for _ in decode(lossless.as_target(target_model), drafter, FixedK(lossless.K), lossless.PROMPT, params,
                        max_new_tokens=lossless.SEQ_LEN, eos_token_ids=frozenset(), random=random, stats=stats):
            pass
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0  # not vacuous
    verifier = ChainVerifier(sample=lossless.reject_without_residual) if broken else ChainVerifier()
    observed = lossless.sampled_counts(target_model, drafter, params, seed=97, verifier=verifier)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, params))
    assert (p < lossless.ALPHA) if broken else (p > lossless.ALPHA), f"prediction {name} broken={broken}: p = {p:.2e}"


def tiny_sampler():
    from specsample.api import SpecSampler
    from specsample.drafters import SuffixDrafter
    from specsample.models.llama import LlamaTarget
    from specsample.models.loading import LoadedModel

    model = tiny_llama(64, seed=3, init_scale=0.5)
    loaded = LoadedModel(model, tiny_tokenizer(64), "tiny", frozenset({1}), 0.0)
    return SpecSampler(loaded, LlamaTarget.from_hf(model), SuffixDrafter())


def test_stream_and_generate_batch_take_a_prediction():
    sampler = tiny_sampler()
    options = dict(max_new_tokens=16, temperature=0, k=4, chat=False)
    prompts = ["w5 w9 w12 w7", "w3 w4 w8"]
    alone = [sampler.generate(p, **options) for p in prompts]
    predicted = sampler.generate(prompts[0], prediction=alone[0].text, **options)
    assert predicted.token_ids == alone[0].token_ids
    assert predicted.stats.accepted_tokens >= 10
    batched = sampler.generate_batch(prompts, max_batch=2, temperature=0, k=4, chat=False, max_new_tokens=16,
                                     prediction=alone[0].text)
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    seeded = [sampler.generate(prompts[1], temperature=1.0, seed=5, max_new_tokens=16, k=4, chat=False,
                               prediction=text).token_ids for text in (None, alone[1].text, "w1 w2 w3 w4")]
    assert seeded[0] == seeded[1] == seeded[2]


@pytest.mark.parametrize("options, message", [
    ({"prediction": 5}, "a prediction must be a string, got int"),
    ({"prediction": "w5 \ud800"}, "the prediction is not valid UTF-8 text"),
    ({"prediction": "w6 " * 1000}, "the prediction is 1000 tokens, longer than any answer can be"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True"),
    ({"max_new_tokens": "3"}, "max_new_tokens must be an integer, got '3'"),
])
def test_bad_options_of_the_library_are_named(options, message):
    """The Python API checks what the server's schema and the command line check: a ValueError naming it,
    alone and in a batch (a prediction that is not text once failed deep in the tokenizer)."""
    sampler = tiny_sampler()
    with pytest.raises(ValueError, match=re.escape(message)):
        sampler.generate("w5 w9", chat=False, temperature=0, **{"max_new_tokens": 4, **options})
    with pytest.raises(ValueError, match=re.escape(message)):
        sampler.generate_batch(["w5 w9"], chat=False, temperature=0, **{"max_new_tokens": 4, **options})
