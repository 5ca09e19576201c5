"""The generic Target backend: any transformers causal LM with a DynamicCache.

Used for architectures the fast Llama backend does not cover. Rollback crops
the cache, which slices views of the key/value tensors rather than copying.
It keeps per-position features for a draft head (`RecordsFeatures`), and scores
trees (`ScoresTrees`) with a 4D attention mask and each token's position ids.
Sliding-window layers keep every position in the cache (transformers' own
sliding layers drop the oldest, and then cannot be cropped): the window is the
attention mask's, in chain passes as in tree passes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from specsample.models.target import FeatureStore, UnsupportedModel, normalized
from specsample.tree import depths, visibility


def cache_argument(model: PreTrainedModel) -> str:
    """The name `model.forward` takes its cache by: `cache` since transformers 5.24, which warns on every
    pass given `past_key_values` (to be removed in 5.40), and `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def rollback_cache(config) -> DynamicCache:
    """An empty cache for a model of `config` whose positions can all be cropped: its sliding-window
    layers (which keep only the window's last keys) replaced by full ones."""
    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in cache.layers]
    return cache


def attention_windows(config) -> dict[str, tuple[int | None, int | None]]:
    """Each kind of attention layer of `config` (transformers' `layer_types`, or one kind for all layers,
    sliding where the config gives a window) with its window and its chunk (None: not limited so): a
    sliding layer's query sees the last `sliding_window` positions, a chunked one (Llama 4's) those of its
    own block of `attention_chunk_size`. Other kinds of layers (no attention: "moe", "mlp") are left out."""
    window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"])
    limits = {"full_attention": (None, None), "sliding_attention": (window, None), "chunked_attention": (None, chunk)}
    return {kind: limits[kind] for kind in kinds if kind in limits}


def within(seen: Tensor, positions: Tensor, key_positions: Tensor, window: int | None, chunk: int | None) -> Tensor:
    """`seen` [n, keys] where a query at `positions` [n] also reaches the key at `key_positions` [keys]: within
    `window` positions of it, and in its block of `chunk` (None: no such limit)."""
    if window is not None:
        seen = seen & (positions[:, None] - key_positions < window)
    if chunk is not None:
        seen = seen & (positions[:, None] // chunk == key_positions // chunk)
    return seen


class TransformersTarget:
    def __init__(self, model: PreTrainedModel, max_length: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 4096))
        self.cache = rollback_cache(model.config)
        if any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.cache.layers):
            raise UnsupportedModel(f"model type {model.config.model_type!r} keeps a recurrent state (linear attention, "
                                   "an SSM), which this backend does not roll back: run its GGUF file on llamacpp")
        self.windows = attention_windows(model.config)
        self.cache_argument = cache_argument(model)
        config = model.config
        self._features = FeatureStore(config.num_hidden_layers, config.hidden_size, self.max_length)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def prefill(self, token_ids: Tensor) -> None:
        self.cache = rollback_cache(self.model.config)
        self._features.truncate(0)
        self.extend(token_ids)

    @torch.inference_mode()
    def extend(self, token_ids: Tensor) -> None:
        if token_ids.shape[0]:
            self._forward(token_ids, logits_to_keep=1)

    @torch.inference_mode()
    def score(self, token_ids: Tensor) -> Tensor:
        return self._forward(token_ids, logits_to_keep=0)[0].float()  # [n, vocab]

    @torch.inference_mode()
    def score_tree(self, token_ids: Tensor, parents: Tensor) -> Tensor:
        """Append a tree of tokens [n] with `parents` [n] (`target.ScoresTrees`); logits [n, vocab]: a mask
        [1, 1, n, length + n] lets each see the cache, its ancestors and itself, at position length + depth
        (in a sliding-window layer, those of them within its window of that position; in a chunked one,
        those in its chunk). One mask when every layer attends alike, else one for each kind of layer, as
        transformers maps them."""
        start, n = self._room(token_ids.shape[0]), token_ids.shape[0]
        positions = start + depths(parents)  # [n]
        seen = torch.ones(n, start + n, dtype=torch.bool)
        seen[:, start:] = visibility(parents)
        key_positions = torch.cat([torch.arange(start), positions])  # [start + n]
        masks = {kind: self._additive(within(seen, positions, key_positions, window, chunk))
                 for kind, (window, chunk) in self.windows.items()}
        out = self.model(
            input_ids=token_ids[None], **{self.cache_argument: self.cache}, use_cache=True,
            attention_mask=next(iter(masks.values())) if len(masks) == 1 else masks,
            position_ids=positions[None], output_hidden_states=self._features.recording,
        )
        self._record(start, out)  # per node; `keep_path` moves the accepted path's rows into place
        return out.logits[0].float()  # [n, vocab]

    def _additive(self, seen: Tensor) -> Tensor:
        """[1, 1, n, keys] of 0 where `seen` [n, keys], else the dtype's lowest value."""
        mask = torch.zeros(1, 1, *seen.shape, dtype=self.model.dtype)
        return mask.masked_fill_(~seen, torch.finfo(self.model.dtype).min)

    @torch.inference_mode()
    def keep_path(self, start: int, nodes: Sequence[int]) -> None:
        """Keep tree tokens `nodes` as positions start.. (`target.ScoresTrees`): their keys and values move."""
        kept = torch.as_tensor(list(nodes), dtype=torch.long)
        source, target = start + kept, torch.arange(start, start + kept.shape[0])
        for layer in self.cache.layers:
            if layer.keys is None:  # a layer that reads another's keys and values (Gemma 4's shared ones)
                continue
            layer.keys[:, :, target] = layer.keys[:, :, source]
            layer.values[:, :, target] = layer.values[:, :, source]
        self._features.keep(start, kept)
        self.rollback(start + source.shape[0])

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} positions")
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count removes that many positions
        self._features.truncate(length)

    def record_features(self, layers: Iterable[int]) -> None:
        """From the next pass on, keep per position the final state and these layers' `normalized` outputs."""
        self._features.record(layers)

    def features(self, start: int, end: int, layers: Sequence[int] = ()) -> Tensor:
        """[end - start, (len(layers) + 1) * hidden] of positions start..end-1 (`RecordsFeatures`)."""
        return self._features.read(start, end, layers)

    def _forward(self, token_ids: Tensor, logits_to_keep: int) -> Tensor:
        start = self._room(token_ids.shape[0])
        recording = self._features.recording
        out = self.model(
            input_ids=token_ids[None],
            **{self.cache_argument: self.cache},
            use_cache=True,
            output_hidden_states=recording,
            logits_to_keep=logits_to_keep,
        )
        self._record(start, out)
        return out.logits

    def _room(self, n: int) -> int:
        """The cache's length, where `n` more positions fit the context window; else a ValueError."""
        if self.length + n > self.max_length:
            raise ValueError(f"{self.length} + {n} positions exceed the context window of {self.max_length}")
        return self.length

    def _record(self, start: int, out) -> None:
        """Where features are recorded, write a pass's rows from position `start` on."""
        if self._features.recording:  # hidden_states[i]: the output of layer i; the last one after the final norm
            outputs = {i: normalized(out.hidden_states[i][0]) for i in self._features.layers}
            self._features.write(start, out.hidden_states[-1][0].float(), outputs)
