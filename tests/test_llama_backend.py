"""The fast Llama-family backend reproduces transformers: logits, cache rollback, greedy decoding.

Tiny random Llama, Qwen2, Qwen3 and Mistral models (grouped-query attention, tied and
untied heads, biases, Qwen3's per-head query and key norms, llama3 rope scaling) are compared with the transformers
model they were copied from, with the packed-weight kernel and with the
torch.mm fallback. The slow test does the same on the bundled SmolLM2.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specsample.models import kernels, llama
from specsample.models.llama import LlamaTarget, UnsupportedModel

ATOL = 1e-4
COMMON = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, bos_token_id=None,
    eos_token_id=None, pad_token_id=None,
)


def tiny(kind: str = "llama", seed: int = 0, **overrides):
    """A random 2-layer model of the given family, weights large enough for peaked logits."""
    torch.manual_seed(seed)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[kind]
    model = model_cls(config_cls(**{**COMMON, **overrides})).eval()
    if kind == "qwen2":  # transformers initialises biases to zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if kind == "qwen3":  # and the per-head norms to one: make them matter too
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    if kind == "gemma3":  # Gemma's norms scale by 1 + weight, the weights starting at zero: make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 1.0)
    return model


MODELS = {
    "llama-untied": lambda: tiny("llama", tie_word_embeddings=False),
    "llama-tied": lambda: tiny("llama", seed=1, tie_word_embeddings=True),
    "llama-mha-odd-sizes": lambda: tiny(
        "llama", seed=2, hidden_size=40, num_attention_heads=5, num_key_value_heads=5, intermediate_size=72,
        vocab_size=70, head_dim=16,
    ),
    "llama3-rope": lambda: tiny(
        "llama", seed=3, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
    "yarn-rope": lambda: tiny(
        "llama", seed=6, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
    "linear-rope": lambda: tiny("llama", seed=7, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2-bias": lambda: tiny("qwen2", seed=4, tie_word_embeddings=True),
    # head_dim 24 against hidden / heads 16: the query heads are wider than the residual stream
    "qwen3-qk-norm": lambda: tiny("qwen3", seed=8, head_dim=24, tie_word_embeddings=True),
    "mistral": lambda: tiny("mistral", seed=5, sliding_window=None),
    # six layers: five local (a window of 6 positions, rotary base 10,000) and a global one; GELU, post-norms,
    # per-head norms, scores scaled by 1 / sqrt(24) for heads of 16, embeddings by sqrt(hidden)
    "gemma3": lambda: tiny(
        "gemma3", seed=9, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(params=[True, False], ids=["kernel", "torch-mm"])
def packed(request, monkeypatch) -> bool:
    """Run a test with the packed-weight kernel and again with the torch.mm fallback."""
    if request.param and not kernels.available():
        pytest.skip("the gemm kernel could not be built here")
    if not request.param:
        monkeypatch.setattr(kernels, "available", lambda: False)
    return request.param


@torch.inference_mode()
def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0].float()  # [n, vocab]


def prompt(n: int = 23, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def greedy_reference(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """transformers greedy decoding of `new` tokens after `ids` (an explicit mask: no token is padding)."""
    with torch.inference_mode():
        out = model.generate(
            ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=new,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(ids):]


@pytest.mark.parametrize("name", MODELS)
def test_score_in_chunks_matches_transformers(name, packed):
    model = MODELS[name]()
    ids = prompt(vocab=model.config.vocab_size)
    ref = reference_logits(model, ids)
    target = LlamaTarget.from_hf(model, max_length=64)
    assert target.vocab_size == model.config.vocab_size
    target.prefill(ids[:5])
    assert target.length == 5
    chunks = [target.score(ids[5:6]), target.score(ids[6:14]), target.score(ids[14:])]
    assert target.length == len(ids)
    torch.testing.assert_close(torch.cat(chunks), ref[5:], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias", "qwen3-qk-norm", "gemma3"])
def test_rollback_and_rescore(name, packed):
    model = MODELS[name]()
    ids = prompt()
    other = prompt(seed=1)
    ref = reference_logits(model, ids)
    target = LlamaTarget.from_hf(model, max_length=64)
    target.prefill(ids[:10])
    target.score(other[:7])  # rejected draft tokens
    target.rollback(10)
    torch.testing.assert_close(target.score(ids[10:16]), ref[10:16], rtol=0, atol=ATOL)
    target.rollback(12)
    torch.testing.assert_close(target.score(ids[12:]), ref[12:], rtol=0, atol=ATOL)
    target.prefill(ids[:3])  # a new request reuses the cache
    torch.testing.assert_close(target.score(ids[3:9]), ref[3:9], rtol=0, atol=ATOL)


def test_adopted_cache_scores_as_a_prefilled_one(packed):
    model = MODELS["qwen2-bias"]()
    ids = prompt()
    source, adopter = LlamaTarget.from_hf(model, max_length=64), LlamaTarget.from_hf(model, max_length=64)
    source.prefill(ids[:10])
    adopter.prefill(prompt(seed=1)[:12])  # other tokens, all replaced
    adopter.commit_cache(100)  # beyond max_length: up to it
    assert adopter.length == 0
    assert adopter.shares_cache_layout(source)
    assert adopter.adopt_cache(source, 8)
    assert adopter.length == 8 and source.length == 10
    torch.testing.assert_close(adopter.score(ids[8:]), reference_logits(model, ids)[8:], rtol=0, atol=ATOL)
    shorter = LlamaTarget.from_hf(model, max_length=32)
    assert not adopter.shares_cache_layout(shorter)
    assert not adopter.adopt_cache(shorter, 0)  # another layout: refused, nothing changed
    assert not adopter.adopt_cache(source, 11)  # more positions than the source holds
    assert adopter.length == len(ids)


def test_a_cache_catches_up_from_another(packed):
    model = MODELS["qwen2-bias"]()
    ids = prompt()
    source, adopter = LlamaTarget.from_hf(model, max_length=64), LlamaTarget.from_hf(model, max_length=64)
    source.prefill(ids[:10])
    adopter.prefill(ids[:4])
    assert not adopter.adopt_cache(source, 8, start=5)  # more positions kept than it holds
    assert adopter.length == 4
    assert adopter.adopt_cache(source, 8, start=4)
    assert adopter.length == 8
    torch.testing.assert_close(adopter.score(ids[8:]), reference_logits(model, ids)[8:], rtol=0, atol=ATOL)


def test_prefill_in_chunks_and_features(monkeypatch):
    """Features are kept per position, whatever passes wrote them: a chunked prefill, a score, a
    pass through some of the layers (which leaves them stale until the full pass rewrites them)."""
    model = MODELS["llama-tied"]()
    ids = prompt(30)
    with torch.inference_mode():
        hidden = model.model(ids[None]).last_hidden_state[0]  # [n, hidden], after the final norm
    ref = reference_logits(model, ids)
    monkeypatch.setattr(llama, "PREFILL_CHUNK", 7)
    target = LlamaTarget.from_hf(model)
    target.record_features(())
    target.prefill(ids[:-2])
    torch.testing.assert_close(target.features(0, 28), hidden[:-2], rtol=0, atol=ATOL)
    torch.testing.assert_close(target.score(ids[-2:]), ref[-2:], rtol=0, atol=ATOL)
    torch.testing.assert_close(target.features(0, 30), hidden, rtol=0, atol=ATOL)
    target.rollback(27)
    target.forward(ids[27:], layers=[0])
    with pytest.raises(ValueError, match="were not recorded"):
        target.features(26, 30)
    target.rollback(27)
    target.score(ids[27:])
    torch.testing.assert_close(target.features(26, 30), hidden[26:], rtol=0, atol=ATOL)


def test_empty_prefill_and_score():
    model = MODELS["llama-untied"]()
    ids = prompt(6)
    target = LlamaTarget.from_hf(model)
    target.prefill(ids[:0])
    assert target.length == 0 and target.last_hidden.shape == (0, 64)
    assert target.score(ids[:0]).shape == (0, 64)
    torch.testing.assert_close(target.score(ids), reference_logits(model, ids), rtol=0, atol=ATOL)


def test_bounds():
    target = LlamaTarget.from_hf(MODELS["llama-untied"](), max_length=8)
    assert target.max_length == 8
    target.prefill(prompt(6))
    with pytest.raises(ValueError):
        target.score(prompt(3))
    with pytest.raises(ValueError):
        target.rollback(7)
    assert target.length == 6
    assert LlamaTarget.from_hf(MODELS["llama-untied"]()).max_length == 128  # max_position_embeddings


def test_forward_with_skipped_layers_equals_truncated_model():
    model = MODELS["llama-untied"]()
    ids = prompt(12)
    truncated = copy.deepcopy(model)
    truncated.model.layers = truncated.model.layers[:1]
    truncated.config.num_hidden_layers = 1
    target = LlamaTarget.from_hf(model)
    target.prefill(ids[:0])
    torch.testing.assert_close(target.forward(ids, layers=[0]), reference_logits(truncated, ids), rtol=0, atol=ATOL)
    assert target.forward(ids[:2], logits=False) is None and target.length == 14


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias", "qwen3-qk-norm", "llama3-rope", "gemma3"])
def test_greedy_decoding_is_token_identical(name, packed):
    model = MODELS[name]()
    ids = prompt(9, seed=3)
    new = 24
    ref = greedy_reference(model, ids, new)
    target = LlamaTarget.from_hf(model)
    target.prefill(ids[:-1])
    logits = target.score(ids[-1:])
    out = []
    for _ in range(new):
        out.append(int(logits[-1].argmax()))
        logits = target.score(torch.tensor(out[-1:]))
    assert out == ref.tolist()


def test_supports():
    assert llama.SUPPORTED_MODEL_TYPES == {"llama", "qwen2", "qwen3", "mistral", "gemma3_text"}
    for name in ("llama-untied", "qwen2-bias", "qwen3-qk-norm", "mistral", "llama3-rope", "gemma3"):
        assert llama.supports(MODELS[name]().config)
    gemma = {**COMMON, "head_dim": 16}
    assert not llama.supports(Gemma3TextConfig(**gemma, final_logit_softcapping=30.0))
    assert not llama.supports(Gemma3TextConfig(**gemma, hidden_activation="silu"))
    assert not llama.supports(LlamaConfig(**{**COMMON, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}))
    assert not llama.supports(LlamaConfig(**{**COMMON, "hidden_act": "gelu"}))
    config = LlamaConfig(**COMMON)
    config.model_type = "gemma"
    assert not llama.supports(config)
    model = MODELS["llama-untied"]()
    model.config.hidden_act = "gelu"
    with pytest.raises(UnsupportedModel):
        LlamaTarget.from_hf(model)


def test_sliding_window_caps_the_context():
    model = tiny("mistral", seed=5, sliding_window=16)
    target = LlamaTarget.from_hf(model)
    assert target.max_length == 16  # within the window, attention is full: still exact
    ids = prompt(16)
    target.prefill(ids[:4])
    torch.testing.assert_close(target.score(ids[4:]), reference_logits(model, ids)[4:], rtol=0, atol=ATOL)
    with pytest.raises(UnsupportedModel):
        LlamaTarget.from_hf(model, max_length=32)


@pytest.mark.skipif(not kernels.available(), reason="the gemm kernel could not be built here")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 12, 13, 16, 29])
def test_gemm_kernel(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(100, 48), torch.randn(100)  # 100 columns: a partial last panel
    x = torch.randn(rows, 48)
    packed = kernels.pack(weight)
    torch.testing.assert_close(kernels.matmul(x, packed, 100), x @ weight.T, rtol=0, atol=ATOL)
    torch.testing.assert_close(kernels.matmul(x, packed, 100, bias), x @ weight.T + bias, rtol=0, atol=ATOL)
    acc = torch.randn(rows, 100)
    expected = acc + x @ weight.T
    torch.testing.assert_close(kernels.matmul(x, packed, 100, out=acc), expected, rtol=0, atol=ATOL)
    torch.testing.assert_close(kernels.unpack_rows(packed, torch.tensor([0, 31, 32, 99])), weight[[0, 31, 32, 99]])


@pytest.mark.slow
def test_bundled_model_matches_transformers():
    """SmolLM2-135M: logits reach about 30, so float32 rounding of different summation
    orders reaches about 1e-4 absolute (1e-4 relative to the scale is far tighter than any real bug);
    greedy decoding must be token-identical."""
    from specsample.models.loading import load_model

    loaded = load_model()
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = torch.tensor(tokenizer("The capital of France is Paris. The capital of Italy is").input_ids)
    ref = reference_logits(model, ids)
    target = LlamaTarget.from_hf(model)
    target.prefill(ids[:4])
    ours = torch.cat([target.score(ids[4:5]), target.score(ids[5:])])
    torch.testing.assert_close(ours, ref[4:], rtol=0, atol=1e-4 * float(ref.abs().max()))
    expected = greedy_reference(model, ids, 24)
    target.prefill(ids[:-1])
    logits = target.score(ids[-1:])
    out = []
    for _ in range(24):
        out.append(int(logits[-1].argmax()))
        logits = target.score(torch.tensor(out[-1:]))
    assert out == expected.tolist()


def test_embedding_rows_are_the_tables_rows_and_stay_bounded():
    table = torch.randn(50, 8)
    calls: list[list[int]] = []

    def unpack(ids: torch.Tensor) -> torch.Tensor:
        calls.append(ids.tolist())
        return table[ids]

    rows = llama.EmbeddingRows(unpack, kept=4)
    ids = torch.tensor([3, 7, 3, 9])
    assert torch.equal(rows(ids), table[ids])
    assert calls == [[3, 7, 9]]  # each missing row unpacked once
    assert torch.equal(rows(torch.tensor([7, 3])), table[[7, 3]]) and len(calls) == 1  # kept rows: no unpacking
    many = torch.tensor([1, 2, 3, 4, 5, 6])
    assert torch.equal(rows(many), table[many])  # more rows than kept in one call
    assert len(rows.rows) == 4 and list(rows.rows) == [3, 4, 5, 6]  # the most recently used


def test_tied_embedding_equals_the_lm_heads_rows(packed):
    target = LlamaTarget.from_hf(MODELS["llama-tied"](), max_length=64)
    ids = torch.tensor([5, 1, 5, 63, 0])
    assert target.tied_rows is not None
    assert torch.equal(target._embed(ids), target._lm_head_rows(ids))
    assert torch.equal(target._embed(ids), target._embed(ids))


F16_KV_ATOL = 2e-2  # logits about 5 in size: float16 keys and values (11-bit significands) moved them by at most 8e-3


@pytest.mark.parametrize("name", ["llama-untied", "llama-mha-odd-sizes", "qwen2-bias", "qwen3-qk-norm", "mistral", "gemma3"])
def test_float16_keys_and_values_match_transformers_to_their_rounding(name, packed):
    """On the kernels, `kv_dtype=float16` keeps the cache in float16 (as the GGUF blocks' targets do): the
    logits stay within F16_KV_ATOL of transformers' and are not float32's; torch ops keep float32."""
    model = MODELS[name]()
    ids = prompt(40, vocab=model.config.vocab_size)
    half = LlamaTarget.from_hf(model, max_length=64, kv_dtype=torch.float16)
    assert half.k_cache.dtype == half.v_cache.dtype == (kernels.cache_dtype(torch.float16, torch.float32) if packed else torch.float32)
    half.prefill(ids[:30])
    got = torch.cat([half.score(ids[30:31]), half.score(ids[31:])])
    torch.testing.assert_close(got, reference_logits(model, ids)[30:], rtol=0, atol=F16_KV_ATOL)
    full = LlamaTarget.from_hf(model, max_length=64)
    full.prefill(ids[:30])
    assert torch.equal(torch.cat([full.score(ids[30:31]), full.score(ids[31:])]), got) == (half.k_cache.dtype == torch.float32)
