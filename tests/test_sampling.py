import math

import pytest
import torch
from scipy.stats import chisquare
from hypothesis import given, settings, strategies as st

from specsample.sampling import (
    CoupledSource, GeneratorSource, SamplingParams, argmax, check_seed, draw_draft_token, greedy_tokens, make_generator,
    probs_from_logits, sample,
)
from specsample.verify.chain import greedy_verify
from specsample.verify.tree import greedy_verify_tree


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]


SPECIAL = st.sampled_from([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 40),
    values=st.lists(st.one_of(SPECIAL, st.floats(-3, 3, width=32)), min_size=160, max_size=160),
    double=st.booleans(),
    transpose=st.booleans(),
)
def test_argmax_is_torchs_argmax_ties_infinities_and_nans_included(rows, width, values, double, transpose):
    """The numpy argmax picks what torch.argmax(-1) picks: the first of tied maxima, a NaN as the largest,
    for 1-D and 2-D, float32 and float64, contiguous or not."""
    scores = torch.tensor((values * (rows * width // 160 + 1))[: rows * width]).view(rows, width)
    scores = scores.double() if double else scores
    scores = scores.t().contiguous().t() if transpose else scores  # same values, column-major strides
    assert argmax(scores).tolist() == scores.argmax(-1).tolist()
    assert int(argmax(scores[0])) == int(scores[0].argmax())


def test_argmax_of_other_tensors_falls_back_to_torch():
    half = torch.tensor([[0.5, 2.0, 2.0]], dtype=torch.bfloat16)
    grad = torch.tensor([1.0, 3.0, 2.0], requires_grad=True)
    assert argmax(half).tolist() == [1] and int(argmax(grad)) == 1


@pytest.mark.parametrize("source", [GeneratorSource(make_generator(7)), CoupledSource(7)])
def test_a_greedy_draft_token_is_its_point_mass_and_draws_nothing(source):
    """At temperature 0 a draft token is the point mass's token and no random number is used (a
    generator's state stays where it was); when sampling it is the source's draw."""
    probs = probs_from_logits(torch.tensor([0.3, 2.5, -1.0, 2.4]), SamplingParams(temperature=0))
    before = make_generator(7).get_state()
    assert draw_draft_token(probs, 0, source, SamplingParams(temperature=0)) == 1
    if isinstance(source, GeneratorSource):
        assert torch.equal(source.generator.get_state(), before)
    else:
        assert source.rows == {}
    sampled = torch.tensor([0.0, 0.0, 1.0, 0.0])
    assert draw_draft_token(sampled, 0, source, SamplingParams(temperature=1)) == 2


def test_temperature_one_is_softmax():
    logits = torch.randn(5, 10)
    assert torch.allclose(probs_from_logits(logits, SamplingParams()), logits.softmax(-1))


@pytest.mark.parametrize("temperature", [5e-324, 1e-200, 1e-46, 1e-45, 1e-39, 1e-30])
def test_a_tiny_temperature_is_the_limit_not_nan(temperature):
    """logits / T overflows to inf below about 1e-37 here, and softmax then gives NaN; below about 1.4e-45
    T is 0 in float32 and the largest logit's 0 / 0 is NaN too. The limit is the argmax's point mass, or
    an even split over a tie for the largest."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5], [2.0, -1.0, 2.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]]))


@pytest.mark.parametrize("temperature", [math.inf, math.nan, -1e-300])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


def test_top_k_keeps_k_tokens():
    probs = probs_from_logits(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = probs_from_logits(logits, SamplingParams(top_p=0.8))
    assert (probs > 0).tolist() == [True, True, False, False]
    assert probs[0].item() == pytest.approx(0.5 / 0.8)


def full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_top_p` by its definition, over the whole vocabulary: canonical order (a stable sort), float64
    sums of the tokens before each, one after another."""
    top, index = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = torch.nn.functional.pad(top.double().cumsum(-1)[..., :-1], (1, 0))
    kept = torch.zeros_like(probs).scatter_(-1, index, top.masked_fill(mass_before >= top_p, 0.0))
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.3])  # the kept set within 256 candidates, within 4,096, neither
def test_top_p_among_candidates_is_top_p_over_the_whole_vocabulary(scale):
    from specsample.sampling import TOP_P_CANDIDATES, _top_p

    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(3)) * scale
    probs = logits.softmax(-1)
    kept = _top_p(probs, 0.9)
    assert torch.equal(kept, full_sort_top_p(probs, 0.9))
    assert ((kept > 0).sum(-1) > TOP_P_CANDIDATES).any() == (scale < 8)  # past the first candidates
    assert ((kept > 0).sum(-1) > 16 * TOP_P_CANDIDATES).any() == (scale < 1)  # past the second
    for row in range(5):  # a row's set does not depend on the others, which may need more candidates
        assert torch.equal(_top_p(probs[row : row + 1], 0.9), kept[row : row + 1])


def test_top_p_breaks_ties_by_token_id_wherever_the_candidates_end():
    """1,000 tokens of equal probability, more than the first candidates hold (topk takes any of them),
    with the edge of the kept set among them: the lowest ids are kept, as a stable sort of the whole
    vocabulary keeps them."""
    from specsample.sampling import _top_p

    weights = torch.rand(1, 65536, generator=torch.Generator().manual_seed(0)) * 0.5
    weights[0, 30000:31000] = 1.0
    weights[0, 65000] = 200.0
    total = float(weights.sum())
    probs = weights / total
    top_p = (200.0 + 490.5) / total  # the big token and 491 of the tied ones
    kept = _top_p(probs, top_p)
    assert torch.equal(kept, full_sort_top_p(probs, top_p))
    assert (kept > 0).sum() == 492 and kept[0, 65000] > 0 and kept[0, 30000:30491].gt(0).all()


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = probs_from_logits(logits, SamplingParams(min_p=0.25))
    assert (probs > 0).tolist() == [True, True, True, False]


