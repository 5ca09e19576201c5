"""The `head-tree` drafter: EAGLE-2's dynamic draft tree (Li et al., 2024) from the head (drafters/head.py).

The head drafts a tree in a few passes. Every candidate node has a *score*, the
cumulative draft probability of its path (a sum of log probabilities). The
pending token's distribution gives the first `topk` candidates; at each further
depth the `topk` candidates of the latest depth with the highest score are
*expanded*: the head runs over them (and their expanded ancestors, with tree
attention, on the cache of the context) to predict their features, and the
`topk` most likely tokens after each become candidates of the next depth. After
`depth` depths (at most K; 4 by default), the draft is the K candidates of highest score (the
*rerank*: a child's score is at most its parent's, so the chosen set keeps every
ancestor of a chosen node), in the order they were made, siblings most likely first.

A node's distribution is the head's over its token subset: the softmax of its
logits at temperature 0, the request's sampling transform of them otherwise.
The tree is a function of the context alone (the head is deterministic on the
target's features), never of a draw: the nodes are point masses, verified exactly
at any temperature by the point-mass walk (`verify.tree`), and the tree-size
policy may verify any prefix of it. The head's cache is rolled back (a length) to
the context after drafting; the accepted path's positions are recomputed from the
target's true features as for a chain (`HeadDrafter.observe`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specsample.drafters.base import Draft
from specsample.drafters.head import HeadDrafter
from specsample.sampling import RandomSource, probs_from_logits

TOPK = 4  # children of an expanded node, and nodes expanded per depth
DEPTH = 4  # depths of candidates, at most K (6 drafted no longer accepted paths on the bundled model)


class HeadTreeDrafter(HeadDrafter):
    """Drafts EAGLE-2's dynamic tree of K nodes with the head."""

    def __init__(self, *args, topk: int = TOPK, depth: int = DEPTH, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if topk < 1 or depth < 1:
            raise ValueError(f"need topk >= 1 and depth >= 1, got {topk} and {depth}")
        self.topk, self.depth = topk, depth

    @torch.inference_mode()
    def propose(self, k: int, random: RandomSource) -> Draft:
        self.catch_up()
        if self.feature is None or k == 0:
            return Draft.empty()
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # cumulative log draft probability of each candidate's path
        features: dict[int, Tensor] = {}  # expanded candidate -> its predicted feature [hidden]
        latest = self.expand(-1, self.logits, 0.0, tokens, parents, scores)
        for _ in range(min(self.depth, k) - 1):
            if self.decoder.length + len(tokens) > self.decoder.max_length:  # no room for the next depth's pass
                break
            chosen = sorted(latest, key=lambda node: (-scores[node], node))[: self.topk]
            logits = self.run_tree(chosen, tokens, parents, features)  # [len(chosen), subset]
            latest = [
                child
                for node, row in zip(chosen, logits)
                for child in self.expand(node, row, scores[node], tokens, parents, scores)
            ]
        keep = sorted(sorted(range(len(tokens)), key=lambda node: (-scores[node], node))[:k])
        index = {node: i for i, node in enumerate(keep)}
        kept_parents = [-1 if parents[node] < 0 else index[parents[node]] for node in keep]
        return Draft.tree([tokens[node] for node in keep], kept_parents)

    def expand(
        self, node: int, logits: Tensor, score: float, tokens: list[int], parents: list[int], scores: list[float]
    ) -> list[int]:
        """Add the `topk` most likely tokens after `node` (-1: the pending token), whose head logits are
        `logits` [subset], as candidates; return their indices."""
        probs = logits.float().softmax(-1) if self.params.greedy else probs_from_logits(logits, self.params)  # [subset]
        top = probs.topk(min(self.topk, probs.shape[0]))
        children = []
        for p, i in zip(top.values.tolist(), top.indices.tolist()):
            if p > 0:
                children.append(len(tokens))
                tokens.append(int(self.token_ids[i]))
                parents.append(node)
                scores.append(score + math.log(p))
        return children

    def run_tree(self, chosen: list[int], tokens: list[int], parents: list[int], features: dict[int, Tensor]) -> Tensor:
        """Run the head over the `chosen` candidates and their ancestors as one tree on the context's cache;
        keep the chosen ones' predicted features, return their subset logits [len(chosen), subset]."""
        nodes: set[int] = set()
        for node in chosen:
            while node >= 0 and node not in nodes:
                nodes.add(node)
                node = parents[node]
        order = sorted(nodes)  # parents first
        row = {node: i for i, node in enumerate(order)}
        inputs = torch.cat([self.feature if parents[n] < 0 else features[parents[n]][None] for n in order])  # [m, hidden]
        tree = torch.tensor([-1 if parents[n] < 0 else row[parents[n]] for n in order], dtype=torch.long)
        base = self.decoder.length
        x = self.fc(torch.cat([inputs.float(), self.embed[torch.tensor([tokens[n] for n in order])]], -1))  # [m, hidden]
        self.decoder.forward_embeddings(x, logits=False, parents=tree)
        self.decoder.rollback(base)
        hidden = self.decoder.last_hidden[[row[node] for node in chosen]]  # [len(chosen), hidden]
        features.update(zip(chosen, hidden))
        return self.decoder.lm_head(hidden)  # the subset logits of the chosen rows only
