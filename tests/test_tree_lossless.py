"""Losslessness of tree verification (`verify.tree`): one verification step over a tree draft
reproduces the target's distribution exactly.

As in tests/test_lossless.py: a tiny vocabulary, the exact target distribution over every
sequence of SEQ_LEN new tokens enumerated, N_SAMPLES samples compared with it by a chi-square
test at level ALPHA, fixed seeds; the real verifier must pass and one broken on purpose must be
rejected. To stay fast, the target and the drafter are tables (the distribution of output
position j after the last two tokens, `Tables`) rather than models, drafts are drawn for all
samples at once, and each sample is one verification step (the real `TreeVerifier`) over a tree
drafted from the prompt, completed to SEQ_LEN tokens by drawing from the target: the completion
is exact, so any bias of the step shows in the counts. The engine's own loop over tree drafts is
tested in tests/test_tree_engine.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specsample.sampling import CoupledSource, GeneratorSource, SamplingParams, gumbel_max, position_noise, probs_from_logits, sample
from specsample.verify.check import chi_square_p
from specsample.tree import children_of, depths
from specsample.verify.tree import TreeVerifier, greedy_verify_tree
from specsample.verify.verdict import Verdict

ALPHA = 1e-3
N_SAMPLES = 50_000
SEQ_LEN = 3
VOCAB = 8
POSITIONS = 8  # output positions the tables cover: a tree reaches past SEQ_LEN
PROMPT = (1, 2)

SHAPES = {  # parents of each node, topological
    "chain": [-1, 0, 1],
    "binary": [-1, -1, 0, 0, 1, 1],
    "mixed": [-1, -1, 0, 2, 2, -1, 4],  # a third child of the root after deeper nodes
}
PARAMS = {"t1": SamplingParams(temperature=1.0), "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9)}


class Tables:
    """Target and draft logits of output position j after tokens (b, a): [POSITIONS, VOCAB, VOCAB, VOCAB]."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.target = torch.randn(POSITIONS, VOCAB, VOCAB, VOCAB, generator=gen) * 1.5
        self.draft = self.target + torch.randn(self.target.shape, generator=gen) * 1.0

    @staticmethod
    def key(context: tuple[int, ...]) -> tuple[int, int, int]:
        """(position, b, a) of the next token after PROMPT + context."""
        full = PROMPT + context
        return len(context), full[-2], full[-1]

    def exact(self, params: SamplingParams) -> np.ndarray:
        """P(x_1..x_SEQ_LEN) over all VOCAB**SEQ_LEN sequences, in itertools.product order."""
        probs = probs_from_logits(self.target, params).double()
        out = []
        for seq in itertools.product(range(VOCAB), repeat=SEQ_LEN):
            p = 1.0
            for j, x in enumerate(seq):
                p *= float(probs[self.key(seq[:j])][x])
            out.append(p)
        return np.array(out)


