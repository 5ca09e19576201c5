"""The `A+B` drafters: draft with a lookup drafter when it finds a match, else with a model.

After SuffixDecoding's hybrid with a model drafter (ArcticInference): a lookup
drafter (`suffix`, `ngram`) costs almost nothing and drafts long runs where the
text repeats its context or earlier answers; a model drafter (`head`,
`quantized`) predicts the target where nothing repeats. Each step asks `first`;
its draft is verified if it holds at least `min(k, min_tokens)` tokens (a short
draft comes from a short, unreliable match), otherwise `second` drafts. Both
observe every step, so either can draft the next one.

Lossless: `first` must propose point masses (a deterministic function of the
context), so the choice between the two drafts depends on the context alone,
never on a draw, and each step verifies a draft exactly as its drafter made it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specsample.drafters.base import Draft, Drafter
from specsample.sampling import SamplingParams

MIN_TOKENS = 3  # the shortest draft of `first` that is verified instead of asking `second`
# Drafters that propose point masses, a function of the context alone: the only ones that may come first.
LOOKUP_DRAFTERS = ("ngram", "suffix")
NOT_A_LOOKUP = f"the first drafter of A+B must be a lookup drafter ({' or '.join(LOOKUP_DRAFTERS)})"


class FallbackDrafter:
    """`first`'s draft where it has at least min(k, `min_tokens`) tokens, else `second`'s."""

    def __init__(self, first: Drafter, second: Drafter, min_tokens: int = MIN_TOKENS) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.first, self.second, self.min_tokens = first, second, min_tokens
        self.first_steps = 0  # steps whose draft came from `first`, over the drafter's life
        self.second_steps = 0

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.first.begin(prompt_ids, params)
        self.second.begin(prompt_ids, params)

    def propose(self, k: int, generator: torch.Generator) -> Draft:
        draft = self.first.propose(k, generator)
        if draft.probs is not None:
            raise ValueError(f"{NOT_A_LOOKUP}: it drafted probabilities")
        if len(draft) >= min(k, self.min_tokens):
            self.first_steps += 1
            return draft
        self.second_steps += 1
        return self.second.propose(k, generator)

    def observe(self, tokens: list[int]) -> None:
        self.first.observe(tokens)
        self.second.observe(tokens)
