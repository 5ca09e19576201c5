"""The engine over tree drafts: greedy output token-identical to plain decoding for every tree
drafter (a tiny model on the C++ kernels and on torch ops, and the bundled model on its GGUF blocks),
seeded output identical to plain decoding's with the seed, the verification logits shown to the
drafter that asks for them, and a backend without tree attention refusing a tree drafter in one line."""

from __future__ import annotations

import pytest
import torch

import specsample.engine as engine
from specsample.drafters import NoDrafter, make_drafter
from specsample.drafters.base import Draft
from specsample.drafters.fallback import FallbackDrafter
from specsample.drafters.recycle import RecycleDrafter, template
from specsample.drafters.suffix import SuffixTreeDrafter
from specsample.models import TransformersTarget, make_target
from specsample.models.loading import LoadedModel
from specsample.policy import CostModelK, FixedK
from specsample.sampling import CoupledSource, GeneratorSource, SamplingParams, make_generator
from specsample.stats import Stats

from conftest import needs_kernels, tiny_llama
from test_llama_backend import packed  # noqa: F401  (a fixture: kernels, then torch ops)

TREE_DRAFTERS = ["recycle", "recycle-chain", "suffix-tree", "ngram-tree"]
VOCAB = 64
# a prompt that repeats, so the lookup drafters find matches
PROMPT = torch.tensor([5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9, 13, 2, 8, 30, 31, 5, 9])


def loaded(model) -> LoadedModel:
    return LoadedModel(model, None, "tiny", frozenset(), 0.0)


def run(target, drafter, params, k, random=None, new: int = 40, prompt=PROMPT) -> tuple[list[int], Stats]:
    """Decode with K = k, or with the policy k."""
    stats = Stats()
    steps = engine.decode(
        target, drafter, FixedK(k) if isinstance(k, int) else k, prompt, params, max_new_tokens=new, eos_token_ids=frozenset(),
        random=random or GeneratorSource(make_generator(0)), stats=stats,
    )
    return [t for step in steps for t in step], stats


@pytest.mark.parametrize("name", TREE_DRAFTERS)
def test_greedy_tree_drafters_are_token_identical(name, packed):
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    greedy = SamplingParams(temperature=0)
    plain, _ = run(target, NoDrafter(), greedy, 0)
    drafter = make_drafter(name, loaded(model), target)
    for k in (3, 12):
        out, stats = run(target, drafter, greedy, k)
        assert out == plain, (name, k)
        assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0, (name, k)
    out, _ = run(target, drafter, greedy, CostModelK())  # trees cut by the tree-size policy
    assert out == plain, (name, "auto")


@pytest.mark.parametrize("name", ["recycle", "suffix-tree"])
def test_seeded_tree_drafters_give_plain_decoding_text(name):
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    drafter = make_drafter(name, loaded(model), target)
    accepted = 0
    for seed in range(4):
        plain, _ = run(target, NoDrafter(), params, 0, CoupledSource(seed))
        out, stats = run(target, drafter, params, 8, CoupledSource(seed))
        assert out == plain, (name, seed)
        accepted += stats.accepted_tokens
    assert accepted > 0


def test_recycle_learns_from_the_verification_logits():
    """The table is filled from the passes' logits only: empty at first, then the target's top tokens."""
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    drafter = RecycleDrafter()
    drafter.begin(PROMPT, SamplingParams(temperature=0))
    draft = drafter.propose(8, GeneratorSource(make_generator(0)))
    assert len(draft) == 0 and draft.is_tree and draft.observe_logits is not None
    run(target, drafter, SamplingParams(temperature=0), 8, new=2)  # one tree step (an empty tree), one plain
    target.prefill(PROMPT[:-1])
    logits = target.score(PROMPT[-1:])[0]
    assert drafter.next[int(PROMPT[-1])] == logits.topk(drafter.width).indices.tolist()


