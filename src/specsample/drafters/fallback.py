"""The `A+B` drafters: draft with a lookup drafter when it finds a match, else with a model.

After SuffixDecoding's hybrid with a model drafter (ArcticInference): a lookup
drafter (`suffix`, `ngram`) costs almost nothing and drafts long runs where the
text repeats its context or earlier answers; a model drafter (`head`,
`quantized`) predicts the target where nothing repeats. Each step asks `first`;
its draft is verified if it holds at least `min_tokens` tokens (a short
draft comes from a short, unreliable match), otherwise `second` drafts. `first`
is asked for at least `min_tokens` tokens whatever K is, and its draft cut to
K: which drafter drafts depends on the match, not on K. Judged on K tokens, at
K = 1 every 1-token match replaced `second`'s draft, and a K policy that
measured their mix (at t = 1 lookups accepted at 0.17, the int8 copy at 0.95)
stayed at K = 1. Both observe every step, so either can draft the next one.

Lossless: `first` must propose point masses (a deterministic function of the
context), so the choice between the two drafts depends on the context alone,
never on a draw, and each step verifies a draft exactly as its drafter made it.
"""

from __future__ import annotations

from torch import Tensor

from specsample.drafters.base import Draft, Drafter, WatchesPlainSteps, end_request, forked
from specsample.sampling import RandomSource, SamplingParams

MIN_TOKENS = 3  # the shortest draft of `first` that is verified instead of asking `second`


def check_lookup(drafter: Drafter, name: str) -> None:
    """Refuse a first drafter of A+B that is not a lookup drafter (`Drafter.is_lookup`)."""
    if not drafter.is_lookup:
        raise ValueError(
            f"the first drafter of A+B must be a lookup drafter (ngram, suffix, recycle, ...: a draft that is "
            f"a function of the context), got {name!r}"
        )


class FallbackDrafter:
    """`first`'s draft, cut to k tokens, where it has at least `min_tokens`, else `second`'s."""

    def __init__(self, first: Drafter, second: Drafter, min_tokens: int = MIN_TOKENS) -> None:
        check_lookup(first, type(first).__name__)
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.first, self.second, self.min_tokens = first, second, min_tokens
        self.watching = [d for d in (first, second) if isinstance(d, WatchesPlainSteps)]
        self.first_steps = 0  # steps whose draft came from `first`, over the drafter's life
        self.second_steps = 0

    @property
    def is_lookup(self) -> bool:
        return self.second.is_lookup

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.first.begin(prompt_ids, params)
        self.second.begin(prompt_ids, params)

    def propose(self, k: int, random: RandomSource) -> Draft:
        draft = self.first.propose(max(k, self.min_tokens), random)
        if len(draft) >= self.min_tokens:
            self.first_steps += 1
            return draft.prefix(k)
        self.second_steps += 1
        return self.second.propose(k, random)

    def observe(self, tokens: list[int]) -> None:
        self.first.observe(tokens)
        self.second.observe(tokens)

    def end(self) -> None:
        """The request ended, for those of the two that keep something from it (`base.EndsRequests`)."""
        end_request(self.first)
        end_request(self.second)

    def observe_plain(self, scored: Tensor, logits: Tensor) -> None:
        """A plain step's row, for those of the two that learn from it (`WatchesPlainSteps`)."""
        for drafter in self.watching:
            drafter.observe_plain(scored, logits)

    def fork(self) -> FallbackDrafter:
        """Forks of both drafters (`base.Forks`); a ValueError where either does not fork."""
        return FallbackDrafter(forked(self.first), forked(self.second), self.min_tokens)
