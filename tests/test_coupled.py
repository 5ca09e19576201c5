"""Coupled sampling: a seed gives the text plain decoding gives with it, whatever the drafter and K.

- Identity: for every drafter (none, ngram, suffix, a draft model, quantized,
  layerskip, head), K = 1, 4, 8 and `auto`, temperature 0.7 and 1 with and
  without top-p, SEEDS seeds of NEW_TOKENS tokens each are token-identical to
  plain decoding with the same seed, on a tiny target (vocabulary 64, 4 layers);
  each drafter is checked to draft, to be accepted and to be rejected, so the
  accepted, recovered and bonus paths all run.
- Exactness: test_lossless.py's exact enumeration (N_SAMPLES = 50,000
  sequences, chi-square at ALPHA = 1e-3), one seed per sequence, for a draft
  model and a point-mass drafter; numbers shared by every position are rejected.
- Broken couplings are caught by the identity check: numbers keyed by the
  engine's step instead of the output position, one stream read in order by
  drafter and verifier, and today's rejection sampling with a seeded generator.
  A drafter that draws from other numbers than the target's cannot break the
  identity (verification compares the target's own tokens); it is only accepted
  less often, which is what coupled drafting is for.
Seeds are fixed, so every outcome is deterministic.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import test_lossless as lossless
from test_lossless import models  # noqa: F401  (the fixture: target and draft model)
from specsample.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specsample.drafters.quantized import QuantizedDrafter
from specsample.engine import decode
from specsample.models import kernels, make_target
from specsample.models.loading import LoadedModel
from specsample.models.quantize import int8_target
from specsample.policy import FixedK
from specsample.sampling import (
    CoupledSource, GeneratorSource, RandomSource, SamplingParams, gumbel_max, numpy_position_noise, position_noise,
)
from specsample.stats import Stats
from specsample.verify import Verdict, coupled_tokens, coupled_verify
from test_head import head_drafter
from test_lossless_drafters import GREEDY_PROMPT, GREEDY_VOCAB

from conftest import drafting_cost_model, tiny_llama

SEEDS = range(16)
NEW_TOKENS = 32
PARAMS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1": SamplingParams(temperature=1.0),
    "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t1-top_p0.9": SamplingParams(temperature=1.0, top_p=0.9),
}
POLICIES = {"1": lambda: FixedK(1), "4": lambda: FixedK(4), "8": lambda: FixedK(8), "auto": drafting_cost_model}


# ---- the pure pieces -------------------------------------------------------------------------------


def test_position_noise_is_a_function_of_seed_and_position_alone():
    alone = position_noise(7, 5, 64)
    assert torch.equal(alone, position_noise(7, 5, 64))
    assert torch.equal(position_noise(7, 5, 16), alone[:16])  # a shorter vocabulary reads a prefix
    large = position_noise(7, 5, 49_153)  # the kernels split a large vocabulary among their threads
    assert torch.equal(large[:64], alone) and torch.equal(position_noise(7, 5, 16_383), large[:16_383])
    assert not torch.equal(alone, position_noise(7, 6, 64)) and not torch.equal(alone, position_noise(8, 5, 64))
    source = CoupledSource(7)
    assert torch.equal(source.at(3).noise(2, 64), alone)  # offset 2 from position 3
    assert position_noise(-1, 0, 4).shape == (4,)  # any int is a seed


@pytest.mark.skipif(not kernels.available(), reason="the kernels could not be built here")
@pytest.mark.parametrize("seed, position, vocab", [(7, 5, 64), (-3, 2**40, 49152), (2**70 + 1, 0, 37)])
def test_kernel_noise_is_the_numpy_stream_to_float32_rounding(seed, position, vocab):
    """The kernels' noise (vectors of 4 to 16 lanes, a tail of any length) and `numpy_position_noise` are
    one stream: within a few float32 ulps of each other, finite (u never 0 or 1)."""
    fast, slow = kernels.gumbel_noise(seed, position, vocab), numpy_position_noise(seed, position, vocab)
    assert fast.dtype == slow.dtype == torch.float32 and fast.shape == (vocab,)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(fast).all()


def test_position_noise_is_never_infinite():
    """200 positions of a 49,152-token vocabulary: 9.8 million numbers, none infinite (a u of 1 or 0 would
    make one token win, or lose, whatever its probability)."""
    noise = torch.stack([position_noise(1, n, 49152) for n in range(200)])
    assert torch.isfinite(noise).all()
    assert -3.5 < float(noise.min()) and float(noise.max()) < 17.5  # -log(-log(u)) over u in [2^-24, 1 - 2^-24]


def test_gumbel_max_over_position_numbers_draws_exactly():
    """Chi-square at ALPHA over 50,000 positions of one seed: the tokens follow `probs`, and a token of
    probability 0 is never drawn."""
    probs = torch.tensor([0.4, 0.25, 0.0, 0.15, 0.1, 0.06, 0.04, 0.0])
    noise = torch.stack([position_noise(3, n, len(probs)) for n in range(lossless.N_SAMPLES)])  # [n, vocab]
    counts = np.bincount(gumbel_max(probs, noise).numpy(), minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    p = chisquare(counts[probs > 0], probs[probs > 0].double().numpy() * lossless.N_SAMPLES).pvalue
    assert p > lossless.ALPHA, f"p = {p:.2e}"


def test_two_close_distributions_pick_the_same_token_at_least_as_often_as_the_weighted_jaccard():
    """Over shared numbers, Gumbel-max agrees with probability at least sum(min) / sum(max) =
    (1 - TV) / (1 + TV) (P-MinHash, Moulton and Jiang 2018); 20,000 positions, a 4-sigma margin."""
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.randn(50, generator=generator).mul(2).softmax(-1)
    draft_probs = (target_probs.log() + torch.randn(50, generator=generator) * 0.5).softmax(-1)
    noise = torch.stack([position_noise(11, n, 50) for n in range(20_000)])
    agree = float((gumbel_max(target_probs, noise) == gumbel_max(draft_probs, noise)).double().mean())
    jaccard = float(torch.minimum(target_probs, draft_probs).sum() / torch.maximum(target_probs, draft_probs).sum())
    assert agree > jaccard - 4 * (jaccard * (1 - jaccard) / 20_000) ** 0.5, (agree, jaccard)


def one_hot_rows(*tokens: int, vocab: int = 6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_coupled_verify_accepts_while_the_draft_is_the_targets_coupled_token():
    noise = torch.stack([position_noise(0, n, 6) for n in range(4)])  # [k + 1, vocab]
    target_probs = one_hot_rows(1, 2, 3, 4)  # point masses: the coupled tokens are 1, 2, 3, 4
    assert coupled_tokens(target_probs, noise).tolist() == [1, 2, 3, 4]
    assert coupled_verify(torch.tensor([1, 2, 0]), target_probs, noise) == Verdict(2, 3)  # recovered
    assert coupled_verify(torch.tensor([1, 2, 3]), target_probs, noise) == Verdict(3, 4)  # bonus
    assert coupled_verify(torch.tensor([5, 2, 3]), target_probs, noise) == Verdict(0, 1)
    spread = torch.full((4, 6), 1 / 6)
    target_tokens = coupled_tokens(spread, noise)
    assert coupled_verify(target_tokens[:3], spread, noise) == Verdict(3, int(target_tokens[3]))


def test_a_step_reads_the_numbers_of_its_output_positions():
    """Offset i of `at(p)` is position p + i, for drafting and verifying alike; rows are computed once
    per request and dropped once the engine has moved past them."""
    source = CoupledSource(5)
    probs = torch.rand(64, generator=torch.Generator().manual_seed(1))
    step = source.at(10)
    assert step.draw(probs, 3) == CoupledSource(5).at(13).draw(probs, 0) == int(gumbel_max(probs, position_noise(5, 13, 64)))
    step.draw(probs, 0)
    assert sorted(source.rows) == [10, 13]
    later = source.at(12)
    assert sorted(source.rows) == [13]
    assert later.noise(1, 64).data_ptr() == step.noise(3, 64).data_ptr()  # computed once


# ---- identity with plain decoding, every drafter -----------------------------------------------------


def noisy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A draft model that resembles `model`: its weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std())
    return draft


DRAFTERS: dict[str, Callable] = {
    "none": lambda loaded, target: NoDrafter(),
    "ngram": lambda loaded, target: NgramDrafter(),
    "suffix": lambda loaded, target: SuffixDrafter(),
    "draft-model": lambda loaded, target: DraftModelDrafter(make_target(
        LoadedModel(noisy(loaded.model, 0.05, seed=1), None, "tiny-draft", frozenset(), 0.0))),
    "quantized": lambda loaded, target: QuantizedDrafter(int8_target(loaded.model, target.max_length), target),
    "layerskip": lambda loaded, target: LayerSkipDrafter(target, loaded.model, skip=[1, 2]),
    "head": lambda loaded, target: head_drafter(loaded, target, subset=48),
}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return LoadedModel(tiny_llama(GREEDY_VOCAB, seed=3, layers=4), None, "tiny", frozenset(), 0.0)


def generate(target, drafter, policy, params: SamplingParams, random: RandomSource, stats: Stats) -> list[int]:
    steps = decode(target, drafter, policy, GREEDY_PROMPT, params, max_new_tokens=NEW_TOKENS,
                   eos_token_ids=frozenset(), random=random, stats=stats)
    return [t for step in steps for t in step]


@pytest.fixture(scope="module")
def plain(loaded) -> Callable[[str, int], list[int]]:
    """Plain decoding's tokens with a seed (no drafter, K = 0), computed once per (params, seed)."""
    target, cache = make_target(loaded), {}

    def tokens(params: str, seed: int) -> list[int]:
        if (params, seed) not in cache:
            cache[params, seed] = generate(target, NoDrafter(), FixedK(0), PARAMS[params], CoupledSource(seed), Stats())
        return cache[params, seed]

    return tokens


