"""Slots (models/target.py `Slots`) on the fast backend: a row's logits do not depend on the other rows.

Several requests' caches are scored in one pass; each segment's logits must be bitwise those of the
same tokens scored alone in its slot, and those of the single-request target's `score` after the
same prefill, whatever the other segments (their slots, lengths, contexts and order). Checked on
tiny random models (a Llama, a Qwen3, a Gemma 3) and on the bundled model's GGUF blocks (a long context that runs the attention of
the segments in parallel).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from specsample.models import kernels
from specsample.models.llama import LlamaTarget
from specsample.models.target import Slots, SlottedTarget, require

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels could not be built here")


def tiny_target(seed: int = 0, kv_dtype: torch.dtype | None = None) -> LlamaTarget:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )
    return LlamaTarget.from_hf(LlamaForCausalLM(config).eval(), kv_dtype=kv_dtype)


def tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def alone(target: LlamaTarget, context: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The single-request target's logits of `new` after `context`."""
    target.prefill(context)
    return target.score(new)


def check_invariance(target: LlamaTarget, contexts: list[int], news: list[int], seed: int) -> None:
    """Every segment of one pass over several slots scores as the target does it alone."""
    vocab = target.vocab_size
    slots = require(target, SlottedTarget, "batched decoding").slots(len(contexts))
    assert isinstance(slots, Slots)
    segments, expected = [], []
    for slot, (length, n) in enumerate(zip(contexts, news)):
        context, new = tokens(length, vocab, seed + slot), tokens(n, vocab, seed + 100 + slot)
        slots.prefill(slot, context)
        segments.append((slot, new))
        expected.append(alone(target, context, new))
    order = torch.randperm(len(segments), generator=torch.Generator().manual_seed(seed)).tolist()
    together = slots.score([segments[i] for i in order])  # one pass, slots in a shuffled order
    for logits, i in zip(together, order):
        assert torch.equal(logits, expected[i]), f"segment of slot {i} differs in a batch"
        assert slots.length(i) == contexts[i] + news[i]
    for i, (slot, new) in enumerate(segments):  # rolled back, each scores alone as it did together
        slots.rollback(slot, contexts[i])
        assert torch.equal(slots.score([(slot, new)])[0], expected[i])


@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["float32-kv", "float16-kv"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_rows_are_batch_invariant(seed, kv_dtype):
    target = tiny_target(seed, kv_dtype)
    assert target.k_cache.dtype == kernels.cache_dtype(kv_dtype, torch.float32)
    check_invariance(target, contexts=[5, 40, 1, 17, 90], news=[1, 4, 9, 0, 3], seed=seed)


def test_qwen3_rows_are_batch_invariant():
    """Qwen3's norms of each query and key head run per row in the layer kernel, as in the slots' pass."""
    torch.manual_seed(3)
    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )
    target = LlamaTarget.from_hf(Qwen3ForCausalLM(config).eval())
    assert target.layers[0].q_norm is not None
    check_invariance(target, contexts=[5, 40, 1, 17, 90], news=[1, 4, 9, 0, 3], seed=3)


def test_gemma3_rows_are_batch_invariant():
    """Gemma 3's sliding windows, post-norms and GELU gates in the slots' pass: contexts past the window."""
    torch.manual_seed(4)
    config = Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=12, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    target = LlamaTarget.from_hf(Gemma3ForCausalLM(config).eval())
    assert [layer.window for layer in target.layers] == [12] * 5 + [0]
    check_invariance(target, contexts=[5, 40, 1, 17, 90], news=[1, 4, 9, 0, 3], seed=4)


def test_bundled_gguf_rows_are_batch_invariant():
    """The default backend for the bundled model (GGUF blocks): segments long enough that their
    attention runs in parallel."""
    from specsample.models import gguf_blocks
    from specsample.models.loading import load_model

    loaded = load_model()
    target = gguf_blocks.gguf_target(loaded.model, loaded.gguf)
    check_invariance(target, contexts=[200, 7, 130, 60], news=[5, 1, 8, 3], seed=3)


def test_rollback_per_slot_and_bounds():
    target = tiny_target()
    slots = target.slots(2)
    slots.prefill(0, tokens(10, 64, 0))
    slots.prefill(1, tokens(3, 64, 1))
    slots.rollback(0, 4)
    assert (slots.length(0), slots.length(1)) == (4, 3)
    with pytest.raises(ValueError, match="cannot roll slot 1 back to 5"):
        slots.rollback(1, 5)
    with pytest.raises(ValueError, match="not distinct"):
        slots.score([(0, tokens(1, 64, 2)), (0, tokens(1, 64, 3))])
    with pytest.raises(ValueError, match="not distinct"):
        slots.score([(2, tokens(1, 64, 2))])
    with pytest.raises(ValueError, match="exceed max_length"):
        slots.score([(1, tokens(target.max_length, 64, 2))])
    assert [t.shape for t in slots.score([(0, tokens(0, 64, 0)), (1, tokens(2, 64, 0))])] == [(0, 64), (2, 64)]


def test_prefill_from_a_prefix_another_slot_holds():
    """A prefill copies the longest prefix another slot holds (only what it holds now: not positions
    rolled back), and scores as the target alone does after the same prefill, the copy its own."""
    target = tiny_target(4)
    slots = target.slots(3)
    shared = tokens(30, 64, 5)
    first, second = torch.cat([shared, tokens(10, 64, 6)]), torch.cat([shared, tokens(12, 64, 7)])
    slots.prefill(0, first)
    slots.score([(0, tokens(4, 64, 8))])
    slots.rollback(0, 33)  # holds first[:33]; the 4 scored tokens are gone
    cases = [(1, second), (2, first[:36]), (2, first[:20]), (2, torch.cat([first[:33], tokens(4, 64, 8)]))]
    for slot, context in cases:
        slots.prefill(slot, context)
        new = tokens(3, 64, 9)
        assert torch.equal(slots.score([(slot, new)])[0], alone(target, context, new)), f"{len(context)} tokens"
        slots.rollback(slot, len(context))
    slots.prefill(0, tokens(50, 64, 10))  # the source overwritten: slot 1's copy stays
    assert torch.equal(slots.score([(1, tokens(2, 64, 11))])[0], alone(target, second, tokens(2, 64, 11)))