def test_recycle_takes_each_greedy_token_as_rank_0_of_the_token_before_it():
    """At t = 0 each emitted token is the target's argmax after the one before it, so it becomes that
    token's rank 0 (its last successor, where a token recurs)."""
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    drafter = RecycleDrafter()
    out, _ = run(target, drafter, SamplingParams(temperature=0), 0, new=24)
    expected = {}
    for before, token in zip([int(PROMPT[-1]), *out[:-1]], out):
        expected[before] = token
    assert {before: row[0] for before, row in drafter.next.items()} == expected
    assert all(len(row) == len(set(row)) <= drafter.width for row in drafter.next.values())
    assert drafter.propose(1, GeneratorSource(make_generator(0))).tokens.tolist() == [expected[out[-1]]]


@pytest.mark.parametrize("a_plus_b", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_recycle_refreshes_from_plain_steps(temperature, a_plus_b):
    """A plain step shows the drafter its row (`WatchesPlainSteps`), also behind A+B: the pending token's
    entry becomes the row's top tokens (its last row, where a token recurs). When sampling, the emitted
    token was drawn, so the table learns what the text alone would not tell it."""
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    recycle = RecycleDrafter()
    drafter = FallbackDrafter(recycle, NoDrafter()) if a_plus_b else recycle
    out, _ = run(target, drafter, SamplingParams(temperature=temperature), 0, CoupledSource(0), new=24)
    pending = [int(PROMPT[-1]), *out[:-1]]
    target.prefill(PROMPT[:-1])
    top = target.score(torch.tensor(pending)).topk(recycle.width, dim=-1).indices.tolist()  # [24, width]
    assert recycle.next == dict(zip(pending, top))
    assert temperature == 0 or any(row[0] != token for row, token in zip(top, out))  # some draws not the argmax


def test_recycle_template_is_a_fixed_tree():
    nodes = template(16, 4)
    assert len(nodes) == 16 and all(parent < i for i, (parent, _) in enumerate(nodes))
    assert [rank for parent, rank in nodes if parent == -1] == [0, 1, 2, 3]


def test_suffix_tree_drafts_several_continuations():
    drafter = SuffixTreeDrafter()
    drafter.begin(torch.tensor([7, 1, 2, 3, 4, 7, 1, 2, 3, 5, 9, 7, 1, 2, 3, 4, 8, 7, 1, 2]), SamplingParams())
    draft = drafter.propose(12, GeneratorSource(make_generator(0)))
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    assert tokens[:2] == [3, 4] and parents[:2] == [-1, 0]  # after "7 1 2": 3, then most often 4
    children_of_3 = [tokens[i] for i, p in enumerate(parents) if p == 0]
    assert children_of_3 == [4, 5]  # then 4 (twice) before 5 (once)


def test_backend_without_trees_refuses_a_tree_drafter():
    """A backend that does not declare ScoresTrees (llama.cpp's) gets a one-line error."""

    class ChainOnly:  # a Target that scores chains only, as LlamaCppTarget
        vocab_size, max_length, length = VOCAB, 128, 0

    with pytest.raises(ValueError, match="scores a tree of tokens in one pass") as error:
        make_drafter("recycle", loaded(tiny_llama(VOCAB, seed=3)), ChainOnly())
    assert "\n" not in str(error.value) and "ChainOnly" in str(error.value)


class ChainView:
    """A target seen through the `Target` protocol alone: it scores chains only, as llama.cpp's."""

    def __init__(self, target) -> None:
        self.target = target
        self.vocab_size, self.max_length = target.vocab_size, target.max_length

    @property
    def length(self) -> int:
        return self.target.length

    def prefill(self, token_ids):
        return self.target.prefill(token_ids)

    def score(self, token_ids):
        return self.target.score(token_ids)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)


def test_recycle_chain_drafts_for_a_target_that_scores_chains_only():
    """Its tree is one path, verified as a chain: greedy output as plain decoding's, drafts accepted."""
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = ChainView(make_target(loaded(model)))
    greedy = SamplingParams(temperature=0)
    plain, _ = run(target, NoDrafter(), greedy, 0)
    out, stats = run(target, make_drafter("recycle-chain", loaded(model), target), greedy, 6)
    assert out == plain and stats.accepted_tokens > 0


