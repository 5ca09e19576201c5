"""The `quantized` drafter: an int8 copy of the target drafts, losslessly.

The int8 panel kernel is checked against the product of the dequantized
weights (int8 * scale), and the int8 copy against the float model with those
weights. The chi-square test reuses test_lossless.py's machinery (N_SAMPLES
samples, significance level ALPHA); greedy output is compared with
transformers generate, as for layerskip. Drafter tests run with the C++
kernels and again on the torch path (`packed` fixture of test_llama_backend);
the chi-square test's copy fills its cache by its own prefill, the greedy
tests' copy adopts the target's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import test_lossless as lossless
from test_lossless import models  # noqa: F401  (the fixture: target and draft model)
from specsample.drafters.quantized import QuantizedDrafter, quantized_drafter
from specsample.models import kernels
from specsample.models.llama import Linear
from specsample.models.loading import LoadedModel
from specsample.models.hf import TransformersTarget
from specsample.models.quantize import Int8Linear, int8_target
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats
from test_layerskip import generate_greedy, greedy_with
from test_llama_backend import MODELS, packed, prompt, reference_logits  # noqa: F401  (packed: a fixture)
from test_lossless_drafters import GREEDY_PROMPT, GREEDY_VOCAB

from conftest import drafting_cost_model, needs_kernels, tiny_llama


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The reference int8 weight [out, in]: each row rounded to a multiple of its absmax / 127."""
    scales = weight.abs().amax(1, keepdim=True) / 127  # [out, 1]
    return (weight / scales).round() * scales


