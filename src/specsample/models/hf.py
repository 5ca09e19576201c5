"""The generic Target backend: any transformers causal LM with a DynamicCache.

Used for architectures the fast Llama backend does not cover. Rollback crops
the cache, which slices views of the key/value tensors rather than copying.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from specsample.models.target import normalized, recordable, stacked_states


class TransformersTarget:
    def __init__(self, model: PreTrainedModel, max_length: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 4096))
        self.cache = DynamicCache(config=model.config)
        self.last_hidden: Tensor | None = None
        self.record: frozenset[int] = frozenset()  # decoder layers (1-based) whose outputs are kept
        self.recorded: dict[int, Tensor] = {}

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def prefill(self, token_ids: Tensor) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.last_hidden, self.recorded = None, {}
        if token_ids.shape[0]:
            self._forward(token_ids, logits_to_keep=1)

    @torch.inference_mode()
    def score(self, token_ids: Tensor) -> Tensor:
        return self._forward(token_ids, logits_to_keep=0)[0].float()  # [n, vocab]

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count removes that many positions

    def record_layers(self, layers: Iterable[int]) -> None:
        self.record |= recordable(layers, self.model.config.num_hidden_layers)

    def hidden_states(self, layers: Sequence[int] = ()) -> Tensor | None:
        return stacked_states(self.recorded, self.last_hidden, layers)

    def _forward(self, token_ids: Tensor, logits_to_keep: int) -> Tensor:
        out = self.model(
            input_ids=token_ids[None],
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_to_keep,
        )
        self.last_hidden = out.hidden_states[-1][0]
        self.recorded = {i: normalized(out.hidden_states[i][0]) for i in self.record}  # [i]: layer i's output
        return out.logits
