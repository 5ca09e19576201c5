"""`specsample check`: the certificate passes the real sampler and rejects one that always accepts.

Tiny target and draft model (vocabulary 64), fixed seeds, family-wise
significance level ALPHA = 1e-3 (Bonferroni over the tests of a certificate).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import pytest

from specsample.stats import Stats, Step
from specsample.verify.check import ALPHA, BROKEN, certify, chi_square_p, exercised, load_sampler
from specsample.policy import FixedK
from specsample.sampling import SamplingParams

from test_cli import cli

CONTEXTS = ("w5 w9 w7", "w12 w30 w2 w8")


@pytest.fixture(scope="module")
def similar_draft_dir(tiny_dir, tmp_path_factory) -> Path:
    """A draft model that resembles the target (its weights plus 10% Gaussian noise), so that drafts are
    accepted often and the certificate sees accepted, recovered and bonus tokens alike."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.1 * weight.std())
    directory = tmp_path_factory.mktemp("tiny-similar-draft")
    model.save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sampler(tiny_dir, similar_draft_dir):
    return load_sampler(str(tiny_dir), str(similar_draft_dir))


def test_chi_square_p_edge_cases():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    assert chi_square_p(np.array([500.0, 300, 200, 0]), probs) > 0.99
    assert chi_square_p(np.array([500.0, 300, 199, 1]), probs) == 0.0  # an impossible token was drawn
    assert chi_square_p(np.array([0.0, 40, 0]), np.array([0.0, 1.0, 0.0])) == 1.0  # greedy: a point mass
    assert chi_square_p(np.array([700.0, 200, 100, 0]), probs) < ALPHA


def test_a_thinly_spread_distribution_is_still_tested():
    """Every token expected below 5 times (100 samples over 49,152 near-uniform tokens, a temperature of
    10,000): samples all on one token are rejected, samples spread as drawn from the distribution pass,
    and the level holds (about ALPHA of 2,000 honest draws rejected at ALPHA)."""
    rng = np.random.default_rng(0)
    vocab = 49_152
    probs = rng.uniform(0.9, 1.1, vocab)
    probs /= probs.sum()
    stuck = np.zeros(vocab)
    stuck[123] = 100
    assert chi_square_p(stuck, probs) < 1e-12
    p_values = np.array([chi_square_p(rng.multinomial(100, probs).astype(float), probs) for _ in range(200)])
    assert (p_values < 0.05).mean() < 0.12 and p_values.min() > 0  # honest draws: tested, not rejected
    peaked = probs**8  # a sampler that skips the temperature: the likelier tokens likelier still
    drawn = rng.multinomial(2_000, peaked / peaked.sum()).astype(float)
    assert chi_square_p(drawn, probs) < ALPHA


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=5)], ids=["t1", "t0.8-top_k5"])
def test_certificate_passes_the_sampler_and_rejects_always_accept(sampler, params):
    good = certify(sampler, FixedK(3), params, contexts=CONTEXTS, samples=300, seed=1)
    assert good.stats.acceptance_rate > 0.4 and len(good.tests) >= 3
    assert good.notes == ["300 token pairs a context detect only gross deviations (300 missed a recovery drawn from the "
                          "target instead of the residual, 1,000 caught it): use --samples 1000 or more"]
    assert not good.rejected, [(t.position, t.p_value) for t in good.tests]
    bad = certify(sampler, FixedK(3), params, contexts=CONTEXTS, samples=300, seed=1, verifier=BROKEN)
    assert bad.rejected, [(t.position, t.p_value) for t in bad.tests]


def test_a_check_whose_drafts_are_hardly_ever_accepted_says_so():
    """6,012 drafted and none accepted (an `ngram` draft the target's top-p gives no probability) had printed
    PASS beside "acceptance rate 0.000" and nothing more: a certificate of the recovery alone."""
    def stats(drafted: int, accepted: int) -> Stats:
        out = Stats()
        out.record(Step(drafted, accepted, accepted + 1, 0.0, 0.0))
        return out

    assert exercised(stats(0, 0)) == ["the drafter proposed no tokens: only plain decoding was exercised"]
    (note,) = exercised(stats(6012, 0))
    assert note.startswith("0 of 6012 draft tokens were accepted: the accept rule was hardly exercised")
    assert exercised(stats(100, 4)) and exercised(stats(100, 5)) == []