@pytest.mark.parametrize("name", ["recycle", "suffix-tree"])
def test_transformers_backend_trees_are_token_identical(name):
    """The transformers backend scores trees with a 4D mask: greedy output as plain decoding's."""
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = TransformersTarget(model)
    greedy = SamplingParams(temperature=0)
    plain, _ = run(target, NoDrafter(), greedy, 0)
    out, stats = run(target, make_drafter(name, loaded(model), target), greedy, 12)
    assert out == plain and stats.accepted_tokens > 0


def test_a_chain_draft_stays_a_chain():
    draft = Draft(torch.tensor([4, 5]), None)
    assert not draft.is_tree and draft.parent_array().tolist() == [-1, 0]


@needs_kernels
def test_bundled_model_greedy_tree_drafters_are_token_identical():
    """The real model on its GGUF blocks, 32 new tokens: every tree drafter gives plain decoding's tokens."""
    from specsample.models import load_target

    model, target = load_target(None, "gguf")
    ids = torch.tensor(model.tokenizer("Repeat after me: the quick brown fox jumps over the lazy dog. "
                                       "The quick brown fox jumps over the lazy dog. The quick").input_ids)
    greedy = SamplingParams(temperature=0)
    plain, _ = run(target, NoDrafter(), greedy, 0, new=32, prompt=ids)
    for name in TREE_DRAFTERS:
        out, stats = run(target, make_drafter(name, model, target), greedy, 10, new=32, prompt=ids)
        assert out == plain, name
        assert stats.accepted_tokens > 0, name


def test_stats_by_depth_and_rank():
    from specsample.stats import Step

    stats = Stats()
    parents = torch.tensor([-1, -1, 0, 0, 2])
    stats.record(Step(5, 2, 3, 0.0, 0.0, parents, (0, 3)))  # accepted node 0 (rank 0), then node 3 (rank 1)
    stats.record(Step(5, 0, 1, 0.0, 0.0, parents, ()))
    tree = stats.to_dict()["tree"]
    assert tree["mean_nodes"] == 5 and tree["mean_accepted_depth"] == 1
    # depth 0: rank 0 reached twice, accepted once; rank 1 reached twice, never; depth 1: both reached once
    assert tree["acceptance_by_depth_rank"] == {"0,0": 0.5, "0,1": 0.0, "1,0": 0.0, "1,1": 1.0}
    assert "tree" not in Stats().to_dict()


def test_tree_stats_count_trees_verified_and_the_path_the_answer_holds():
    """A step with an empty tree (a tree drafter that found nothing) verified no tree; a tree's accepted
    path past an EOS (`engine.answer_step`) or a stop string (`Stats.answer_ends`) is not counted."""
    from specsample.stats import Step
    from specsample.verify import Verdict

    parents = torch.tensor([-1, -1, 0, 0, 2])  # 0 -> {2 -> 4, 3}, 1
    draft = Draft.tree([10, 11, 12, 13, 14], parents.tolist())
    stats = Stats()
    stats.record(Step(0, 0, 1, 0.0, 0.0, torch.empty(0, dtype=torch.long), ()))
    assert "tree" not in stats.to_dict()
    step = engine.answer_step(draft, Verdict(3, 7, (0, 2, 4)), [10, 12], 0.0, 0.0, 0, None, None)  # the EOS at node 2
    assert (step.accepted, step.path) == (2, (0, 2))
    stats.record(step)
    stats.record(Step(5, 3, 4, 0.0, 0.0, parents, (0, 2, 4)))
    stats.answer_ends(1)  # a stop string ends the answer at the last step's first token
    assert (stats.accepted_tokens, stats.generated_tokens) == (3, 4)
    tree = stats.to_dict()["tree"]
    assert tree["steps"] == 2 and tree["mean_nodes"] == 5 and tree["mean_accepted_depth"] == 1.5
    assert tree["mean_accepted_depth"] * tree["steps"] == stats.accepted_tokens
    # depth 0 rank 0 reached twice, accepted twice; rank 1 twice, never; depth 1 once (the first step's node 2,
    # accepted, and its sibling node 3); the first step's depth 2 and the second's depth 1 were judged past
    # the answer's end (verification accepted node 4 and node 2 there): neither accepted nor rejected
    assert tree["acceptance_by_depth_rank"] == {"0,0": 1.0, "0,1": 0.0, "1,0": 1.0, "1,1": 0.0}
    assert stats.acceptance_by_position == []  # a tree's node indices are not positions