def test_matches_transformers_logits_warpers():
    from transformers.generation.logits_process import (
        MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)
    warped = logits
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        warped = warper(None, warped)
    assert torch.allclose(probs_from_logits(logits, params), warped.softmax(-1), atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_probabilities_are_a_distribution(seed, temperature, top_k, top_p, min_p):
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed)) * 4
    probs = probs_from_logits(logits, SamplingParams(temperature, top_k, top_p, min_p))
    assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-5)
    assert (probs >= 0).all()
    assert (probs.argmax(-1) == logits.argmax(-1)).all()  # the most likely token always survives


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": None}, "top_p must be a number"),
    ],
)
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_numpy_numbers_are_their_values():
    import numpy as np

    params = SamplingParams(np.float32(0.5), np.int64(3), np.float64(0.9))
    assert params == SamplingParams(0.5, 3, 0.9) and type(params.top_k) is int
    assert check_seed(np.uint64(2**64 - 1)) == 2**64 - 1 and type(check_seed(np.int64(5))) is int


@pytest.mark.parametrize("seed", [5.0, "5", True, -1, 2**64])
def test_a_seed_that_is_not_a_64_bit_unsigned_integer_is_refused(seed):
    with pytest.raises(ValueError, match="seed must be an integer"):
        check_seed(seed)


def test_seeded_generators_repeat():
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_sample_draws_each_token_with_its_probability():
    """Chi-square at significance 1e-3 over 50,000 draws from unnormalized weights, zeros never drawn;
    the same counts reject a distribution with one token 10% more likely (the test can see that much)."""
    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.5, 2.5, 0.0, 3.0])
    expected = weights.double().numpy() / float(weights.sum()) * 50_000
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(weights, generator) for _ in range(50_000)]), minlength=8)
    assert counts[weights == 0].sum() == 0
    nonzero = weights > 0
    observed, expected = counts[nonzero].double().numpy(), expected[nonzero.numpy()]
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3
    skewed = expected.copy()
    skewed[0] *= 1.1
    skewed *= observed.sum() / skewed.sum()
    assert chisquare(observed, skewed).pvalue < 1e-3


def test_sample_finds_tokens_across_blocks_of_its_two_level_sum():
    """Weights in several blocks of `SAMPLE_BLOCK` tokens, a partial last block and empty blocks between:
    chi-square at 1e-3 over 50,000 draws, zeros never drawn, nor anything past the vocabulary."""
    from specsample.sampling import SAMPLE_BLOCK

    vocab = 3 * SAMPLE_BLOCK + 17
    weights = torch.zeros(vocab)
    tokens = [0, SAMPLE_BLOCK - 1, 2 * SAMPLE_BLOCK + 5, vocab - 1]  # block 1 is empty
    weights[tokens] = torch.tensor([1.0, 2.0, 0.5, 1.5])
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([sample(weights, generator) for _ in range(50_000)]), minlength=vocab)
    assert counts.shape[0] == vocab and counts[weights == 0].sum() == 0
    observed = counts[tokens].double().numpy()
    expected = weights[tokens].double().numpy() / float(weights.sum()) * observed.sum()
    assert chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_k=3),
                                    SamplingParams(1.0, min_p=0.5), SamplingParams(1e39)])
def test_a_row_holding_inf_gets_its_limit_and_nan_is_refused(params):
    """A float16 overflow makes a logit +inf: the row's limit is an even split over its +inf entries (softmax
    alone gave NaN everywhere, and `sample` an arbitrary token); other rows keep their own."""
    inf = math.inf
    probs = probs_from_logits(torch.tensor([[0.0, inf, 1.0, inf], [0.0, -inf, 1.0, 2.0]]), params)
    assert probs[0].tolist() == [0.0, 0.5, 0.0, 0.5]
    assert not probs[1].isnan().any() and probs[1, 1] == 0 and probs[1].sum().item() == pytest.approx(1.0)
    for bad in ([math.nan, 0.0, 1.0], [-inf, -inf, -inf]):
        with pytest.raises(ValueError, match="no distribution to sample from"):
            probs_from_logits(torch.tensor(bad), params)


def test_greedy_decoding_refuses_nan_logits_too():
    """argmax counts a NaN as the largest: a row holding one gave its first NaN's token silently (on the
    bundled model token 0, the end of the text), where sampling refuses. Every greedy path refuses it."""
    bad = torch.tensor([[0.0, 1.0, 2.0], [0.0, math.nan, 2.0]])  # [2, vocab]: the second row holds NaN
    with pytest.raises(ValueError, match="hold NaN"):
        probs_from_logits(bad, SamplingParams(0))
    with pytest.raises(ValueError, match="hold NaN"):
        greedy_verify(torch.tensor([2]), bad)
    with pytest.raises(ValueError, match="hold NaN"):
        greedy_verify_tree(torch.tensor([2]), torch.tensor([-1]), bad)
    assert greedy_tokens(bad[:1]).tolist() == [2]


def test_a_temperature_beyond_float32_is_near_uniform_over_the_finite_logits():
    """T = 1e39 is a float32 inf: -inf / inf was NaN and the -inf token could be drawn."""
    probs = probs_from_logits(torch.tensor([0.0, -math.inf, 1.0, 50.0]), SamplingParams(1e39))
    assert probs.tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3])