@needs_kernels
@pytest.mark.parametrize("rows", range(1, 17))
def test_int8_gemm_kernel_is_the_dequantized_product(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(100, 48, generator=gen), torch.randn(100, generator=gen)  # a partial last panel
    x = torch.randn(rows, 48, generator=gen)
    packed_weight, scales = kernels.pack_int8(weight)
    assert packed_weight.dtype == torch.int8 and packed_weight.shape == (4, 48, 32)
    reference = dequantized(weight.double())  # [100, 48]
    torch.testing.assert_close(kernels.unpack(packed_weight, 100).double() * scales[:, None].double(), reference)
    product = x.double() @ reference.T  # [rows, 100]
    torch.testing.assert_close(kernels.matmul(x, packed_weight, 100, scales=scales).double(), product, rtol=0, atol=1e-5)
    with_bias = kernels.matmul(x, packed_weight, 100, bias, scales=scales).double()
    torch.testing.assert_close(with_bias, product + bias.double(), rtol=0, atol=1e-5)
    acc = torch.randn(rows, 100, generator=gen)
    expected = acc.double() + product
    torch.testing.assert_close(kernels.matmul(x, packed_weight, 100, out=acc, scales=scales).double(), expected, rtol=0, atol=1e-5)
    rows_of = torch.tensor([0, 31, 32, 99])
    torch.testing.assert_close(kernels.unpack_rows(packed_weight, rows_of, scales).double(), reference[rows_of])


@torch.no_grad()
def dequantized_model(model):
    """A copy of `model` whose linear maps, the LM head included, hold their int8 weights as floats
    (a tied embedding with them)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(dequantized(module.weight))
    return model


@needs_kernels
@pytest.mark.parametrize("name", ["llama-untied", "llama-tied", "llama-mha-odd-sizes", "qwen2-bias"])
def test_int8_quantizedon_the_kernels_is_the_dequantized_model(name):
    model = MODELS[name]()
    ids = prompt(vocab=model.config.vocab_size)
    ref = reference_logits(dequantized_model(model), ids)
    quantized = int8_target(model, max_length=64)
    assert quantized.kernels and quantized.lm_head.weight.dtype == torch.int8
    assert all(w.weight.dtype == torch.int8 for layer in quantized.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    quantized.prefill(ids[:5])
    logits = torch.cat([quantized.score(ids[5:6]), quantized.score(ids[6:14]), quantized.score(ids[14:])])
    torch.testing.assert_close(logits, ref[5:], rtol=0, atol=1e-4)
    assert (logits - reference_logits(model, ids)[5:]).abs().max() > 1e-3  # it is quantized


def test_quantized_keeps_the_target_distribution(models, packed):
    target_model, _ = models
    params = lossless.PARAMS["t1"]
    observed = lossless.sampled_counts(target_model, QuantizedDrafter(int8_target(target_model)), params, seed=77)
    p = lossless.chi_square_p(observed, lossless.exact_distribution(target_model, params))
    assert p > lossless.ALPHA, f"quantized: p = {p:.2e}"


def test_the_quantizedstarts_from_the_target_cache(packed):
    model = tiny_llama(GREEDY_VOCAB, seed=3)
    target = lossless.as_target(model)
    drafter = quantized_drafter(LoadedModel(model, None, "tiny", frozenset(), 0.0), target)
    target.prefill(GREEDY_PROMPT[:-1])
    drafter.begin(GREEDY_PROMPT, SamplingParams(temperature=0))
    assert drafter.model.length == 0  # nothing before the first draft
    drafter.propose(3, GeneratorSource(torch.Generator().manual_seed(0)))
    cached = len(GREEDY_PROMPT) - 1
    assert drafter.model.length == cached + 3
    # Its own prefill would give the int8 copy's values, not the target's.
    assert torch.equal(drafter.model.v_cache[:, :, :cached], target.v_cache[:, :, :cached].to(drafter.model.dtype))


def test_the_quantized_copy_catches_up_from_the_target_cache(packed):
    model = tiny_llama(GREEDY_VOCAB, seed=3)
    target = lossless.as_target(model)
    drafter = quantized_drafter(LoadedModel(model, None, "tiny", frozenset(), 0.0), target)
    source = GeneratorSource(torch.Generator().manual_seed(0))
    target.prefill(GREEDY_PROMPT[:-1])
    drafter.begin(GREEDY_PROMPT, SamplingParams(temperature=0))
    drafter.propose(2, source)
    text = GREEDY_PROMPT.tolist()
    for token in (1, 2, 3):  # a step that accepted nothing, then two plain steps: tokens the copy did not draft
        target.score(torch.tensor(text[-1:]))
        drafter.observe([token])
        text.append(token)
    own = drafter.model.length
    assert own == len(GREEDY_PROMPT)  # the prompt and its first draft token's pending
    drafter.propose(1, source)
    cached = len(text) - 1
    assert drafter.model.length == cached + 1
    # Their own pass would give the int8 copy's values; the positions the copy held are its own.
    adopted = target.v_cache[:, :, own:cached].to(drafter.model.dtype)
    assert torch.equal(drafter.model.v_cache[:, :, own:cached], adopted)
    assert not torch.equal(drafter.model.v_cache[:, :, own - 1], target.v_cache[:, :, own - 1])


@pytest.mark.parametrize("policy", [lambda: FixedK(3), drafting_cost_model])
def test_greedy_output_is_transformers_generate(policy, packed):
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


def test_a_backend_without_quantized_copies_is_refused():
    """The copy is the backend's to make (`QuantizedCopies`): a target on transformers is refused in one line."""
    model = tiny_llama(GREEDY_VOCAB, seed=3)
    loaded = LoadedModel(model, None, "tiny", frozenset(), 0.0)
    with pytest.raises(ValueError, match="quantized needs a target backend that makes a quantized copy of itself"):
        quantized_drafter(loaded, TransformersTarget(model))


@needs_kernels
def test_the_quantized_copy_is_made_from_the_target_s_own_weights_as_from_the_model_s():
    """The fast backend's int8 copy comes from its own packed float32 weights, not from a second float32
    target built from the transformers model on the way (a model's size more at its peak): logits equal."""
    from specsample.models.llama import LlamaTarget

    model = tiny_llama(vocab_size=64, layers=2)
    target = LlamaTarget.from_hf(model, max_length=64)
    assert target.source is model and target.copy_file is None
    ids = torch.arange(12) % 64
    copies = [target.quantized_copy(), int8_target(model, 64)]
    for copy_ in copies:
        copy_.prefill(ids[:-3])
    assert torch.equal(copies[0].score(ids[-3:]), copies[1].score(ids[-3:]))
