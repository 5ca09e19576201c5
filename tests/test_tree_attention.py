"""Tree attention in the fast backend: scoring a tree of tokens in one pass gives each token the
logits of its root-to-token path scored as a chain, and keeping a path leaves the cache as if the
path had been scored alone.

Tolerance: on the C++ kernels, bitwise (a node's scores, softmax and weighted values are the same
chains of float operations as its path's, `kernels.layers`); on torch ops (the mask and gathered
rotary tables of `LlamaTarget._tree_inputs`), 1e-5 absolute, float32 rounding of other summation
orders. Backends without trees refuse a tree draft in one line (tests/test_tree_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from specsample.models import kernels
from specsample.models.llama import LlamaTarget
from specsample.tree import depths

from test_llama_backend import packed, prompt, tiny  # noqa: F401  (packed is a fixture)

TORCH_ATOL = 1e-5
PARENTS = torch.tensor([-1, -1, 0, 2, 2, -1, 4, 1, 6, 3])  # three children of the root, a deep branch
MODELS = {
    "head_dim16": lambda: tiny("llama", tie_word_embeddings=False),  # one AVX-512 vector per head row
    "head_dim8": lambda: tiny("llama", seed=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2),
}


def path_of(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(PARENTS[node])
    return path[::-1]


def chain_logits(target: LlamaTarget, context: torch.Tensor, tokens: torch.Tensor, node: int) -> torch.Tensor:
    """The logits [vocab] of `node` when its path is scored as a chain after `context`."""
    target.prefill(context)
    return target.score(tokens[path_of(node)])[-1]


def check(expected: torch.Tensor, got: torch.Tensor, packed: bool) -> None:
    if packed:
        assert torch.equal(expected, got), float((expected - got).abs().max())
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=TORCH_ATOL)


@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["float32-kv", "float16-kv"])
@pytest.mark.parametrize("context_length", [0, 16, 70])  # none, a whole vector of keys, past a block of values
@pytest.mark.parametrize("name", MODELS)
def test_tree_logits_equal_each_path_scored_as_a_chain(name, context_length, packed, kv_dtype):
    target = LlamaTarget.from_hf(MODELS[name](), kv_dtype=kv_dtype)
    assert target.kernels == packed
    context = prompt(context_length)
    tokens = prompt(len(PARENTS), seed=1)
    target.prefill(context)
    tree = target.score_tree(tokens, PARENTS)  # [n, vocab]
    assert target.length == context_length + len(PARENTS)
    for node in range(len(PARENTS)):
        check(chain_logits(target, context, tokens, node), tree[node], packed)


@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["float32-kv", "float16-kv"])
@pytest.mark.parametrize("node", [3, 8, 5])  # a path that moves rows, one that moves most, a root child that moves
def test_keep_path_leaves_the_cache_of_the_path(node, packed, kv_dtype):
    target = LlamaTarget.from_hf(MODELS["head_dim16"](), kv_dtype=kv_dtype)
    context, tokens, after = prompt(21), prompt(len(PARENTS), seed=1), prompt(3, seed=2)
    path = path_of(node)
    target.prefill(context)
    target.score_tree(tokens, PARENTS)
    target.keep_path(len(context), path)
    assert target.length == len(context) + len(path)
    got = target.score(after)
    target.prefill(torch.cat([context, tokens[path]]))
    check(target.score(after), got, packed)


def test_tree_positions_are_depths():
    assert depths(PARENTS).tolist() == [0, 0, 1, 2, 2, 0, 3, 1, 4, 3]


@pytest.mark.skipif(not kernels.available(), reason="the kernels could not be built here")
def test_bundled_model_tree_is_bitwise_its_paths():
    """The real model on its GGUF blocks (what `auto` runs here): bitwise too."""
    from specsample.models import load_target

    _, target = load_target(None, "gguf")
    context, tokens = prompt(37, vocab=1000), prompt(len(PARENTS), vocab=1000, seed=1)
    target.prefill(context)
    tree = target.score_tree(tokens, PARENTS)
    for node in (1, 3, 8, 9):
        assert torch.equal(chain_logits(target, context, tokens, node), tree[node])
