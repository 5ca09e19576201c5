"""The `recycle` drafter: Token Recycling (Luo et al., 2024), no model and no training.

For every token x it keeps the `width` tokens the target's own distributions
put most likely after x: each verification pass scores the pending token and
the draft's nodes, and the top-`width` of each scored row replace that token's
entry (the logits are computed anyway, so the table costs no target work;
`Draft.observe_logits` is how the engine shows them), and so does a plain
step's row (`observe_plain`): a refresh is one pass over a row
(`sampling.top_indices`, about 20 us for 49,152 tokens, 0.5% of a plain step
on the blocks; torch.topk took 0.1 to 0.25 ms). At temperature 0 every emitted
token is the target's argmax after the token before it, so `observe` makes it
that token's rank 0 too. To draft, it expands a
tree of fixed shape from the pending token: the node of template rank r under
a node of token x is x's r-th token, where the table knows one.

The template (`template`) is the same for every step of a given size: the n
paths of ranks with the highest prior acceptance, a product over the path of
`RANK_PRIOR[r]` (the chance that the target's next token is the r-th of the
table), so the shape is fixed and every ancestor of a chosen path is chosen.
`recycle-chain` is the same drafter with only rank 0: a chain.

The draft is a function of the text and the logits of earlier passes, never of
a draw (point masses, `is_lookup`), so it is verified exactly at any
temperature. It drafts trees, so it needs a target that scores them
(`ScoresTrees`), except as `recycle-chain`; in a batch (batch.py) its forks share one table, and their
trees are verified as their trunks.
"""

from __future__ import annotations

import copy
import heapq
from functools import cache

from torch import Tensor

from specsample.drafters.base import Draft
from specsample.sampling import RandomSource, SamplingParams, top_indices

WIDTH = 8  # tokens kept per token
RANK_PRIOR = (0.6, 0.15, 0.07, 0.04, 0.025, 0.015, 0.01, 0.005)  # prior P(target's token is rank r)


@cache
def template(n: int, ranks: int) -> tuple[tuple[int, int], ...]:
    """The (parent, rank) of each of the n template nodes, parents first: the n rank paths of highest
    prior, expanded best first (a child's prior is below its parent's, so ancestors come first)."""
    heap = [(-RANK_PRIOR[r], r, -1, r) for r in range(ranks)]  # (-prior, tie order, parent, rank)
    nodes: list[tuple[int, int]] = []
    order = ranks
    while heap and len(nodes) < n:
        prior, _, parent, rank = heapq.heappop(heap)
        nodes.append((parent, rank))
        for r in range(ranks):
            heapq.heappush(heap, (prior * RANK_PRIOR[r], order, len(nodes) - 1, r))
            order += 1
    return tuple(nodes)


class RecycleDrafter:
    is_lookup = True  # point masses, a function of the text and earlier passes, never of a draw

    def __init__(self, width: int = WIDTH, ranks: int = 4) -> None:
        if not 1 <= ranks <= min(width, len(RANK_PRIOR)):
            raise ValueError(f"need 1 <= ranks <= {min(width, len(RANK_PRIOR))}, got {ranks}")
        self.width, self.ranks = width, ranks
        self.next: dict[int, list[int]] = {}  # token -> the target's top-`width` next tokens, best first
        self.pending = -1
        self.greedy = False

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        """The table carries over from earlier requests: it is the target's own, for any text."""
        self.pending = int(prompt_ids[-1])
        self.greedy = params.greedy

    def propose(self, k: int, random: RandomSource) -> Draft:
        """A tree of up to k nodes of the template's shape under the pending token."""
        tokens: list[int] = []
        parents: list[int] = []
        kept: list[int] = []  # template node -> index in the draft, -1 where the table has no token
        for parent, rank in template(k, self.ranks):
            if parent >= 0 and kept[parent] < 0:  # under a node the table could not fill
                kept.append(-1)
                continue
            following = self.next.get(self.pending if parent < 0 else tokens[kept[parent]], ())
            if rank < len(following):
                kept.append(len(tokens))
                parents.append(-1 if parent < 0 else kept[parent])
                tokens.append(following[rank])
            else:
                kept.append(-1)
        return Draft.tree(tokens, parents, self.refresh)

    def refresh(self, scored: Tensor, logits: Tensor) -> None:
        """Each scored token's entry ([n + 1]) becomes the top-`width` tokens of its row of `logits` [n + 1, vocab]."""
        top = top_indices(logits, self.width).tolist()  # [n + 1, width]
        for token, row in zip(scored.tolist(), top):
            self.next[token] = row

    def observe_plain(self, scored: Tensor, logits: Tensor) -> None:
        """A plain step's row ([1], [1, vocab]; `WatchesPlainSteps`) refreshes the pending token's entry."""
        self.refresh(scored, logits)

    def observe(self, tokens: list[int]) -> None:
        """The step's emitted tokens; at temperature 0 each is the target's argmax after the one before it,
        so it becomes that token's rank 0."""
        if self.greedy:
            for before, token in zip([self.pending, *tokens[:-1]], tokens):
                self.rank_first(before, token)
        self.pending = tokens[-1]

    def fork(self) -> RecycleDrafter:
        """A drafter for another request decoded at the same time (`base.Forks`): its own context, this
        one's table, which is the target's for any text, so every request's passes refresh it for all."""
        fork = copy.copy(self)  # `next` shared, not copied
        fork.pending, fork.greedy = -1, False
        return fork

    def rank_first(self, before: int, token: int) -> None:
        """`token` becomes `before`'s rank 0, the entry's other tokens kept, in order, behind it."""
        row = self.next.get(before, [])
        if not row or row[0] != token:
            self.next[before] = [token, *(t for t in row if t != token)][: self.width]


class RecycleChainDrafter(RecycleDrafter):
    """Token Recycling's table drafting a chain (rank 0 only): the tree's baseline at equal cost. Its
    tree is one path, which the engine verifies as a chain on any target (`engine.verify`), so it
    drafts for targets that score chains only (llama.cpp's) too."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__(width, ranks=1)
