"""A draft model with another tokenizer than the target's, kept on the target's text.

The draft model keeps its own KV cache over its own tokens. The text is the target's: its tokens
(prompt and emitted) decoded, special tokens left out. Before each draft the text is encoded
with the draft model's tokenizer (its special tokens, such as a BOS, included), and the cache
keeps its positions up to where that encoding and the cached tokens first differ: the accepted
text is re-synchronised wherever the tokens of the two tokenizers end, and a draft token the
target did not take (or took only part of) is fed again as the text's own encoding. While the
text ends inside a UTF-8 character (a target token holding part of one), there is no draft.
`draft_cost`, where measured (`drafters.cost`), is a draft model pass relative to a target pass.
"""

from __future__ import annotations

from time import perf_counter

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from specsample.models.target import Target
from specsample.tokens import common_prefix
from specsample.vocabulary import special_ids


class DraftText:
    def __init__(
        self,
        model: Target,
        target_tokenizer: PreTrainedTokenizerBase,
        draft_tokenizer: PreTrainedTokenizerBase,
        draft_cost: float | None = None,
    ) -> None:
        self.model = model
        self.draft_cost = draft_cost
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.width = min(model.vocab_size, len(draft_tokenizer))  # draft ids with a token behind them
        self.stops = special_ids(draft_tokenizer)  # a draft ends at one
        self.target_ids: list[int] = []  # the target's text as its tokens
        self.ids: list[int] = []  # the draft model's tokens: the text's encoding, then the tokens drafted
        self.prefill_seconds = 0.0  # of the last `sync`: its prefill of the draft model's cache, if it made one

    def begin(self, prompt_ids: list[int]) -> None:
        """Start on the prompt. The draft model's cache is filled at the first draft (`sync`), not here:
        a request that a K policy decodes without drafting never runs the draft model."""
        self.target_ids = list(prompt_ids)
        self.ids = []

    def observe(self, tokens: list[int]) -> None:
        self.target_ids += tokens

    def sync(self, k: int) -> int:
        """Encode the text for the draft model and roll its cache back to the tokens it still holds (or
        prefill it, where it holds none of them, timed as `prefill_seconds`: the draft's `setup_seconds`);
        how many of k draft tokens fit the draft model's context (the text and all but the last draft
        token), 0 when there is nothing to draft from (the text ends inside a character, or fills it)."""
        self.prefill_seconds = 0.0
        ids = self.encoding()
        k = min(k, self.model.max_length - len(ids) + 1)
        if not ids or k < 1:
            return 0
        kept = min(self.model.length, common_prefix(self.ids, ids), len(ids) - 1)
        if kept:
            self.model.rollback(kept)
        else:  # nothing cached for this text (the request's first draft): all but its last token, as the target's
            start = perf_counter()
            self.model.prefill(torch.tensor(ids[:-1], dtype=torch.long))
            self.prefill_seconds = perf_counter() - start
        self.ids = ids
        return k

    def encoding(self) -> list[int]:
        """The draft tokenizer's tokens for the text; none while it ends inside a character."""
        text = self.target_tokenizer.decode(self.target_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd"):
            return []
        return self.draft_tokenizer.encode(text, add_special_tokens=True)

    def logits(self) -> Tensor:
        """The draft model's logits [width] for the token after its tokens, feeding those not cached."""
        feed = torch.tensor(self.ids[self.model.length :])
        return self.model.score(feed)[-1, : self.width]

    def push(self, token: int) -> None:
        """A drafted token (draft id) joins the draft model's tokens."""
        self.ids.append(token)

    def continuation(self, start: int) -> str:
        """The text of the draft model's tokens from `start` on (whole characters only)."""
        base = self.decode(self.ids[:start])
        full = self.decode(self.ids)
        return full[len(base) :].rstrip("\ufffd") if full.startswith(base) else ""

    def decode(self, ids: list[int]) -> str:
        return self.draft_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
