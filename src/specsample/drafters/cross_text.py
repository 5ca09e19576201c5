"""String-level exact match: a draft model with another tokenizer drafts text, verified as target tokens.

The draft model (kept on the target's text by `DraftText`) drafts k of its own tokens greedily;
their text is encoded with the target's tokenizer (`verify.cross_vocab.retokenized_draft`) into
at most k target tokens, proposed as point masses. The draft is a function of the context, so
verification is exact at every temperature; any tokenizer pair works, whatever their
vocabularies share.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from specsample.drafters.base import Draft
from specsample.drafters.draft_text import DraftText
from specsample.sampling import RandomSource, SamplingParams, argmax
from specsample.verify.cross_vocab import retokenized_draft

TAIL = 4  # target tokens before the draft whose text the draft's encoding starts after


class TextDrafter:
    is_lookup = False  # a model's passes, not a lookup

    def __init__(self, text: DraftText, target_tokenizer: PreTrainedTokenizerBase) -> None:
        self.text = text
        self.target_tokenizer = target_tokenizer

    @property
    def draft_cost(self) -> float | None:
        return self.text.draft_cost

    def begin(self, prompt_ids: Tensor, params: SamplingParams) -> None:
        self.text.begin(prompt_ids.tolist())

    def propose(self, k: int, random: RandomSource) -> Draft:
        k = self.text.sync(k)
        if not k:
            return Draft.empty()
        start = len(self.text.ids)
        for _ in range(k):
            token = int(argmax(self.text.logits()))
            if token in self.text.stops:
                break
            self.text.push(token)
        continuation = self.text.continuation(start)
        tokens = retokenized_draft(self.target_tokenizer, self.text.target_ids[-TAIL:], continuation)[:k]
        return Draft(torch.tensor(tokens, dtype=torch.long), None, setup_seconds=self.text.prefill_seconds)

    def observe(self, tokens: list[int]) -> None:
        self.text.observe(tokens)
