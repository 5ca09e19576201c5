"""Tree drafts of the model drafters (issue 23): `quantized-tree` and `draft-tree:PATH` (a chain with
alternative leaves at its low-confidence positions, drafters/draft_model.py) and `head-tree`
(EAGLE-2's dynamic tree, drafters/head_tree.py).

Greedy output token-identical to plain decoding (a tiny model on the C++ kernels and on torch
ops, and the bundled model on its GGUF blocks); seeded output identical to plain decoding's with
the seed; the draft model's cache rolled back to the accepted path. The exactness of the sampled
alternatives (siblings drawn without replacement) is tested by exact enumeration in
tests/test_model_trees_lossless.py.
"""

from __future__ import annotations

import pytest
import torch

from specsample.drafters import NoDrafter, make_drafter
from specsample.drafters.draft_model import DraftModelDrafter
from specsample.drafters.head_tree import HeadTreeDrafter
from specsample.models import make_target
from specsample.policy import CostModelK
from specsample.sampling import CoupledSource, GeneratorSource, SamplingParams, make_generator

from conftest import tiny_llama
from test_head import tiny_head
from test_llama_backend import packed  # noqa: F401  (a fixture: kernels, then torch ops)
from test_tree_engine import PROMPT, VOCAB, loaded, run

GREEDY = SamplingParams(temperature=0)


def head_tree(model, target, **options) -> HeadTreeDrafter:
    """A head for the tiny target (its last layer's weights, untrained), drafting trees."""
    head, token_ids = tiny_head(loaded(model), 48)
    return HeadTreeDrafter(
        target, head, model.get_input_embeddings().weight, model.get_output_embeddings().weight, token_ids, **options
    )


def drafters(name: str, model, target):
    """The tree drafter `name` for the tiny target: the int8 copy or a head."""
    if name == "quantized-tree":
        return make_drafter(name, loaded(model), target)
    return head_tree(model, target)


@pytest.mark.parametrize("name", ["quantized-tree", "head-tree"])
def test_greedy_model_tree_drafters_are_token_identical(name, packed):
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    plain, _ = run(target, NoDrafter(), GREEDY, 0)
    drafter = drafters(name, model, target)
    trees = 0
    for k in (3, 10):
        out, stats = run(target, drafter, GREEDY, k)
        assert out == plain, (name, k)
        assert stats.accepted_tokens > 0, (name, k)
        trees += stats.to_dict().get("tree", {}).get("steps", 0)
    assert trees > 0, name  # some drafts were trees
    out, _ = run(target, drafter, GREEDY, CostModelK())  # trees cut by the tree-size policy
    assert out == plain, (name, "auto")


@pytest.mark.parametrize("name", ["quantized-tree", "head-tree"])
def test_seeded_model_tree_drafters_give_plain_decoding_text(name):
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    drafter = drafters(name, model, target)
    accepted = 0
    for seed in range(3):
        plain, _ = run(target, NoDrafter(), params, 0, CoupledSource(seed))
        out, stats = run(target, drafter, params, 6, CoupledSource(seed))
        assert out == plain, (name, seed)
        accepted += stats.accepted_tokens
    assert accepted > 0