def test_an_answer_ending_on_the_path_s_last_node_leaves_its_rejected_child_uncounted():
    """The EOS (or a stop string) on the last accepted node: the child verification rejected after it was judged
    past the answer's end, as in the test above where it was accepted, and counts as neither (it had counted
    as a rejection at depth 2, and the K policy learned it)."""
    from specsample.stats import Step

    stats = Stats()
    step = Step(3, 2, 3, 0.0, 0.0, torch.tensor([-1, 0, 1]), (0, 1))  # node 2 rejected, a recovered token emitted
    stats.record(step.answered(2))
    assert stats.to_dict()["tree"]["acceptance_by_depth_rank"] == {"0,0": 1.0, "1,0": 1.0}
    whole = Stats()
    whole.record(step.answered(3))  # the recovered token in the answer: node 2 was judged within it
    assert whole.to_dict()["tree"]["acceptance_by_depth_rank"] == {"0,0": 1.0, "1,0": 1.0, "2,0": 0.0}


def test_a_stop_string_that_takes_back_a_tree_s_deepest_reach_leaves_no_empty_depth():
    """Depths 1 and 2 reached only by the accepted path a stop string then cut: their counts go to 0 and they
    leave the table (it divided by zero)."""
    from specsample.stats import Step

    stats = Stats()
    stats.record(Step(4, 3, 4, 0.0, 0.0, torch.tensor([-1, -1, 0, 2]), (0, 2, 3)))
    stats.answer_ends(1)
    # the answer keeps node 0 (accepted) and node 1 was reached; node 0's child node 2, accepted past the
    # answer's end, counts as neither, and node 3 was not reached
    assert stats.to_dict()["tree"]["acceptance_by_depth_rank"] == {"0,0": 1.0, "0,1": 0.0}


def test_tree_size_policy_keeps_the_nodes_that_pay():
    """Eight children of the root, priors 0.7 / 2**rank, f(n) = 1 + (n - 1) / 8: tokens per second
    1, 1.51, 1.64, 1.62, ... for 0, 1, 2, 3 nodes, so two are kept; once rank 1 and 2 are measured
    always accepted, more are."""
    from specsample.stats import Step

    policy = CostModelK()
    policy.observe_cost(1, 1.0)
    policy.observe_cost(9, 2.0)
    parents = torch.full((8,), -1)
    assert policy.keep_tree(parents).tolist() == [0, 1]
    for _ in range(20):
        policy.observe(Step(3, 1, 2, 0.0, 2.0, torch.tensor([-1, -1]), (1,)))  # rank 1 accepted, rank 0 not
    assert policy.tree_rate(0, 1) > 0.9 and policy.tree_rate(0, 0) < 0.1
    assert policy.keep_tree(parents).tolist() == [0, 1]  # rank 1 now pays alone, rank 0 is kept to reach it
    assert policy.keep_tree(torch.tensor([-1, -1, 1, 1])).tolist() == [0, 1, 2, 3]  # and rank 1's children (prior) too


def test_tree_size_policy_leaves_out_alternatives_that_pay_less_than_going_deeper():
    """The quantized copy's tree: a chain, each node followed by an alternative sibling. With the chain
    measured almost always accepted and the alternatives almost never, the policy verifies the chain
    and none of the alternatives listed between its nodes (a prefix in node order would have to take
    them); the kept draft is a tree of the chain's tokens, parents renumbered."""
    from specsample.stats import Step

    policy = CostModelK()
    policy.observe_cost(1, 1.0)
    policy.observe_cost(9, 1.5)
    parents = torch.tensor([-1, -1, 0, 0, 2, 2, 4, 4])  # chain nodes 0, 2, 4, 6; alternatives 1, 3, 5, 7
    for _ in range(30):  # a chain of 4 accepted whole, its alternatives reached and rejected
        policy.observe(Step(8, 4, 5, 0.0, 1.5, parents, (0, 2, 4, 6)))
    kept = policy.keep_tree(parents)
    assert kept.tolist() == [0, 2, 4, 6]
    draft = Draft.tree([10, 11, 12, 13, 14, 15, 16, 17], parents.tolist()).select(kept)
    assert draft.tokens.tolist() == [10, 12, 14, 16] and draft.parents.tolist() == [-1, 0, 1, 2]
    picked = Draft.tree([10, 11, 12, 13], [-1, -1, 0, 1]).select(torch.tensor([0, 1, 3]))
    assert picked.tokens.tolist() == [10, 11, 13] and picked.parents.tolist() == [-1, -1, 1]