def differing_seeds(loaded, plain, drafter_name: str, params: str, policy: Callable, stats: Stats,
                    source: Callable[[int], RandomSource] = CoupledSource) -> list[int]:
    """The seeds whose tokens through the drafter differ from plain decoding's with the same seed."""
    target = make_target(loaded)
    drafter = DRAFTERS[drafter_name](loaded, target)
    return [seed for seed in SEEDS
            if generate(target, drafter, policy(), PARAMS[params], source(seed), stats) != plain(params, seed)]


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_a_seed_gives_plain_decodings_text_whatever_the_drafter_and_k(loaded, plain, drafter, params):
    stats = Stats()
    for k, policy in POLICIES.items():
        assert differing_seeds(loaded, plain, drafter, params, policy, stats) == [], f"{drafter} K={k} {params}"
    if drafter != "none":  # not vacuous: drafts are made, accepted and rejected
        assert 0 < stats.accepted_tokens < stats.drafted_tokens, (stats.accepted_tokens, stats.drafted_tokens)


class StepKeyed(CoupledSource):
    """Broken on purpose: the numbers are keyed by the engine's step count, not the output position.
    In plain decoding, one token a step, the two agree."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.steps = 0

    def at(self, position: int) -> CoupledSource:
        self.steps += 1
        return CoupledSource(self.seed, self.steps - 1)


class OneStream(CoupledSource):
    """Broken on purpose: Gumbel-max and token comparison, but the noise rows are read in order, row r
    the numbers of position r, so the numbers the target's token at a position gets depend on how
    many rows the drafter read before it. In plain decoding, which reads one row a token, the two agree."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.read = 0

    def at(self, position: int) -> CoupledSource:
        return self

    def noise(self, offset: int, vocab: int) -> torch.Tensor:
        self.read += 1
        return position_noise(self.seed, self.read - 1, vocab)


