"""The `quantized` drafter: an int8 copy of the target drafts, losslessly.

The chi-square test reuses test_lossless.py's machinery (N_SAMPLES samples,
significance level ALPHA); greedy output is compared with transformers
generate, as for layerskip.
"""

from __future__ import annotations

import pytest
import torch

import test_lossless as lossless
from test_lossless import models  # noqa: F401  (the fixture: target and draft model)
from specsample.drafters.quantized import QuantizedDrafter, quantized_drafter
from specsample.models.llama import Linear
from specsample.models.loading import LoadedModel
from specsample.models.quantize import Int8Linear, int8_target
from specsample.policy import CostModelK, FixedK
from specsample.stats import Stats
from test_layerskip import generate_greedy, greedy_with
from test_lossless_drafters import GREEDY_PROMPT, GREEDY_VOCAB

from conftest import tiny_llama


def test_quantized_keeps_the_target_distribution(models):
    target_model, _ = models
    params = lossless.PARAMS["t1"]
    observed = lossless.sampled_counts(target_model, QuantizedDrafter(int8_target(target_model)), params, seed=77)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, params))
    assert p > lossless.ALPHA, f"quantized: p = {p:.2e}"


@pytest.mark.parametrize("policy", [lambda: FixedK(3), CostModelK])
def test_greedy_output_is_transformers_generate(policy):
    model = tiny_llama(GREEDY_VOCAB, seed=3)
    stats = Stats()
    assert greedy_with("quantized", model, policy(), stats) == generate_greedy(model, GREEDY_PROMPT, 60)
    assert stats.accepted_tokens > 0


def test_int8_product_is_within_the_rounding_bound():
    """Each weight is off by at most half its channel's scale, so each output by at most
    sum_i |x_i| * scale / 2 (plus bfloat16 rounding of the activations and the sum)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen)  # [out, in]
    x = torch.randn(3, 64, generator=gen).bfloat16()
    linear = Int8Linear.quantize(Linear.from_weight(weight, None, torch.bfloat16, packed=False))
    exact = x.float() @ weight.t().bfloat16().float()  # [3, 48]
    bound = x.float().abs().sum(-1, keepdim=True) * linear.scales.float() / 2  # [3, 48]
    error = (linear(x).float() - exact).abs()
    assert (error <= bound * 1.05 + 0.02 * exact.abs()).all()
    assert error.max() > 0  # it is quantized


def test_a_model_the_fast_backend_refuses_is_refused():
    model = tiny_llama(GREEDY_VOCAB, seed=3)
    model.config.hidden_act = "gelu"
    loaded = LoadedModel(model, None, "tiny", frozenset(), 0.0)
    with pytest.raises(ValueError, match="quantized needs a model the fast backend supports"):
        quantized_drafter(loaded, lossless.as_target(tiny_llama(GREEDY_VOCAB, seed=3)))
