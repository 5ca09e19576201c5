"""The Drafter protocol: anything that proposes draft tokens for the target to verify.

The engine never asks which drafter it holds. A drafter is told the prompt
(`begin`), asked for up to k tokens (`propose`), then told which tokens the text
grew by (`observe`: the accepted draft tokens, then the recovered or bonus
token), so that it keeps its own state (a KV cache, an index) in step with the
text. The tokens need not be its own draft's: a drafter that was not asked to
propose in a step (see `drafters.fallback`) still observes what the step emitted.

`propose` gets the step's `RandomSource` (`sampling`): a drafter with
probabilities draws draft token i from its draft_probs with `random.draw(probs, i)`,
which, for a request with a seed, uses the numbers of that token's output
position, the ones the target's token there is drawn with (coupled drafting).
A point-mass drafter needs no numbers.

A draft may be a tree (`Draft.parents`): several candidate continuations verified in
one target pass (`verify.tree`). A chain is the special case `parents = None`, so a
chain drafter builds its `Draft` as before. Nodes are in topological order (a
node's parent comes before it), so every prefix of a tree is a tree. A tree drafter
with probabilities draws node i from draft_probs[i], the distribution it gives the
node's position *given its parent and its earlier siblings* (siblings drawn without
replacement, `verify.tree`); at a coupled source it draws the siblings of depth d
with the numbers of offset d.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from specsample.sampling import RandomSource, SamplingParams
from specsample.tree import chain_parents


@dataclass(frozen=True)
class Draft:
    tokens: Tensor  # [k] int64, k may be 0
    probs: Tensor | None  # [k, vocab] draft_probs, or None for a point mass on each token
    # [k] the drafter's estimate that token i is accepted when the tokens before it are, or None;
    # known before token i is drawn. The K policy may verify a prefix of the draft chosen on it,
    # token by token (a stopping rule: whether token i is verified depends on tokens before it only,
    # so verification stays exact).
    confidence: Tensor | None = None
    # [k] int64: the index of each node's parent in `tokens`, -1 for a child of the pending token
    # (`specsample.tree`: every parent before its node); None for a chain (parents i - 1).
    parents: Tensor | None = None
    # Called by the engine with the tokens a pass scored, [pending, draft_tokens...] [k + 1], and their
    # logits [k + 1, vocab] (of the draft as verified: the K policy may have left nodes out), for
    # drafters that learn from them (drafters/recycle.py).
    observe_logits: Callable[[Tensor, Tensor], None] | None = None
    # Seconds of the proposal spent bringing the drafter's own cache up to the context (a draft model's
    # prefill, made at its first draft of a request), not drafting: the engine counts them as prefill,
    # so the K policy does not price draft tokens with them, and a request it never drafts in pays none.
    setup_seconds: float = 0.0

    @staticmethod
    def empty() -> "Draft":
        return Draft(torch.empty(0, dtype=torch.long), None)

    @staticmethod
    def tree(
        tokens: list[int], parents: list[int], observe_logits: Callable[[Tensor], None] | None = None
    ) -> "Draft":
        """A tree of point masses: `tokens` [n] with `parents` [n] (`specsample.tree`)."""
        as_long = lambda values: torch.tensor(values, dtype=torch.long)
        return Draft(as_long(tokens), None, parents=as_long(parents), observe_logits=observe_logits)

    def prefix(self, n: int) -> "Draft":
        """The first n tokens of the draft."""
        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[:n]

        return replace(
            self, tokens=self.tokens[:n], probs=cut(self.probs), confidence=cut(self.confidence), parents=cut(self.parents)
        )

    def select(self, nodes: Tensor) -> "Draft":
        """The draft of the nodes `nodes` [m] (ascending indices, each node's parent among them), their
        parents renumbered: a subtree of a tree, or of a chain a prefix."""
        if self.parents is None or torch.equal(nodes, torch.arange(len(nodes))):
            return self.prefix(len(nodes))
        index = torch.full((len(self) + 1,), -1, dtype=torch.long)  # old index + 1 -> new index; 0: the root
        index[nodes + 1] = torch.arange(len(nodes))

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[nodes]

        parents = index[self.parents[nodes] + 1]
        return replace(
            self, tokens=self.tokens[nodes], probs=pick(self.probs), confidence=pick(self.confidence), parents=parents
        )

    def trunk(self) -> "Draft":
        """A tree of point masses as the chain of its first children (the most likely continuation, as
        lookup drafters order siblings), for a verifier of chains (batched decoding). Exact: the chain,
        like the tree, is a function of the context, not of a draw."""
        if self.parents is None:
            return self
        if self.probs is not None:
            raise ValueError("only a tree of point masses reduces to a chain; this one has draft_probs")
        nodes, parent = [], -1
        for i, p in enumerate(self.parents.tolist()):
            if p == parent:
                nodes.append(i)
                parent = i
        return replace(self, tokens=self.tokens[nodes], confidence=None, parents=None)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def parent_array(self) -> Tensor:
        """[k] int64 parent index of each node, -1 for the pending token's children; i - 1 for a chain."""
        return chain_parents(len(self)) if self.parents is None else self.parents

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@runtime_checkable
class Drafter(Protocol):
    # True for a lookup drafter: its drafts are point masses, a function of the context alone (never
    # of a draw), so which of two drafts is verified may depend on them (drafters/fallback.py).
    is_lookup: bool

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        """Start a request: the context is `prompt_ids` [n]; sample with `params`."""
        ...

    def propose(self, k: int, random: RandomSource) -> Draft:
        """Propose up to k tokens continuing the context; draft token i is drawn with `random.draw(probs, i)`."""
        ...

    def observe(self, tokens: list[int]) -> None:
        """The text grew by `tokens`: the accepted draft tokens, then the recovered or bonus token."""
        ...


@runtime_checkable
class WatchesPlainSteps(Protocol):
    """Learns from the target's logits at plain steps too, where no draft was verified: the engine shows
    them through the empty draft it verifies (`plain_draft`), timed as drafting."""

    def observe_plain(self, scored: Tensor, logits: Tensor) -> None:
        """A plain step scored `scored` [1] (the pending token) with `logits` [1, vocab]."""
        ...


def plain_draft(drafter: Drafter) -> Draft:
    """The empty draft of a plain step (K = 0): carrying the drafter's `observe_plain` hook where it has
    one (`WatchesPlainSteps`). Decided once a request: a protocol's isinstance check costs about 10 us."""
    if isinstance(drafter, WatchesPlainSteps):
        return replace(Draft.empty(), observe_logits=drafter.observe_plain)
    return Draft.empty()


@runtime_checkable
class Forks(Protocol):
    """Makes drafters for other requests decoded at the same time (batched decoding, batch.py).

    A fork keeps its own per-request state (the context it was told) and shares with this drafter
    only what a drafter learns across requests (the suffix drafter's tree of earlier requests). A
    drafter that keeps a model's cache of its own (draft model, head, layer skipping, quantized copy)
    does not fork: each fork would need a cache and a pass of its own.
    """

    def fork(self) -> Drafter:
        """A drafter for another request, sharing this one's learned state."""
        ...


@runtime_checkable
class DeclaresCost(Protocol):
    """Knows what drafting costs before it drafts: a draft model measures its pass against the
    target's when it is made (`drafters.cost`). The K policy starts from it (`policy.SeesDraftCost`)
    instead of trying a drafter whose token may cost more than any acceptance repays."""

    # Seconds per draft token over seconds of a target pass over one token; None where not measured.
    draft_cost: float | None


@runtime_checkable
class EndsRequests(Protocol):
    """Keeps what a request taught it once the request ends (the suffix drafter files its text under the
    history it drafts later requests from, and evicts the oldest). Without `end` that happens at the next
    `begin`, which a batch's fork may never get: a batch thrown away would leave its slots' last requests
    counted for good, outside the history's bound."""

    def end(self) -> None:
        """The request ended."""
        ...


def end_request(drafter: Drafter) -> None:
    """Tell `drafter` its request ended, where it keeps something from it (`EndsRequests`)."""
    if isinstance(drafter, EndsRequests):
        drafter.end()


def draft_cost(drafter: Drafter) -> float | None:
    """The drafter's declared cost per draft token relative to a target pass (`DeclaresCost`), or None."""
    return drafter.draft_cost if isinstance(drafter, DeclaresCost) else None


def forked(drafter: Drafter) -> Drafter:
    """A fork of `drafter` (`Forks`), or a one-line error naming it where it does not fork."""
    if not isinstance(drafter, Forks):
        raise ValueError(
            f"batched decoding drafts with drafters that fork (none, ngram, suffix, recycle, and A+B of them); "
            f"{type(drafter).__name__} keeps a model's cache of its own"
        )
    return drafter.fork()
