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
from specsample.tree import chain_parents

from conftest import needs_kernels, tiny_llama
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
    """The tree drafter `name` for the tiny target: a head's, else the registry's."""
    return head_tree(model, target) if name == "head-tree" else make_drafter(name, loaded(model), target)


@pytest.mark.parametrize("name", ["quantized-tree", "head-tree", "suffix-tree+quantized-tree"])
def test_greedy_model_tree_drafters_are_token_identical(name, packed):
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    plain, _ = run(target, NoDrafter(), GREEDY, 0)
    drafter = drafters(name, model, target)
    runs = {k: run(target, drafter, GREEDY, k) for k in (3, 10, CostModelK())}  # auto: cut by the tree-size policy
    assert all(out == plain for out, _ in runs.values()), name
    assert all(stats.accepted_tokens > 0 for k, (_, stats) in runs.items() if isinstance(k, int)), name
    assert sum(stats.to_dict().get("tree", {}).get("steps", 0) for _, stats in runs.values()) > 0, name


@pytest.mark.parametrize("name", ["quantized-tree", "head-tree"])
def test_seeded_model_tree_drafters_give_plain_decoding_text(name):
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    drafter = drafters(name, model, target)
    seeded = {seed: (run(target, NoDrafter(), params, 0, CoupledSource(seed))[0],
                     run(target, drafter, params, 6, CoupledSource(seed))) for seed in range(3)}
    assert all(out == plain for plain, (out, _) in seeded.values()), name
    assert sum(stats.accepted_tokens for _, (_, stats) in seeded.values()) > 0


def test_draft_tree_accepts_alternatives_and_keeps_its_cache_on_the_text(tiny_dir, tiny_draft_dir):
    """`draft-tree:PATH`, a draft model unlike the target: greedy output is plain decoding's, some accepted
    nodes are alternatives (rank >= 1), and after each step the draft model's cache holds a prefix of the
    text (rolled back past a rejected chain token or an accepted alternative leaf)."""
    from specsample.models import load_target

    model, target = load_target(str(tiny_dir), "fast")
    drafter = make_drafter(f"draft-tree:{tiny_draft_dir}", model, target)
    assert isinstance(drafter, DraftModelDrafter) and drafter.width > 1
    plain, _ = run(target, NoDrafter(), GREEDY, 0)
    observe = drafter.observe

    def checked(tokens: list[int]) -> None:
        observe(tokens)
        cached = drafter.model.length
        assert cached < len(drafter.context)  # the pending token is not cached
        fresh = make_target(loaded(tiny_llama(64, seed=1)))  # the draft model scored from scratch on the text
        fresh.prefill(torch.tensor(drafter.context[:cached]))
        assert torch.allclose(fresh.score(torch.tensor(drafter.context[cached:]))[-1],
                              drafter.model.score(torch.tensor(drafter.context[cached:]))[-1], atol=1e-4)
        drafter.model.rollback(cached)

    drafter.observe = checked
    out, stats = run(target, drafter, GREEDY, 4)
    assert out == plain
    ranks = stats.to_dict()["tree"]["acceptance_by_depth_rank"]
    assert any(rate > 0 for key, rate in ranks.items() if not key.endswith(",0")), ranks


@needs_kernels
def test_bundled_model_greedy_model_tree_drafters_are_token_identical():
    """The real model, 32 new tokens: its shipped head drafting trees on its GGUF blocks, its int8 copy on
    the float kernels (the Q4_1 blocks have no cheaper copy)."""
    from specsample.models import load_target

    for backend, name in (("gguf", "head-tree"), ("fast", "quantized-tree")):
        model, target = load_target(None, backend)
        ids = torch.tensor(model.tokenizer("Write a short poem about the sea, and explain its rhyme scheme.").input_ids)
        plain, _ = run(target, NoDrafter(), GREEDY, 0, new=32, prompt=ids)
        out, stats = run(target, make_drafter(name, model, target), GREEDY, 8, new=32, prompt=ids)
        assert out == plain, name
        assert stats.accepted_tokens > 0 and stats.to_dict()["tree"]["steps"] > 0, name


def test_alternatives_go_where_the_chains_token_is_measured_rejected():
    """A flat draft model (every peak below the threshold) draws alternatives everywhere at first; once
    its sampled chain tokens have all been kept, alternatives stop for sampled requests, while greedy
    requests, counted apart, still get them; and positions whose tokens are rejected get them back."""
    drafter = DraftModelDrafter(make_target(loaded(tiny_llama(VOCAB, seed=4, init_scale=0.02))), width=3)
    sampled, source = SamplingParams(temperature=1.0), GeneratorSource(make_generator(0))

    def draft(params: SamplingParams, taken) -> bool:
        """Begin a request, draft 4 tokens and show the drafter the text `taken(chain)`: whether it had
        alternatives (a sampled draft is a tree whatever its shape, `DraftModelDrafter.chain_form`)."""
        drafter.begin(PROMPT, params)
        proposed = drafter.propose(4, source)
        tree = not torch.equal(proposed.parent_array(), chain_parents(len(proposed)))
        assert max(drafter.draft_confidence) < drafter.threshold
        drafter.observe(taken(drafter.draft))
        return tree

    kept, rejected = (lambda chain: chain + [1]), (lambda chain: [(chain[0] + 1) % VOCAB])
    assert draft(sampled, kept)
    trees = [draft(sampled, kept) for _ in range(15)]
    assert trees[0] and not trees[-1]
    assert draft(GREEDY, kept)
    trees = [draft(sampled, rejected) for _ in range(30)]
    assert trees[-1]