def test_the_logits_hook_sees_the_tokens_of_the_subtree_verified():
    """Token Recycling refreshes its table from the rows a pass scored: with nodes left out by the policy,
    the hook is shown the tokens verified, each with its own row."""
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    shown = []
    draft = Draft.tree([5, 9, 13, 2], [-1, -1, 0, 2], lambda scored, logits: shown.append((scored, logits)))
    target.prefill(PROMPT[:-2])
    engine.verify(target, int(PROMPT[-2]), draft.select(torch.tensor([0, 2, 3])), SamplingParams(temperature=0),
                  GeneratorSource(make_generator(0)), engine.ChainVerifier())
    (scored, logits), = shown
    assert scored.tolist() == [int(PROMPT[-2]), 5, 13, 2]
    target.prefill(PROMPT[:-2])
    assert torch.allclose(logits, target.score(scored), atol=1e-4)


def test_check_broken_verifier_breaks_trees_too():
    """`check --broken` passes BROKEN, whose tree rules accept the path of first children: greedy output
    then differs from plain decoding's (the self-test of the identity check has something to catch)."""
    from specsample.verify.check import BROKEN

    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    greedy = SamplingParams(temperature=0)
    plain, _ = run(target, NoDrafter(), greedy, 0)
    stats = Stats()
    steps = engine.decode(
        target, make_drafter("recycle", loaded(model), target), FixedK(8), PROMPT, greedy, max_new_tokens=40,
        eos_token_ids=frozenset(), random=GeneratorSource(make_generator(0)), stats=stats, verifier=BROKEN,
    )
    assert [t for step in steps for t in step] != plain


class PathDrafter(NoDrafter):
    """Drafts the target's own greedy continuation as a tree whose nodes form one path, or as a tree of
    two siblings, on alternate steps."""

    is_lookup = True

    def __init__(self, continuation: list[int]) -> None:
        self.continuation, self.produced, self.steps = continuation, 0, 0

    def begin(self, prompt_ids, params) -> None:
        self.produced, self.steps = 0, 0

    def propose(self, k, random) -> Draft:
        self.steps += 1
        ahead = self.continuation[self.produced : self.produced + k]
        if self.steps % 2 or len(ahead) < 2:
            return Draft.tree(ahead, list(range(-1, len(ahead) - 1)))
        return Draft.tree(ahead[:2], [-1, -1])  # the right token, then a sibling

    def observe(self, tokens: list[int]) -> None:
        self.produced += len(tokens)


def test_a_tree_whose_nodes_form_one_path_is_verified_as_a_chain():
    """A path-shaped tree takes the chain's pass (`score`, not `score_tree`) and gives the same text; its
    verdict still names the accepted nodes, so the tree statistics count them by depth and rank."""
    model = tiny_llama(VOCAB, seed=3, init_scale=0.5)
    target = make_target(loaded(model))
    greedy = SamplingParams(temperature=0)
    plain, _ = run(target, NoDrafter(), greedy, 0, new=24)
    trees = []
    score_tree = target.score_tree
    target.score_tree = lambda tokens, parents: trees.append(len(tokens)) or score_tree(tokens, parents)
    try:
        out, stats = run(target, PathDrafter(plain), greedy, 3, new=24)
    finally:
        del target.score_tree
    assert out == plain
    assert trees and all(n == 3 for n in trees)  # only the two-sibling trees: the pending token and 2 nodes
    assert stats.tree_steps == stats.steps and stats.accepted_tokens > len(trees)  # the paths' nodes counted
    assert stats.accepted_in_tree.get((0, 0), 0) > 0 and stats.accepted_in_tree.get((2, 0), 0) > 0
