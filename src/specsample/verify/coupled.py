"""Verification of a coupled draft: compare tokens (pure functions).

Terms (as in `verify.chain`, for a request with a seed, `sampling.CoupledSource`):
- `noise` [k + 1, vocab]: the standard Gumbel noise of the output positions of
  the k draft tokens and of the token after them, a function of (seed,
  position) alone (`sampling.position_noise`).
- The target's *coupled token* at a position is gumbel_max(target_probs, noise)
  there: the token plain decoding emits at that position with that seed.
- `draft_tokens` [k] were drawn the same way from the drafter's own draft_probs
  (or proposed by a point-mass drafter); `target_probs` [k + 1, vocab] are the
  target's distributions at the draft positions, plus one after the last.
- Draft token i is *accepted* while it equals the target's coupled token at its
  position; the first mismatch emits the target's coupled token there
  (recovered), and a wholly accepted draft emits the coupled token after it
  (bonus).

Every emitted token is then the one plain decoding emits at its position: the
first position's target_probs follow the same text, so they are the same, and
by induction so is every later one. The output is identical to plain decoding
with the same seed whatever was drafted, and exactly distributed as the target,
since Gumbel-max is an exact draw. A draft only decides how many tokens a step
emits: one drawn from the drafter's own distribution under the same numbers is
the target's coupled token wherever their Gumbel-max agree.

For a tree of drafts the rule is the same per node: a child is accepted if it
is the coupled token of its parent's target_probs under the noise of its depth
(`coupled_tokens` over the nodes' rows).
"""

from __future__ import annotations

from torch import Tensor

from specsample.sampling import Rows, gumbel_max
from specsample.verify.verdict import Verdict


def coupled_tokens(target_probs: Tensor, noise: Tensor) -> Tensor:
    """The target's coupled tokens [n] at n positions: target_probs [n, vocab] under noise [n, vocab]
    (or the token [] of one position, from rows [vocab])."""
    return gumbel_max(target_probs, noise)


def coupled_verify(draft_tokens: Tensor, target_probs: Tensor | Rows, noise: Tensor | Rows) -> Verdict:
    """Accept draft tokens [k] while each equals the target's coupled token (target_probs [k + 1, vocab],
    noise [k + 1, vocab]: tensors, or `sampling.Rows` read only up to the first mismatch), then emit
    the coupled token at the first mismatch or after the draft."""
    for i, token in enumerate(draft_tokens.tolist()):
        coupled = int(coupled_tokens(target_probs[i], noise[i]))
        if coupled != token:
            return Verdict(i, coupled)
    k = draft_tokens.shape[0]
    return Verdict(k, int(coupled_tokens(target_probs[k], noise[k])))