def contexts(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """[n + 1] the context (tokens after the prompt) of the root, then of each node, itself included."""
    out: list[tuple[int, ...]] = [()]
    for token, parent in zip(tokens, parents):
        out.append(out[parent + 1] + (token,))
    return out


def draw_trees(tables: Tables, parents: list[int], params: SamplingParams, gen: torch.Generator, replace: bool):
    """N_SAMPLES sampled trees: tokens [S, n], draft_probs [S, n, VOCAB] and the target's logits
    [S, n + 1, VOCAB]; each node drawn from the draft table at its context, siblings without
    replacement (or independently, `replace`). The draft is not cut by top-p (a tree needs as many
    tokens with mass as siblings): verification is exact whatever distribution a node was drawn from."""
    n = len(parents)
    probs = probs_from_logits(tables.draft, SamplingParams(temperature=params.temperature))  # [P, V, V, V]
    tokens = torch.zeros(N_SAMPLES, n, dtype=torch.long)
    rows = torch.zeros(N_SAMPLES, n, VOCAB)
    logits = torch.zeros(N_SAMPLES, n + 1, VOCAB)
    depth = depths(torch.tensor(parents)).tolist()
    prompt_a = torch.full((N_SAMPLES,), PROMPT[-1])
    prompt_b = torch.full((N_SAMPLES,), PROMPT[-2])
    last = {-1: (prompt_b, prompt_a)}  # node -> (second to last, last) tokens of its context
    logits[:, 0] = tables.target[0, prompt_b, prompt_a]
    for i, parent in enumerate(parents):
        b, a = last[parent]
        row = probs[depth[i], b, a].clone()  # [S, V]
        if not replace:
            for sibling in range(i):
                if parents[sibling] == parent:
                    row.scatter_(1, tokens[:, sibling : sibling + 1], 0.0)
        row /= row.sum(1, keepdim=True)
        tokens[:, i] = torch.multinomial(row, 1, generator=gen)[:, 0]
        rows[:, i] = row
        last[i] = (a, tokens[:, i])
        logits[:, i + 1] = tables.target[depth[i] + 1, a, tokens[:, i]]
    return tokens, rows, logits


def top_k_tree(tables: Tables, parents: list[int], params: SamplingParams) -> list[int]:
    """A point-mass tree: the r-th child of a node is the draft's r-th most likely token there."""
    probs = probs_from_logits(tables.draft, params)
    tokens: list[int] = []
    for i, parent in enumerate(parents):
        context = contexts(tokens, parents[:i])[parent + 1]
        rank = sum(1 for s in range(i) if parents[s] == parent)
        tokens.append(int(probs[Tables.key(context)].argsort(descending=True)[rank]))
    return tokens


def target_logits(tables: Tables, tokens: list[int], parents: list[int]) -> torch.Tensor:
    """[n + 1, VOCAB] the target's logits after the root and after each node."""
    return torch.stack([tables.target[Tables.key(c)] for c in contexts(tokens, parents)])


def complete(tables: Tables, outputs: list[list[int]], params: SamplingParams, gen: torch.Generator) -> np.ndarray:
    """Counts [VOCAB**SEQ_LEN] of the outputs cut to SEQ_LEN tokens, each completed by drawing from the target."""
    probs = probs_from_logits(tables.target, params)
    seqs = torch.zeros(len(outputs), SEQ_LEN, dtype=torch.long)
    lengths = torch.tensor([min(len(o), SEQ_LEN) for o in outputs])
    for s, out in enumerate(outputs):
        seqs[s, : lengths[s]] = torch.tensor(out[:SEQ_LEN])
    full = torch.cat([torch.tensor(PROMPT).expand(len(outputs), -1), seqs], 1)  # [S, 2 + L]
    for j in range(SEQ_LEN):
        todo = lengths <= j
        rows = probs[j, full[todo, j], full[todo, j + 1]]  # [m, V]: after tokens j, j + 1 of prompt + output
        full[todo, j + 2] = torch.multinomial(rows, 1, generator=gen)[:, 0]
    index = (full[:, 2:] * VOCAB ** torch.arange(SEQ_LEN - 1, -1, -1)).sum(1)
    return np.bincount(index.numpy(), minlength=VOCAB**SEQ_LEN).astype(float)


def sampled_counts(
    kind: str, shape: str, params: SamplingParams, verifier: TreeVerifier = TreeVerifier(), seed: int = 1234
) -> tuple[np.ndarray, np.ndarray]:
    """(observed counts, exact probabilities) of N_SAMPLES one-step tree verifications."""
    tables = Tables()
    parents = SHAPES[shape]
    parent_tensor = torch.tensor(parents)
    gen = torch.Generator().manual_seed(seed)
    source = GeneratorSource(gen)
    outputs = []
    if kind == "point-mass":
        tokens = top_k_tree(tables, parents, params)
        logits = target_logits(tables, tokens, parents)
        draft = torch.tensor(tokens)
        for _ in range(N_SAMPLES):
            verdict = verifier(draft, parent_tensor, None, logits, params, source)
            outputs.append([tokens[i] for i in verdict.path] + [verdict.next_token])
    else:
        all_tokens, all_rows, all_logits = draw_trees(tables, parents, params, gen, replace=kind == "sampled-iid")
        for tokens, rows, logits in zip(all_tokens, all_rows, all_logits):
            token_list = tokens.tolist()
            verdict = verifier(tokens, parent_tensor, rows, logits, params, source)
            outputs.append([token_list[i] for i in verdict.path] + [verdict.next_token])
    return complete(tables, outputs, params, gen), tables.exact(params)


CASES = [
    *[("point-mass", shape, "t1") for shape in SHAPES],
    ("point-mass", "binary", "t0.7-top_p0.9"),
    *[("sampled", shape, "t1") for shape in SHAPES],
    ("sampled", "mixed", "t0.7-top_p0.9"),
    ("sampled-iid", "binary", "t1"),  # SpecInfer's independent siblings, the same rule
]


@pytest.mark.parametrize("kind,shape,name", CASES)
def test_tree_verification_matches_target_distribution(kind, shape, name):
    observed, exact = sampled_counts(kind, shape, PARAMS[name])
    p = chi_square_p(observed, exact)
    assert p > ALPHA, f"{kind} {shape} {name}: p = {p:.2e}"


def no_residual_update(draft_tokens, parents, draft_probs, target_probs, generator) -> Verdict:
    """A broken verifier: siblings tried in turn as by recursive rejection sampling (a point mass as a
    one-hot row), but a rejected sibling leaves the residual unchanged, so its mass is drawn again."""
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs[0].shape[-1]).float()
    children, tokens = children_of(parents), draft_tokens.tolist()
    path, row = [], 0
    while True:
        residual = target_probs[row]
        for child in children[row]:
            if float(torch.rand(1, generator=generator)) * float(draft_probs[child][tokens[child]]) < float(residual[tokens[child]]):
                path.append(child)
                row = child + 1
                break
        else:
            return Verdict(len(path), sample(residual, generator), tuple(path))


