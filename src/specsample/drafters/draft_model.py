"""A separate small draft model with its own KV cache.

Any causal LM with the target's vocabulary. It samples k tokens one at a time
under the same sampling transform as the target, draft token i with the step's
numbers at offset i (`RandomSource.draw`: coupled with the target's token there
for a request with a seed), and returns the distributions it sampled from, so
verification stays exact at any temperature. `draft_cost`, where measured
(`drafters.cost`), is a draft token's cost relative to a target pass (`DeclaresCost`).

With `width` > 1 (`quantized-tree`, `draft-tree:PATH`) the draft is a tree: the
same chain of k tokens (k draft-model passes), plus, at each low-confidence
position (the peak of the draft model's distribution there below `threshold`,
known before the position's token is drawn), up to `width - 1` alternative
children of the chain's node before it. This first version keeps the
alternatives as *leaves*: a leaf needs only its draft probability, from the
distribution the model already computed at its parent, so it costs no
draft-model pass, and the model's cache holds the chain only. At temperature 0
the alternatives are the next most likely tokens after the argmax (point
masses). When sampling they are drawn as `verify.tree`'s recursive rejection
sampling expects (`siblings`): each from the position's distribution with the
earlier siblings (the chain's token first) removed and renormalized, that row
being its draft_probs, with the numbers of the position's offset (at a coupled
source, the Gumbel top-k of that position's noise). How many siblings a node
gets depends on its ancestors and earlier siblings only, so the tree is one the
verifier handles exactly.

Which positions get alternatives is calibrated online (`wants_siblings`): the
rule "peak below `threshold`" is the prior, and the measured rate at which the
chain's own token was rejected, per tenth of the confidence range and for greedy
and sampled requests apart, takes over as verifications accumulate. A peak says
little about rejection when sampling: the chain's token is drawn from the
distribution it came from and is kept with probability about one minus the
distance between the two models, whatever the peak. The quantized copy's
sampled trees put two alternatives at nearly every position, accepted 6% of the
time, and a sampled tree is verified whole (the K policy cannot cut it), so
they were 1.69x plain decoding against the chain's 1.98x (bundled model,
float32 target, t = 1). The counts change between steps only, from what earlier
verifications showed, so a tree's shape still depends on nothing drawn in it.

After verification the cache keeps the accepted chain tokens (`observe`): an
accepted alternative leaf is not the chain's token, so the cache is rolled back
(a length) to the chain's tokens before it, and the leaf is fed at the next draft.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np
import torch
from torch import Tensor

from specsample.drafters.base import Draft
from specsample.models.target import Target
from specsample.policy import CONFIDENCE_BINS, confidence_bins
from specsample.sampling import RandomSource, SamplingParams, draft_confidence, draw_draft_token, probs_from_logits
from specsample.tokens import common_prefix

THRESHOLD = 0.8  # a position whose draft peak is below this gets alternative children, before any evidence
REJECTION_PRIOR = 4.0  # observations the rule `peak < threshold` is worth in each tenth of the confidence range


class DraftModelDrafter:
    is_lookup = False  # it draws its draft

    def __init__(self, model: Target, draft_cost: float | None = None, width: int = 1, threshold: float = THRESHOLD) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.model = model
        self.draft_cost = draft_cost
        self.width, self.threshold = width, threshold
        self.context: list[int] = []
        self.draft: list[int] = []
        self.draft_confidence: list[float] = []  # [k] the chain's peaks
        self.params = SamplingParams()
        # [greedy or sampled, tenth of the confidence range] chain tokens verified, and of them rejected
        self.reached = np.zeros((2, CONFIDENCE_BINS))
        self.rejected = np.zeros((2, CONFIDENCE_BINS))

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.context = prompt_ids.tolist()
        self.params = params
        self.model.rollback(0)  # filled at the first draft (`catch_up`)

    def catch_up(self) -> None:
        """At a request's first draft, prefill the model's cache with the context but its last token. Not
        at `begin`: where the K policy finds that drafting does not pay (a draft model as dear as the
        target, a backend whose pass over several tokens costs several passes), it never drafts, and a
        prefill would cost as much as the target's own for nothing (0.78x plain decoding end to end, a
        Q4_0 draft model for a Q8_0 target on the llamacpp backend, BENCHMARKS.md)."""
        if self.model.length == 0:
            self.model.prefill(torch.tensor(self.context[:-1]))

    def propose(self, k: int, random: RandomSource) -> Draft:
        """A chain of k tokens; with `width` > 1, alternative leaves at its low-confidence positions.
        The time `catch_up` takes is the draft's `setup_seconds`. A chain of k takes the context and k - 1
        positions of the model's window, which may be shorter than the target's: it drafts what fits."""
        k = min(k, self.model.max_length - len(self.context) + 1)
        if k < 1:
            return Draft.empty()
        start = perf_counter()
        self.catch_up()
        setup = perf_counter() - start
        feed = self.context[self.model.length :]  # uncached tail, at least the last token
        tokens, parents, probs, confidence = [], [], [], []
        chain: list[int] = []  # the chain's tokens
        parent = -1  # the chain's last node
        for i in range(k):
            logits = self.model.score(torch.tensor(feed))[-1]  # [vocab]
            step_probs = probs_from_logits(logits, self.params)  # [vocab]
            peak = draft_confidence(logits, step_probs, self.params)
            chain.append(draw_draft_token(step_probs, i, random, self.params))
            node = len(tokens)
            tokens.append(chain[-1])
            parents.append(parent)
            probs.append(step_probs)
            confidence.append(peak)
            if self.width > 1 and self.wants_siblings(peak):
                for token, row in siblings(logits, step_probs, chain[-1], self.width - 1, i, random, self.params):
                    tokens.append(token)
                    parents.append(parent)
                    probs.append(row)
            parent = node
            feed = chain[-1:]
        self.draft, self.draft_confidence = chain, confidence
        as_long = torch.tensor(tokens, dtype=torch.long)
        if self.chain_form(len(tokens) == len(chain)):  # a chain, cut by the K policy on its confidence
            return Draft(as_long, torch.stack(probs), torch.tensor(confidence), setup_seconds=setup)
        draft_probs = None if self.params.greedy else torch.stack(probs)  # [n, vocab]; at t = 0 point masses
        return Draft(as_long, draft_probs, parents=torch.tensor(parents), setup_seconds=setup)

    def observe(self, tokens: list[int]) -> None:
        """Keep the cached positions of the chain's tokens that the text took up; the rest is fed again.
        The last token, the new pending one, is left uncached as after the prompt."""
        valid = len(self.context) + common_prefix(self.draft, tokens[:-1])  # cached context plus accepted chain tokens
        if self.width > 1:
            self.count_rejections(tokens)
        self.context += tokens
        self.draft = []
        self.model.rollback(min(self.model.length, valid))

    def chain_form(self, no_alternatives: bool) -> bool:
        """Whether a draft goes out as a chain with its confidence, which the K policy may cut, rather than
        as a tree, verified whole. Sampled drafts of width > 1 are always trees: whether a position gets
        alternatives depends on the peak after the token drawn before it, so a chain only where none got
        any would make whether a token is verified depend on that token's own value (`Draft`), and bias
        the output (the first token's 0.95 drawn 0.906 under a cut on confidence, a review's bigram
        models). At temperature 0 the output is the target's whatever is verified."""
        return no_alternatives and (self.width == 1 or self.params.greedy)

    def wants_siblings(self, peak: float) -> bool:
        """Whether a chain position whose draft peak is `peak` gets alternatives: where the chain's token
        is rejected more often than 1 - threshold, as measured in the peak's tenth of the confidence range,
        shrunk toward 1 - peak (the rule before evidence)."""
        row, column = int(not self.params.greedy), int(confidence_bins(np.array(peak)))
        rate = (self.rejected[row, column] + REJECTION_PRIOR * (1.0 - peak)) / (self.reached[row, column] + REJECTION_PRIOR)
        return rate > 1.0 - self.threshold

    def count_rejections(self, tokens: list[int]) -> None:
        """Count the chain positions the verification decided, by peak: those up to the first whose token
        the text did not take (an alternative accepted there, or the target's own token), which was
        rejected; a position past the emitted tokens (an end of text) was not decided. A position past a
        cut (`KPolicy.keep`) counts as decided by the bonus token, exactly so at temperature 0."""
        agreed = common_prefix(self.draft, tokens)
        decided = min(agreed + 1, len(self.draft), len(tokens))
        row = int(not self.params.greedy)
        bins = confidence_bins(np.array(self.draft_confidence[:decided]))
        np.add.at(self.reached[row], bins, 1.0)
        np.add.at(self.rejected[row], bins, np.arange(decided) >= agreed)


def siblings(
    logits: Tensor, probs: Tensor, first: int, count: int, offset: int, random: RandomSource, params: SamplingParams
) -> list[tuple[int, Tensor]]:
    """Up to `count` alternative siblings of the token `first` drawn at a position whose draft logits are
    `logits` [vocab] and sampling distribution `probs` [vocab]: (token, the draft_probs row [vocab] it was
    drawn from). At temperature 0 the next most likely tokens (rows: point masses); else each drawn at
    `offset` from `probs` with the earlier siblings removed and renormalized (without replacement, as
    `verify.tree` expects), stopping when no mass is left."""
    if params.greedy:
        ranked = logits.topk(count + 1).indices.tolist()
        return [(token, one_hot(token, probs)) for token in ranked if token != first][:count]
    out: list[tuple[int, Tensor]] = []
    row = probs.clone()
    row[first] = 0.0
    while len(out) < count and float(row.sum()) > 0:
        row = row / row.sum()
        token = random.draw(row, offset)
        out.append((token, row))
        row = row.clone()
        row[token] = 0.0
    return out


def one_hot(token: int, like: Tensor) -> Tensor:
    """A point mass on `token`, shaped as `like` [vocab]."""
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token]), 1.0)
