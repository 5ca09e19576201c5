"""Drafts at the end of the context window: a draft model with a shorter window than the target's, a draft
model's tree with more nodes than K, the head's tree on its own cache. Each gives plain decoding's text, and
no pass overflows a window (each crashed at the window's end before)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from specsample.drafters import DraftModelDrafter, NoDrafter
from specsample.drafters.head_tree import HeadTreeDrafter
from specsample.engine import decode
from specsample.models import TransformersTarget
from specsample.models.llama import LlamaTarget
from specsample.policy import FixedK
from specsample.sampling import CoupledSource, SamplingParams
from specsample.stats import Stats
from test_head import tiny_head, tiny_loaded


def tokens(target, drafter, k: int, prompt: torch.Tensor, temperature: float, new: int) -> list[int]:
    """The text of one request, seeded: plain decoding's whatever the drafter."""
    steps = decode(target, drafter, FixedK(k), prompt, SamplingParams(temperature), max_new_tokens=new,
                   eos_token_ids=frozenset(), random=CoupledSource(0), stats=Stats())
    return [t for step in steps for t in step]


def prompt_of(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_with_a_shorter_window_drafts_what_fits(temperature):
    target = LlamaTarget.from_hf(tiny_llama(64, seed=3))  # 128 positions
    draft = LlamaTarget.from_hf(tiny_llama(64, seed=4), max_length=64)
    prompt = prompt_of(60, 64)
    plain = tokens(target, NoDrafter(), 0, prompt, temperature, 20)
    assert tokens(target, DraftModelDrafter(draft), 4, prompt, temperature, 20) == plain


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_s_tree_near_the_window_verifies_the_nodes_that_fit(temperature):
    """K = 6 with up to two alternatives a position: up to 18 nodes, where 10 positions are left."""
    target = LlamaTarget.from_hf(tiny_llama(64, seed=3, init_scale=0.5))
    draft = LlamaTarget.from_hf(tiny_llama(64, seed=4, init_scale=0.5))
    prompt = prompt_of(118, 64)
    plain = tokens(target, NoDrafter(), 0, prompt, temperature, 10)
    drafter = DraftModelDrafter(draft, width=3, threshold=1.1)  # alternatives at every position
    assert tokens(target, drafter, 6, prompt, temperature, 10) == plain


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_the_head_s_tree_runs_to_the_window_s_end_on_each_backend_that_scores_trees(backend):
    """The head's tree on its own cache stops expanding where the window ends; on the transformers backend
    the tree pass records the target's features of the accepted path too (the head reads them next)."""
    model = tiny_llama(16, seed=0)
    loaded = tiny_loaded(model)
    target = LlamaTarget.from_hf(model) if backend == "fast" else TransformersTarget(model, max_length=128)
    prompt = prompt_of(100, 16)
    plain = tokens(target, NoDrafter(), 0, prompt, 0.0, 28)
    head, ids = tiny_head(loaded, 12)
    drafter = HeadTreeDrafter(target, head, model.get_input_embeddings().weight, model.get_output_embeddings().weight, ids)
    assert tokens(target, drafter, 8, prompt, 0.0, 28) == plain
