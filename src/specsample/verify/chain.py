"""Verification of a chain of draft tokens against the target (pure functions).

Terms (Chen et al. 2023; Leviathan et al. 2023):
- `draft_tokens` [k]: the tokens the drafter proposed, in order.
- `draft_probs` [k, vocab]: the distribution each draft token was sampled from,
  after the same sampling transform as the target; None means a point mass on
  each draft token (drafters without probabilities, such as n-gram lookup).
- `target_probs` [k + 1, vocab]: the target's distribution at each draft
  position, plus one after the last draft token.
- A draft token x at position i is *accepted* with probability
  min(1, target_probs[i, x] / draft_probs[i, x]). At the first rejection a
  *recovered* token is drawn from norm(max(0, target_probs[i] - draft_probs[i]));
  when all k are accepted a *bonus* token is drawn from target_probs[k].
The emitted tokens then follow the target distribution exactly.

`ChainVerifier` bundles this rule with greedy verification and with coupled
verification (`verify.coupled`, for requests with a seed); the request's
`RandomSource` picks the rule that fits its numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specsample.sampling import RandomSource, Rows, SamplingParams, greedy_tokens, sample, target_rows
from specsample.verify.coupled import coupled_verify
from specsample.verify.tree import TreeVerifier
from specsample.verify.verdict import Verdict, match_tokens


def rejection_sample(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor | Rows,
    generator: torch.Generator,
) -> Verdict:
    """Modified rejection sampling over one chain of draft tokens, reading target_probs only up to the
    first rejection (`sampling.Rows`: the rows after it are never computed)."""
    k = draft_tokens.shape[0]
    uniform = torch.rand(k, generator=generator, dtype=torch.float64)  # [k]; float64, as the tree verifier's
    for i, token in enumerate(draft_tokens.tolist()):
        draft_p = 1.0 if draft_probs is None else draft_probs[i, token]
        if not bool(uniform[i] * draft_p < target_probs[i][token]):
            return Verdict(i, sample(residual(draft_tokens, draft_probs, target_probs, i), generator))
    return Verdict(k, sample(target_probs[k], generator))


def residual(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor | Rows, i: int) -> Tensor:
    """norm(max(0, target_probs[i] - draft_probs[i])) [vocab], the recovery distribution."""
    if draft_probs is None:
        diff = target_probs[i].clone()
        diff[draft_tokens[i]] = 0.0
    else:
        diff = (target_probs[i] - draft_probs[i]).clamp_(min=0.0)
    total = diff.sum()
    # Zero only through rounding when the two distributions are equal, where the
    # rejection itself had probability zero; fall back to the target's own row.
    return diff / total if total > 0 else target_probs[i]


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor) -> Verdict:
    """Temperature 0: accept the longest prefix equal to the target's argmax tokens [k + 1]."""
    return match_tokens(draft_tokens, greedy_tokens(target_logits))


@dataclass(frozen=True)
class ChainVerifier:
    """Verifies a chain draft against the target's logits [k + 1, vocab]: `greedy` at temperature 0;
    else, over the target_probs of the request's sampling transform (`sampling.target_rows`: each row
    computed when the rule first reads it), the rule its `RandomSource` picks: `sample` (modified
    rejection sampling) for independent draws from a generator, `coupled` (token comparison,
    `verify.coupled`) for numbers keyed by output position. The engine
    takes one as an argument, so a check can pass a verifier broken on purpose (`verify.check.BROKEN`);
    `tree` verifies tree drafts under the same rules (`verify.tree`)."""

    sample: Callable[[Tensor, Tensor | None, Tensor | Rows, torch.Generator], Verdict] = rejection_sample
    coupled: Callable[[Tensor, Tensor | Rows, Tensor | Rows], Verdict] = coupled_verify
    greedy: Callable[[Tensor, Tensor], Verdict] = greedy_verify
    tree: TreeVerifier = TreeVerifier()

    def __call__(
        self,
        draft_tokens: Tensor,
        draft_probs: Tensor | None,
        target_logits: Tensor,
        params: SamplingParams,
        random: RandomSource,
    ) -> Verdict:
        if params.greedy:
            return self.greedy(draft_tokens, target_logits)
        return random.verify(self, draft_tokens, draft_probs, target_rows(target_logits, params))
