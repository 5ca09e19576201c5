"""What a verifier decides, and the token-comparison rule that greedy and coupled verification share."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of leading draft tokens accepted
    next_token: int  # the recovered token (on a rejection) or the bonus token


def leading_true(mask: Tensor) -> Tensor:
    """Number of leading True values of a 1-D bool tensor."""
    return mask.int().cumprod(0).sum()


def match_tokens(draft_tokens: Tensor, target_tokens: Tensor) -> Verdict:
    """Accept the longest prefix of `draft_tokens` [k] equal to `target_tokens` [k + 1], the target's
    own token at each position given the draft before it; then emit the target's token at the first
    mismatch (recovered) or after the last draft token (bonus)."""
    k = draft_tokens.shape[0]
    accepted = int(leading_true(draft_tokens == target_tokens[:k]))
    return Verdict(accepted, int(target_tokens[accepted]))