@pytest.mark.parametrize("kind,shape,name", [("point-mass", "binary", "t1"), ("sampled", "binary", "t1"),
                                             ("point-mass", "binary", "t0.7-top_p0.9"), ("sampled", "mixed", "t0.7-top_p0.9")])
def test_broken_tree_verifier_is_rejected(kind, shape, name):
    observed, exact = sampled_counts(kind, shape, PARAMS[name], verifier=TreeVerifier(sample=no_residual_update))
    p = chi_square_p(observed, exact)
    assert p < ALPHA, f"no_residual_update passed on {kind} {shape} {name}: p = {p:.2e}"


def plain_coupled(tables: Tables, seed: int, params: SamplingParams, length: int) -> list[int]:
    """What plain decoding emits with `seed` under the coupled source: each position's Gumbel-max."""
    out: list[int] = []
    for j in range(length):
        probs = probs_from_logits(tables.target[Tables.key(tuple(out))], params)
        out.append(int(gumbel_max(probs, position_noise(seed, j, VOCAB))))
    return out


@pytest.mark.parametrize("kind", ["point-mass", "sampled"])
def test_coupled_tree_gives_plain_decoding_text(kind):
    """A seeded request: the step's tokens are plain decoding's with that seed, whatever the tree (its
    siblings drawn from the draft table by Gumbel top-k under the numbers of their depth)."""
    tables, params = Tables(), PARAMS["t1"]
    parents = SHAPES["mixed"]
    depth = depths(torch.tensor(parents)).tolist()
    draft_probs = probs_from_logits(tables.draft, params)
    accepted = 0
    for seed in range(300):
        source = CoupledSource(seed)
        if kind == "point-mass":
            tokens = top_k_tree(tables, parents, params)
        else:
            tokens = []
            for i, parent in enumerate(parents):
                context = contexts(tokens, parents[:i])[parent + 1]
                scores = draft_probs[Tables.key(context)].double().log() + source.noise(depth[i], VOCAB)
                rank = sum(1 for s in range(i) if parents[s] == parent)
                tokens.append(int(scores.argsort(descending=True)[rank]))
        logits = target_logits(tables, tokens, parents)
        verdict = TreeVerifier()(torch.tensor(tokens), torch.tensor(parents), None, logits, params, source)
        emitted = [tokens[i] for i in verdict.path] + [verdict.next_token]
        assert emitted == plain_coupled(tables, seed, params, len(emitted)), f"seed {seed}"
        accepted += verdict.accepted
    assert accepted > 0  # some steps accept a node, so the comparison covers the walk


def test_greedy_takes_the_longest_matching_path():
    """Temperature 0: the path of the target's argmax tokens, through a later sibling, then the next argmax."""
    parents = torch.tensor([-1, -1, 1, 2, 0])
    tokens = torch.tensor([3, 5, 6, 7, 4])
    argmax = [5, 9, 6, 7, 0, 0]  # after the root, then after nodes 0 to 4
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()  # [n + 1, 10]
    verdict = greedy_verify_tree(tokens, parents, logits)
    assert verdict.path == (1, 2, 3) and verdict.accepted == 3 and verdict.next_token == 0
    verdict = greedy_verify_tree(tokens, parents, torch.nn.functional.one_hot(torch.tensor([3, 1, 0, 0, 0, 0]), 10).float())
    assert verdict.path == (0,) and verdict.next_token == 1