BROKEN_SOURCES: dict[str, Callable[[int], RandomSource]] = {
    "step-keyed": StepKeyed,
    "one-stream": OneStream,
    "rejection-sampling": lambda seed: GeneratorSource(torch.Generator().manual_seed(seed)),
}


@pytest.mark.parametrize("broken", list(BROKEN_SOURCES))
def test_the_identity_check_catches_a_broken_coupling(loaded, plain, broken):
    """Most seeds differ; with K = 0 the step-keyed and one-stream sources are plain decoding itself."""
    differ = differing_seeds(loaded, plain, "draft-model", "t1", POLICIES["4"], Stats(), BROKEN_SOURCES[broken])
    assert len(differ) > len(SEEDS) // 2, differ
    if broken != "rejection-sampling":
        assert differing_seeds(loaded, plain, "none", "t1", lambda: FixedK(0), Stats(), BROKEN_SOURCES[broken]) == []


class OtherNumbers(CoupledSource):
    """A drafter's view drawing from the numbers of another seed; the verifier keeps the request's."""

    def at(self, position: int) -> CoupledSource:
        return OtherNumbers(self.seed, position, self.rows)

    def draw(self, probs: torch.Tensor, offset: int) -> int:
        return int(gumbel_max(probs, position_noise(self.seed + 10**6, self.position + offset, probs.shape[-1])))


def test_a_drafter_drawing_from_other_numbers_keeps_the_text_but_is_accepted_less():
    """The output never depends on the drafter, so uncoupled drafting is no breach of the promise; it
    costs acceptance: a noisy draft model's tokens are accepted far less often."""
    model = tiny_llama(GREEDY_VOCAB, seed=3, layers=4)
    loaded_model = LoadedModel(model, None, "tiny", frozenset(), 0.0)
    reference = {seed: generate(make_target(loaded_model), NoDrafter(), FixedK(0), PARAMS["t1"], CoupledSource(seed),
                                Stats()) for seed in SEEDS}
    rates = {}
    for name, source in (("coupled", CoupledSource), ("other", OtherNumbers)):
        stats, target = Stats(), make_target(loaded_model)
        drafter = DRAFTERS["draft-model"](loaded_model, target)
        for seed in SEEDS:
            assert generate(target, drafter, FixedK(4), PARAMS["t1"], source(seed), stats) == reference[seed]
        rates[name] = stats.acceptance_rate
    assert rates["other"] < 0.75 * rates["coupled"], rates


