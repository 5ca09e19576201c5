"""The transformers backend's caches. Sliding-window models: past the window, plain decoding is
transformers' `generate`, speculative decoding rolls back (transformers' own sliding cache layers cannot
be cropped once full) with the same greedy tokens, and a tree's nodes get their paths' logits (each
query sees the keys within its window of its own position, 1e-5 absolute: float32 rounding of another
summation order; in Llama 4's chunked layers, those of its own chunk). After a tree pass the kept path's
keys and values move into place, in every layer that has its own (Gemma 4's shared ones have none). Models
with a recurrent state (an SSM, linear attention) are refused in one line."""

from __future__ import annotations

import pytest
import torch

from specsample.drafters import NoDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.engine import decode
from specsample.models import TransformersTarget
from specsample.models.target import UnsupportedModel
from specsample.policy import FixedK
from specsample.sampling import CoupledSource, SamplingParams
from specsample.stats import Stats

from test_llama_backend import tiny

WINDOW = 8
MODELS = {
    "mistral": lambda: tiny("mistral", sliding_window=WINDOW),  # every layer sliding, one mask
    "gemma3": lambda: tiny("gemma3", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
}
PARENTS = torch.tensor([-1, -1, 0, 2, 2, -1, 4, 1, 6, 3])


def llama4_chunked() -> torch.nn.Module:
    """Llama 4's text model: its attention layers see their own chunk of WINDOW positions only."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    config = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=1, interleave_moe_layer_step=0,
        moe_layers=[], attention_chunk_size=WINDOW, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, initializer_range=0.3)
    return Llama4ForCausalLM(config).eval()


def gemma4_shared() -> torch.nn.Module:
    """Gemma 4's text model with layers that read other layers' keys and values (`num_kv_shared_layers`):
    transformers gives them cache layers without keys of their own."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, initializer_range=0.3)
    return Gemma4ForCausalLM(config).eval()


MODELS |= {"llama4": llama4_chunked, "gemma4": gemma4_shared}


def repetitive_prompt(length: int) -> torch.Tensor:
    """Tokens that repeat, so that the n-gram drafter finds drafts, some of them rejected."""
    return torch.tensor([3, 7, 11, 5, 7, 11, 3, 9] * (length // 8 + 1))[:length]


def greedy(target: TransformersTarget, drafter, k: int, prompt: torch.Tensor, new: int) -> tuple[list[int], Stats]:
    stats = Stats()
    steps = decode(target, drafter, FixedK(k), prompt, SamplingParams(temperature=0.0), max_new_tokens=new,
                   eos_token_ids=frozenset(), random=CoupledSource(0), stats=stats)
    return [t for step in steps for t in step], stats


@pytest.mark.parametrize("name", MODELS)
def test_speculation_past_the_window_gives_transformers_greedy_tokens(name):
    model = MODELS[name]()
    prompt = repetitive_prompt(3 * WINDOW)
    expected = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
    target = TransformersTarget(model)
    plain, _ = greedy(target, NoDrafter(), 0, prompt, 24)
    speculative, stats = greedy(target, NgramDrafter(), 4, prompt, 24)
    assert plain == expected
    assert speculative == expected
    assert stats.drafted_tokens > stats.accepted_tokens  # some draft was rejected: the cache was cropped


@pytest.mark.parametrize("name", MODELS)
def test_tree_logits_past_the_window_equal_each_path_scored_as_a_chain(name):
    target = TransformersTarget(MODELS[name]())
    context, tokens = repetitive_prompt(2 * WINDOW + 3), torch.arange(20, 20 + len(PARENTS))
    target.prefill(context)
    tree = target.score_tree(tokens, PARENTS)  # [n, vocab]
    for node in range(len(PARENTS)):
        path = [node]
        while PARENTS[path[0]] >= 0:
            path.insert(0, int(PARENTS[path[0]]))
        target.prefill(context)
        chain = target.score(tokens[path])[-1]
        torch.testing.assert_close(tree[node], chain, rtol=0, atol=1e-5)


def test_a_model_with_a_recurrent_state_is_refused():
    """Mamba's cache layers keep a state, not positions: the backend cannot roll them back (its plain
    decoding did not even match `generate`), so it refuses the model and names where it runs."""
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    with pytest.raises(UnsupportedModel, match="model type 'mamba' keeps a recurrent state .* run its GGUF file on llamacpp"):
        TransformersTarget(model)


@pytest.mark.parametrize("name", MODELS)
def test_a_tree_s_kept_path_continues_as_the_chain(name):
    """After a tree pass the accepted path's keys and values move into place (shared-cache layers have none
    to move): the next position's logits equal those after scoring the path as a chain."""
    target = TransformersTarget(MODELS[name]())
    context, tokens = repetitive_prompt(2 * WINDOW + 3), torch.arange(20, 20 + len(PARENTS))
    target.prefill(context)
    start = target.length
    target.score_tree(tokens, PARENTS)
    target.keep_path(start, [1, 7])  # root 1, then its child 7
    after_tree = target.score(torch.tensor([40]))[-1]
    target.prefill(context)
    target.score(tokens[[1, 7]])
    torch.testing.assert_close(after_tree, target.score(torch.tensor([40]))[-1], rtol=0, atol=1e-5)


def test_rollback_and_scoring_stay_within_the_cache_and_the_window():
    target = TransformersTarget(MODELS["mistral"](), max_length=16)
    target.prefill(torch.arange(1, 11))
    for length in (-1, 11):
        with pytest.raises(ValueError, match="cannot roll back"):
            target.rollback(length)
    with pytest.raises(ValueError, match="exceed the context window of 16"):
        target.score(torch.arange(1, 8))
    assert target.length == 10
