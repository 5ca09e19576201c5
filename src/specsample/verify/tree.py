"""Verification of a tree of draft tokens against the target (pure functions).

Terms (as in `verify.chain`, for a tree: SpecInfer, Miao et al. 2024; Recursive Speculative
Decoding, Jeon et al. 2024):
- `draft_tokens` [n]: the tree's nodes, in topological order; `parents` [n]: the index of each
  node's parent, -1 for the children of the *root*, the pending token. A node's *depth* is the
  number of its ancestors; a node at depth d proposes output position d of the step.
- `target_probs` [n + 1, vocab]: row 0 is the target's distribution after the pending token,
  row i + 1 the one after node i (given the text and node i's ancestors and itself), all from
  one pass with tree attention.
- `draft_probs` [n, vocab] or None: draft_probs[i] is the distribution node i was drawn from,
  given its parent and its earlier siblings; None: every node is a point mass (lookup drafters,
  top-k children chosen without a draw).

The walk starts at the root and, at each node, either *accepts* one of its children and
descends to it, or emits a *recovered* token and stops; at a leaf it emits a *bonus* token
drawn from the leaf's row. The accepted path's tokens, then that token, are the step's output.

- Temperature 0 (`greedy_verify_tree`): descend while a child's token is the target's argmax;
  then emit the argmax. With distinct sibling tokens (tree drafters keep them distinct) this is
  the longest root-to-leaf path equal to the target's argmax tokens, plus the target's next token.
- Point-mass children (`rejection_sample_tree`, draft_probs None): draw y from the node's
  target_probs; descend to the child whose token is y, or emit y if no child has it. Every token is
  a draw from the target at its context, so the output is exact; a node's children are accepted
  with the target's mass on them, the most any rule can.
- Sampled children (`rejection_sample_tree` with draft_probs): recursive rejection sampling over
  the siblings. At a node, the residual starts as its target_probs; each child c in order is
  accepted with probability min(1, residual[c] / draft_probs[c][c]), and a rejection replaces the
  residual by norm(max(0, residual - draft_probs[c])); if every child is rejected, the recovered
  token is drawn from the residual. Each round is one step of modified rejection sampling from the
  residual, so by induction over the rounds the node's output follows its target_probs exactly,
  whatever distributions the siblings came from, as long as each sibling was drawn from its own
  draft_probs row given the earlier ones. Which: the project's drafters draw siblings *without
  replacement* (each row is the drafter's distribution with the earlier siblings removed,
  renormalized: recursive rejection sampling), not SpecInfer's independent siblings (every row
  the same): with replacement, siblings repeat and waste nodes, and a repeated sibling is
  rejected for certain, since the first rejection of a token leaves it no residual mass. The
  rule here is the same for both (the tests check both).
- A coupled source (`coupled_verify_tree`, requests with a seed, `verify.coupled`): at each node
  the target's coupled token (the Gumbel-max of its row under the noise of its depth's output
  position); descend if a child has it, else emit it. Every emitted token is the one plain
  decoding emits there, whatever the tree, so this works for point-mass and sampled children
  alike (the draft_probs are not read: they only decide how often a child is the coupled token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specsample.sampling import RandomSource, Rows, SamplingParams, greedy_tokens, gumbel_max, sample, target_rows
from specsample.tree import children_of
from specsample.verify.verdict import Verdict


def walk(draft_tokens: Tensor, parents: Tensor, draw: Callable[[int, int], int]) -> Verdict:
    """Descend from the root while `draw(row, depth)` (the target's token after the node of `row`,
    at output offset `depth`) is a child's token; then emit the drawn token."""
    children, tokens = children_of(parents), draft_tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        token = draw(row, len(path))
        child = next((c for c in children[row] if tokens[c] == token), None)
        if child is None:
            return Verdict(len(path), token, tuple(path))
        path.append(child)
        row = child + 1


def greedy_verify_tree(draft_tokens: Tensor, parents: Tensor, target_logits: Tensor) -> Verdict:
    """Temperature 0: the path of the target's argmax tokens (target_logits [n + 1, vocab]), then its next one."""
    tokens = greedy_tokens(target_logits).tolist()  # [n + 1]
    return walk(draft_tokens, parents, lambda row, depth: tokens[row])


def coupled_verify_tree(
    draft_tokens: Tensor, parents: Tensor, target_probs: Tensor | Rows, noise: Callable[[int], Tensor]
) -> Verdict:
    """The path of the target's coupled tokens: at a node of depth d, gumbel_max(target_probs[row],
    noise(d)), `noise(d)` [vocab] the Gumbel noise of output offset d."""
    return walk(draft_tokens, parents, lambda row, depth: int(gumbel_max(target_probs[row], noise(depth))))


def rejection_sample_tree(
    draft_tokens: Tensor,
    parents: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor | Rows,
    generator: torch.Generator,
) -> Verdict:
    """Point-mass children: the walk of the target's own draws. Sampled children: recursive rejection
    sampling over each node's siblings (module docstring)."""
    if draft_probs is None:
        return walk(draft_tokens, parents, lambda row, depth: sample(target_probs[row], generator))
    children, tokens = children_of(parents), draft_tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        residual = target_probs[row]  # [vocab]
        for child in children[row]:
            token, draft = tokens[child], draft_probs[child]
            uniform = float(torch.rand(1, generator=generator, dtype=torch.float64))
            if uniform * float(draft[token]) < float(residual[token]):
                path.append(child)
                row = child + 1
                break
            residual = subtract(residual, draft)
        else:
            return Verdict(len(path), sample(residual, generator), tuple(path))


def subtract(residual: Tensor, draft: Tensor) -> Tensor:
    """norm(max(0, residual - draft)) [vocab], the residual after a rejected sibling drawn from `draft`.

    Zero only through rounding where the two are equal, and then the rejection had probability
    zero: the residual is kept."""
    diff = (residual - draft).clamp_(min=0.0)
    total = diff.sum()
    return diff / total if total > 0 else residual


@dataclass(frozen=True)
class TreeVerifier:
    """Verifies a tree draft against the target's logits [n + 1, vocab]: `greedy` at temperature 0; else,
    over the target_probs of the request's sampling transform (`sampling.target_rows`: a row is
    computed when the walk reaches its node), the rule its `RandomSource` picks
    (`RandomSource.verify_tree`): `sample` for independent draws from a generator, `coupled` for
    numbers keyed by output position. A test passes one broken on purpose."""

    sample: Callable[[Tensor, Tensor, Tensor | None, Tensor | Rows, torch.Generator], Verdict] = rejection_sample_tree
    coupled: Callable[[Tensor, Tensor, Tensor | Rows, Callable[[int], Tensor]], Verdict] = coupled_verify_tree
    greedy: Callable[[Tensor, Tensor, Tensor], Verdict] = greedy_verify_tree

    def __call__(
        self, draft_tokens: Tensor, parents: Tensor, draft_probs: Tensor | None, target_logits: Tensor,
        params: SamplingParams, random: RandomSource,
    ) -> Verdict:
        """The verdict on the tree `draft_tokens` [n] with `parents` [n] (`verify.tree`)."""
        if params.greedy:
            return self.greedy(draft_tokens, parents, target_logits)
        return random.verify_tree(self, draft_tokens, parents, draft_probs, target_rows(target_logits, params))