# ---- exactness: the enumeration of test_lossless.py, one seed per sequence ------------------------------


def coupled_sources(seed: int) -> Iterator[RandomSource]:
    """One request's source per sample, the seeds (seed << 32) + 0, 1, 2, ..."""
    return (CoupledSource((seed << 32) + i) for i in itertools.count())


class SameNumbersEverywhere(CoupledSource):
    """Broken on purpose: every output position gets the numbers of position 0."""

    def at(self, position: int) -> CoupledSource:
        return self

    def noise(self, offset: int, vocab: int) -> torch.Tensor:
        return super().noise(0, vocab)


@pytest.mark.parametrize(("kind", "params"), [("draft-model", "t1"), ("draft-model", "t0.7-top_p0.9"),
                                              ("point-mass", "t1")])
def test_coupled_sampling_matches_target_distribution(models, kind, params):
    target_model, draft_model = models
    observed = lossless.sampled_counts(target_model, lossless.make_drafter(kind, draft_model), lossless.PARAMS[params],
                                       seed=1234, sources=coupled_sources)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, lossless.PARAMS[params]))
    assert p > lossless.ALPHA, f"{kind} {params}: p = {p:.2e}"


def test_numbers_shared_by_every_position_are_rejected(models):
    target_model, draft_model = models
    params = lossless.PARAMS["t1"]
    observed = lossless.sampled_counts(
        target_model, lossless.make_drafter("draft-model", draft_model), params, seed=1234,
        sources=lambda seed: (SameNumbersEverywhere((seed << 32) + i) for i in itertools.count()),
    )
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, params))
    assert p < lossless.ALPHA, f"p = {p:.2e}"


# ---- `specsample check --identity` ---------------------------------------------------------------------


def test_the_identity_check_passes_the_sampler_and_rejects_always_accept(tiny_dir, tiny_draft_dir):
    from specsample.verify.check import BROKEN, check_identity, load_sampler, render_identity

    sampler = load_sampler(str(tiny_dir), str(tiny_draft_dir))
    contexts, params = ("w5 w9 w7", "w12 w30 w2 w8"), SamplingParams(temperature=1.0, top_p=0.9)
    good = check_identity(sampler, FixedK(3), params, contexts=contexts, seeds=range(10), max_new_tokens=24)
    assert len(good.runs) == 20 and not good.rejected and good.stats.accepted_tokens > 0
    assert "PASS: all 20" in render_identity(good)
    bad = check_identity(sampler, FixedK(3), params, contexts=contexts, seeds=range(10), max_new_tokens=24,
                         verifier=BROKEN)
    assert bad.rejected and "REJECTED" in render_identity(bad, broken=True)


def test_the_identity_check_command_and_its_broken_self_test(capsys, tiny_dir, tiny_draft_dir):
    from test_cli import cli

    args = ["check", "--identity", "--model", str(tiny_dir), "--drafter", str(tiny_draft_dir), "--k", "4",
            "--seeds", "8", "--max-new-tokens", "16", "--context", "w5 w9 w7"]
    for extra, verdict in (([], "PASS"), (["--broken"], "REJECTED")):
        code, out, err = cli(capsys, *args, *extra)
        assert code == 0, out + err
        assert verdict in out and "identical to plain decoding" in out
    code, _, err = cli(capsys, *args, "--seeds", "0")
    assert code == 2 and "seeds" in err


# ---- the promise through the Python API and the server ------------------------------------------------


def test_a_seed_gets_plain_decodings_text_from_the_api_and_the_server(tiny_dir, tiny_draft_dir):
    import openai

    from specsample import SpecSampler
    from specsample.server import create_app
    from test_server import serving

    plain = SpecSampler.load(str(tiny_dir), "none")
    speculative = SpecSampler.load(str(tiny_dir), str(tiny_draft_dir))
    options = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, chat=False)
    expected = {seed: plain.generate("w5 w9 w7 w3", seed=seed, **options) for seed in range(6)}
    drafted = 0
    for seed, reference in expected.items():
        for k in (1, 4, "auto"):
            out = speculative.generate("w5 w9 w7 w3", seed=seed, k=k, **options)
            assert out.token_ids == reference.token_ids, (seed, k)
            drafted += out.stats.drafted_tokens
    assert drafted > 0
    with serving(create_app(speculative, k=4)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for seed in range(3):
            response = client.completions.create(model="tiny", prompt="w5 w9 w7 w3", max_tokens=16, temperature=0.9,
                                                 top_p=0.95, seed=seed)
            assert response.choices[0].text == expected[seed].text