def test_greedy_certificate(sampler):
    params = SamplingParams(0.0)
    assert not certify(sampler, FixedK(3), params, contexts=CONTEXTS, samples=50).rejected
    assert certify(sampler, FixedK(3), params, contexts=CONTEXTS, samples=50, verifier=BROKEN).rejected


def test_check_command_and_its_broken_self_test(capsys, tiny_dir, tiny_draft_dir):
    args = ["check", "--model", str(tiny_dir), "--drafter", str(tiny_draft_dir), "--k", "2", "--samples", "300",
            "--context", CONTEXTS[0], "--seed", "3"]
    for extra, verdict in (([], "PASS"), (["--broken"], "REJECTED")):
        code, out, err = cli(capsys, *args, *extra)
        assert code == 0, out + err
        assert verdict in out and "first token" in out


def test_check_rejects_bad_arguments(capsys, tiny_dir):
    code, _, err = cli(capsys, "check", "--model", str(tiny_dir), "--samples", "0", "--drafter", "none")
    assert code == 2 and "samples" in err
    code, _, err = cli(capsys, "check", "--model", str(tiny_dir), "--min-p", "1.5", "--drafter", "none")
    assert code == 2 and "min_p must be in [0, 1]" in err
    code, _, err = cli(capsys, "check", "--model", str(tiny_dir), "--drafter", "none", "--context", "")
    assert code == 2 and "a --context is empty" in err
    code, _, err = cli(capsys, "check", "--model", "", "--drafter", "none")
    assert code == 2 and "the model path is empty" in err
    code, _, err = cli(capsys, "check", "--model", str(tiny_dir), "--drafter", "none", "--broken")
    assert code == 2 and "--broken needs a drafter" in err and err.count("\n") == 1
    code, _, err = cli(capsys, "check", "--model", str(tiny_dir), "--drafter", "ngram", "--broken", "--samples", "20",
                       "--context", "w5 w6")  # nothing to look up in a context of two words
    error = err.rstrip("\n").replace("\r", "\n").split("\n")[-1]  # after the progress bar's, which it clears
    assert code == 2 and error.startswith("specsample: error: --broken needs") and "proposed no tokens" in error


def test_check_takes_min_p_as_generate_does(capsys, tiny_dir, tiny_draft_dir):
    """The certificate's exact probabilities use the same min_p as the sampled path: it passes, and a
    sampler that always accepts is rejected."""
    args = ["check", "--model", str(tiny_dir), "--drafter", str(tiny_draft_dir), "--k", "2", "--samples", "300",
            "--context", CONTEXTS[0], "--seed", "3", "--min-p", "0.2"]
    for extra, verdict in (([], "PASS"), (["--broken"], "REJECTED")):
        code, out, err = cli(capsys, *args, *extra)
        assert code == 0 and verdict in out, out + err


@pytest.mark.parametrize("layers", [(), (1,)])
def test_prefix_cache_gives_the_same_logits_as_a_fresh_prefill(tiny_dir, layers):
    from specsample.verify.check import PrefixCache
    from specsample.models import load_model, make_target

    loaded = load_model(tiny_dir)
    cached, fresh = PrefixCache(make_target(loaded)), make_target(loaded)
    prefix, tail = torch.tensor([5, 9, 7, 3]), torch.tensor([12, 30])
    cached.prefill(prefix)
    cached.record_features(layers)  # a head reading layer outputs, built after the first prefill
    fresh.record_features(layers)
    cached.prefill(prefix)
    cached.score(torch.tensor([40, 41, 42]))
    cached.prefill(prefix)  # answered by rolling back
    assert cached.length == len(prefix)
    fresh.prefill(prefix)
    for asked in {(), layers}:  # what drafters reading features see
        assert torch.equal(cached.features(0, len(prefix), asked), fresh.features(0, len(prefix), asked))
    assert torch.allclose(cached.score(tail), fresh.score(tail))
