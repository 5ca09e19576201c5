"""The transformers backend's caches. Sliding-window models: past the window, plain decoding is
transformers' `generate`, speculative decoding rolls back (transformers' own sliding cache layers cannot
be cropped once full) with the same greedy tokens, and a tree's nodes get their paths' logits (each
query sees the keys within its window of its own position, 1e-5 absolute: float32 rounding of another
summation order). Models with a recurrent state (an SSM, linear attention) are refused in one line."""

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
