"""The `none` drafter: proposes nothing, so the engine decodes one token per target pass.

This is plain autoregressive decoding through the same engine: the baseline
every speedup is measured against.
"""

from __future__ import annotations

from torch import Tensor

from specsample.drafters.base import Draft
from specsample.sampling import RandomSource, SamplingParams


class NoDrafter:
    is_lookup = True  # its (empty) draft is a function of the context
    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        pass

    def propose(self, k: int, random: RandomSource) -> Draft:
        return Draft.empty()

    def observe(self, tokens: list[int]) -> None:
        pass

    def fork(self) -> NoDrafter:
        return NoDrafter()
