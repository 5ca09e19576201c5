"""The generic Target backend: any transformers causal LM with a DynamicCache.

Used for architectures the fast Llama backend does not cover. Rollback crops
the cache, which slices views of the key/value tensors rather than copying.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel


class TransformersTarget:
    def __init__(self, model: PreTrainedModel, max_length: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 4096))
        self.cache = DynamicCache(config=model.config)
        self.last_hidden: Tensor | None = None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def prefill(self, token_ids: Tensor) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.last_hidden = None
        if token_ids.shape[0]:
            self._forward(token_ids, logits_to_keep=1)

    @torch.inference_mode()
    def score(self, token_ids: Tensor) -> Tensor:
        return self._forward(token_ids, logits_to_keep=0)[0].float()  # [n, vocab]

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count removes that many positions

    def hidden_states(self) -> Tensor | None:
        return self.last_hidden

    def _forward(self, token_ids: Tensor, logits_to_keep: int) -> Tensor:
        out = self.model(
            input_ids=token_ids[None],
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_to_keep,
        )
        self.last_hidden = out.hidden_states[-1][0]
        return out.logits
