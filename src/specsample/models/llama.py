"""A fast target backend for the Llama family (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral, Gemma 3).

These models are one decoder: RMSNorm, rotary embeddings, grouped-query
attention and a gated MLP (SwiGLU; Gemma 3's GELU, with norms of each attention
and MLP output, local layers of their own rotary base and a sliding window). On a
CPU, decoding a small model is bound by reading the weights once per forward pass, so scoring K+1 tokens should cost
about as much as scoring one. transformers does not get there (its forward over
8 new tokens costs about 1.5 to 3 of its forwards over one, and its per-op
overhead is large); this backend does, by:

- fusing the Q, K and V projections into one matrix and gate and up into one;
- running the decoder layers in one call into C++ (`kernels.layers`): weights
  packed in 32-column panels that a small-row matrix multiply streams once for
  up to 12 rows, and norms, rotary embedding, cache writes and grouped-query
  attention without the dispatch cost of ~40 small torch ops per layer;
- a KV cache preallocated once, indexed by position, so rollback only sets a
  length and appending writes into a slice (no `torch.cat`);
- rotary tables computed once for every position.

Without a C++ compiler the same model runs on torch ops: weights stored
[in, out] for `torch.mm` (faster than F.linear's [out, in] for a few rows),
query heads that share a KV head grouped into one batch of rows, so a handful
of new tokens attend over a long cache without copying K/V or building more
than a tiny [rows, length] mask.

Batch size is 1. Weights are copied from a transformers model; in float32 the
logits match it to rounding (other dtypes run on torch ops, approximately).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specsample.models import kernels
from specsample.models.ops import rms_norm, rope_tables, rotate
from specsample.models.target import FEATURE_EPS, FeatureStore, Target, UnsupportedModel, normalized
from specsample.tree import depths, visibility

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral", "gemma3_text"}
# Activations of the gated MLP: SiLU (SwiGLU), or GELU's tanh form (Gemma's GeGLU), by config name.
GELU_ACTIVATIONS = {"gelu_pytorch_tanh"}
# Rope types whose frequencies do not depend on the sequence length, so one
# precomputed table serves every position.
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
DEFAULT_MAX_LENGTH = 8192
PREFILL_CHUNK = 512  # bounds the attention mask and activations of long prompts
INT8_COPY_COST = 0.29  # int8 copy / float32 target single-token pass: 3.6 vs 12.5 ms (BENCHMARKS.md)
COMMITTED_POSITIONS = 1024  # cache slots a quantized copy and batched slots commit at once (`commit_cache`)


@dataclass
class Linear:
    """A linear map in the layout of the fastest kernel available: packed panels, else [in, out].

    Packed panels are float32, or int8 with per-column `scales` (`kernels.pack_int8`), or a GGUF
    file's blocks of GGML type `qtype` (`gguf_blocks.pack_blocks`: weight its qs, scales its fp16 scales).
    """

    weight: Tensor  # [blocks, in, 32] when packed, else [in, out]; GGUF blocks: uint8 [panels, blocks, bytes]
    bias: Tensor | None  # [out]
    out_features: int
    packed: bool
    scales: Tensor | None = None  # [out] float32 when the packed weight is int8; GGUF blocks: their fp16 scales
    qtype: int = 0  # GGML type of GGUF blocks, 0 otherwise

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, packed: bool) -> Linear:
        """From an nn.Linear weight [out, in] and bias [out]."""
        bias = None if bias is None else bias.detach().to(dtype).clone()
        if packed:
            return cls(kernels.pack(weight), bias, weight.shape[0], True)
        return cls(weight.detach().to(dtype).t().contiguous(), bias, weight.shape[0], False)

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x [n, in] -> [n, out]; with `residual` [n, out], adds into it in place and returns it."""
        if self.qtype:
            return kernels.matmul_gguf(x, self.qtype, self.weight, self.scales, self.out_features, self.bias, residual)
        if self.packed:
            return kernels.matmul(x, self.weight, self.out_features, self.bias, residual, self.scales)
        y = torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)
        return y if residual is None else residual.add_(y)


@dataclass
class Layer:
    """Weights of one decoder layer."""

    attn_norm: Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim: q, then k, then v
    o: Linear  # heads * head_dim -> hidden
    mlp_norm: Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate: gate, then up
    down: Linear  # intermediate -> hidden
    q_norm: Tensor | None = None  # [head_dim] Qwen3, Gemma 3: RMSNorm of each query head before the rotation
    k_norm: Tensor | None = None  # [head_dim] and of each key head
    post_attn_norm: Tensor | None = None  # [hidden] Gemma 3: RMSNorm of the attention's output before it is added
    post_mlp_norm: Tensor | None = None  # [hidden] and of the MLP's
    gelu: bool = False  # the MLP's gate through GELU's tanh form (Gemma), else SiLU
    window: int = 0  # a sliding attention window: each token sees its last `window` positions (0: all)
    rotary: tuple[Tensor, Tensor] | None = None  # this layer's (cos, sin) [max_length, head_dim], if not the target's


def inverse_sqrt(n: int) -> float:
    """1 / sqrt(n) in float32 arithmetic, as C computes 1.0f / sqrtf(n): attention's score scale."""
    return float(1.0 / torch.tensor(float(n)).sqrt())


def rope_type(config) -> str:
    """The rope type of a transformers config, old (`rope_scaling`) or new (`rope_parameters`) style."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def sliding_window(config) -> int | None:
    """The attention window if the config turns one on for every layer, else None (Gemma 3's windows are
    per layer, `Layer.window`)."""
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    if config.model_type == "gemma3_text":
        return None
    return getattr(config, "sliding_window", None)


def unsupported_reason(config) -> str | None:
    """Why this backend cannot reproduce `config` exactly, or None if it can."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if config.model_type == "gemma3_text":
        return _gemma3_unsupported_reason(config)
    if rope_type(config) not in SUPPORTED_ROPE_TYPES:
        return f"rope type {rope_type(config)!r} is not one of {sorted(SUPPORTED_ROPE_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "mlp_bias", False):
        return "MLP biases are not supported"
    return None


def _gemma3_unsupported_reason(config) -> str | None:
    """Why this backend cannot reproduce a Gemma 3 text config exactly, or None."""
    types = {params.get("rope_type", "default") for params in config.rope_parameters.values()}
    if not types <= SUPPORTED_ROPE_TYPES:
        return f"rope types {sorted(types)} are not all of {sorted(SUPPORTED_ROPE_TYPES)}"
    if config.hidden_activation not in GELU_ACTIVATIONS:
        return f"activation {config.hidden_activation!r} is not one of {sorted(GELU_ACTIVATIONS)}"
    if config.final_logit_softcapping is not None or config.attn_logit_softcapping is not None:
        return "logit soft-capping is not supported"
    if not set(config.layer_types) <= {"sliding_attention", "full_attention"}:
        return f"layer types {sorted(set(config.layer_types))} are not sliding and full attention"
    return None


def supports(config) -> bool:
    """True if `LlamaTarget.from_hf` reproduces a model with this config exactly."""
    return unsupported_reason(config) is None


def _copy(w: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if w is None else w.detach().to(dtype).clone()


def _cat(tensors: Sequence[Tensor | None]) -> Tensor | None:
    return None if tensors[0] is None else torch.cat([t.detach() for t in tensors])


def _norm_weight(attn, name: str, dtype: torch.dtype) -> Tensor | None:
    """The weight of the attention's per-head norm `name` (Qwen3's q_norm, k_norm), None where it has none."""
    norm = getattr(attn, name, None)
    return None if norm is None else _copy(norm.weight, dtype)


def _gemma_norm(norm, dtype: torch.dtype) -> Tensor:
    """A Gemma RMSNorm's weight as this backend's: Gemma scales by 1 + weight (computed in float32)."""
    return (1.0 + norm.weight.detach().float()).to(dtype)


def _gemma3_layer_from_hf(layer, dtype: torch.dtype, packed: bool, window: int,
                          rotary: tuple[Tensor, Tensor]) -> Layer:
    """One Gemma 3 decoder layer: a Llama layer whose norms scale by 1 + weight, with norms of the
    attention's and MLP's outputs, a GELU gate, and its own window and rotary tables."""
    attn = layer.self_attn
    return replace(
        _layer_from_hf(layer, dtype, packed),
        attn_norm=_gemma_norm(layer.input_layernorm, dtype),
        mlp_norm=_gemma_norm(layer.pre_feedforward_layernorm, dtype),
        q_norm=_gemma_norm(attn.q_norm, dtype),
        k_norm=_gemma_norm(attn.k_norm, dtype),
        post_attn_norm=_gemma_norm(layer.post_attention_layernorm, dtype),
        post_mlp_norm=_gemma_norm(layer.post_feedforward_layernorm, dtype),
        gelu=True,
        window=window,
        rotary=rotary,
    )


def _layer_from_hf(layer, dtype: torch.dtype, packed: bool) -> Layer:
    """Fuse the weights of one transformers decoder layer into this backend's layout."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up = (mlp.gate_proj, mlp.up_proj)
    return Layer(
        attn_norm=_copy(layer.input_layernorm.weight, dtype),
        qkv=Linear.from_weight(_cat([p.weight for p in qkv]), _cat([p.bias for p in qkv]), dtype, packed),
        o=Linear.from_weight(attn.o_proj.weight, attn.o_proj.bias, dtype, packed),
        mlp_norm=_copy(layer.post_attention_layernorm.weight, dtype),
        gate_up=Linear.from_weight(_cat([p.weight for p in gate_up]), None, dtype, packed),
        down=Linear.from_weight(mlp.down_proj.weight, None, dtype, packed),
        q_norm=_norm_weight(attn, "q_norm", dtype),
        k_norm=_norm_weight(attn, "k_norm", dtype),
    )


def _layers_from_hf(
    model, dtype: torch.dtype, packed: bool, max_length: int
) -> tuple[list[Layer], Tensor, Tensor, Tensor, dict]:
    """A transformers model's decoder layers in this backend's layout, the target's rotary tables (cos, sin),
    its final norm's weight, and the target's scales for its family (`LlamaTarget`'s attn_scale and
    embed_scale): Gemma 3's layers each take the window and rotary tables of their layer type, its norms
    scale by 1 + weight, and its embedding is scaled."""
    config, rotary = model.config, model.model.rotary_emb
    if config.model_type != "gemma3_text":
        cos, sin = rope_tables(rotary.inv_freq, float(rotary.attention_scaling), max_length, dtype)
        layers = [_layer_from_hf(layer, dtype, packed) for layer in model.model.layers]
        return layers, cos, sin, _copy(model.model.norm.weight, dtype), {}
    tables = {
        kind: rope_tables(getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling")),
                          max_length, dtype)
        for kind in set(config.layer_types)
    }
    windows = {"sliding_attention": config.sliding_window, "full_attention": 0}
    layers = [
        _gemma3_layer_from_hf(layer, dtype, packed, windows[kind], tables[kind])
        for layer, kind in zip(model.model.layers, config.layer_types)
    ]
    scales = {"attn_scale": config.query_pre_attn_scalar**-0.5,
              "embed_scale": float(torch.tensor(config.hidden_size**0.5))}  # float32, as transformers scales
    return layers, *tables[config.layer_types[-1]], _gemma_norm(model.model.norm, dtype), scales


def runs_to(layer_ids: Iterable[int], recording: frozenset[int]) -> list[list[int]]:
    """`layer_ids` in consecutive runs, each ending where a layer's output (1-based, in `recording`) is kept."""
    runs: list[list[int]] = [[]]
    for i in layer_ids:
        runs[-1].append(i)
        if i + 1 in recording:
            runs.append([])
    return [run for run in runs if run]


EMBEDDING_ROWS_KEPT = 4096  # unpacked rows of a tied embedding kept: 9 MB at hidden 576


class EmbeddingRows:
    """The input embedding of a model whose LM head doubles as its embedding table, stored packed (GGUF
    blocks, int8 or float panels): `unpack` gives rows [n, hidden] of the table, and the most recently
    used EMBEDDING_ROWS_KEPT are kept. Unpacking a GGUF row through the `gguf` package costs about
    0.17 ms a call on the bundled model, 6% of a one-token pass; a kept row is the same values, copied."""

    def __init__(self, unpack: Callable[[Tensor], Tensor], kept: int = EMBEDDING_ROWS_KEPT) -> None:
        self.unpack, self.kept = unpack, kept
        self.rows: OrderedDict[int, Tensor] = OrderedDict()  # token -> [hidden], least recently used first

    def __call__(self, token_ids: Tensor) -> Tensor:
        """Rows `token_ids` [n] of the table, [n, hidden]."""
        ids = token_ids.tolist()
        if not ids:  # an empty prefill (a prompt of one token): the table's shape of no rows
            return self.unpack(token_ids)
        missing = sorted(set(ids) - self.rows.keys())
        if missing:
            for token, row in zip(missing, self.unpack(torch.tensor(missing, dtype=torch.long))):
                self.rows[token] = row.clone()
        for token in ids:
            self.rows.move_to_end(token)
        out = torch.stack([self.rows[token] for token in ids])
        while len(self.rows) > self.kept:
            self.rows.popitem(last=False)
        return out


class LlamaTarget:
    """A Llama-family decoder with a preallocated KV cache, implementing the Target protocol.

    `score` appends tokens and returns their logits; `rollback` only moves the
    cache length. Capabilities (models/target.py): `forward` also runs a subset of
    the layers (`RunsLayerSubsets`), so a self-speculative drafter can draft with
    the target's own weights and cache: the layers it skips leave their cache
    slots at those positions stale, and the target's verification pass over the
    same positions rewrites every layer. It keeps per-position features for a
    draft head (`RecordsFeatures`), makes an int8 copy of itself
    (`QuantizedCopies`) and starts a copy's cache from its own (`AdoptsCache`).

    On the kernels the cache holds keys and values in `kv_dtype` (None: the weights' dtype): float16
    halves the bytes a cached position streams in every pass (the GGUF blocks' targets use it, as
    llama.cpp does), at float16's rounding of each key and value.

    `attn_scale` scales attention scores (None: 1 / sqrt(head_dim)); `embed_scale` multiplies the input
    embeddings (Gemma's sqrt(hidden)).
    """

    def __init__(
        self,
        layers: list[Layer],
        embed: Tensor | None,
        norm: Tensor,
        lm_head: Linear,
        cos: Tensor,
        sin: Tensor,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        source=None,
        kv_dtype: torch.dtype | None = None,
        copy_file: Path | None = None,
        attn_scale: float | None = None,
        embed_scale: float = 1.0,
    ) -> None:
        self.layers = layers
        self.attn_scale, self.embed_scale = attn_scale, embed_scale
        self.source = source  # the transformers model it was copied from, for `quantized_copy`
        self.copy_file = copy_file  # the GGUF file whose own blocks are `quantized_copy`, if any
        self.embed = embed  # [vocab, hidden], or None when tied to lm_head
        self.tied_rows = None if embed is not None else EmbeddingRows(self._lm_head_rows)
        self.norm = norm  # [hidden]
        self.lm_head = lm_head  # hidden -> vocab
        self.cos, self.sin = cos, sin  # [max_length, head_dim]; sin signed, see rope_tables
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.dtype = norm.dtype
        self.kernels = lm_head.packed  # packed weights go with the C++ kernels, attention included
        self.vocab_size = lm_head.out_features
        self.hidden_size = norm.shape[0]
        self.max_length = cos.shape[0]
        # Uninitialised on purpose: pages are committed as positions are written,
        # and attention only reads positions below the length, all written.
        # The attention kernel wants keys in tiles of positions (`kernels.key_views`), 16 to a vector.
        capacity = kernels.capacity(self.max_length)
        layers_kv = (len(layers), kv_heads)
        # Keys and values in `kv_dtype` on the kernels (float16 halves what a position streams), else the weights'.
        cache_dtype = kernels.cache_dtype(kv_dtype, self.dtype) if self.kernels else self.dtype
        if self.kernels:
            tiles = (capacity // kernels.KEY_TILE, head_dim, kernels.KEY_TILE)
            self.k_cache = torch.empty(*layers_kv, *tiles, dtype=cache_dtype)  # [layers, kv_heads, cap / 16, dim, 16]
        else:
            self.k_cache = torch.empty(*layers_kv, capacity, head_dim, dtype=cache_dtype)  # [layers, kv_heads, cap, dim]
        self.v_cache = torch.empty(*layers_kv, capacity, head_dim, dtype=cache_dtype)  # [layers, kv_heads, cap, dim]
        intermediate = layers[0].gate_up.out_features // 2 if layers else 0
        self._scratch_per_token = kernels.scratch_size(self.hidden_size, heads, kv_heads, head_dim, intermediate)
        self._kernel_layers = [self._kernel_args(i) for i in range(len(layers))] if self.kernels else []
        self._layer_table = kernels.layer_table(self._kernel_layers) if self.kernels else None
        # the tables of runs of layers (`_table`), made once: a pass that keeps a draft head's features runs
        # the layers in four calls, and making their tables each pass cost 0.1 ms of a 2.6 ms pass
        self._tables = {tuple(range(len(layers))): self._layer_table} if self.kernels else {}
        self._unit = torch.ones(self.hidden_size)  # the weight of `normalized` on the kernels
        self._length = 0
        self.last_hidden: Tensor | None = None  # [n, hidden] final normed state of the last pass
        self._features = FeatureStore(len(layers), self.hidden_size, self.max_length)

    @classmethod
    def from_hf(
        cls,
        model,
        max_length: int | None = None,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
        gguf: Path | None = None,
    ) -> LlamaTarget:
        """Copy the weights of a transformers Llama/Qwen2/Qwen3/Mistral causal LM; keys and values in `kv_dtype` on the
        kernels (None: `dtype`). `gguf`, the file the model was converted from, if any: on the kernels its own
        blocks become the quantized copy where they take it (`gguf_blocks.drafts_on_blocks`).

        Raises UnsupportedModel when the result would not match the model, so
        callers can fall back to the transformers backend.
        """
        from specsample.models import gguf_blocks

        config = model.config
        reason = unsupported_reason(config)
        if reason is not None:
            raise UnsupportedModel(reason)
        window = sliding_window(config)
        limit = min(config.max_position_embeddings, window or config.max_position_embeddings)
        if max_length is None:
            max_length = min(limit, DEFAULT_MAX_LENGTH)
        elif window is not None and max_length > window:
            raise UnsupportedModel(f"max_length {max_length} exceeds the sliding window {window}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        embed_w = model.model.embed_tokens.weight
        lm_w = model.lm_head.weight
        tied = embed_w.data_ptr() == lm_w.data_ptr()
        packed = dtype == torch.float32 and head_dim <= kernels.MAX_HEAD_DIM and kernels.available()
        with torch.inference_mode():
            layers, cos, sin, norm, scales = _layers_from_hf(model, dtype, packed, max_length)
            return cls(
                layers,
                embed=None if tied else _copy(embed_w, dtype),
                norm=norm,
                lm_head=Linear.from_weight(lm_w, None, dtype, packed),
                cos=cos,
                sin=sin,
                heads=heads,
                kv_heads=config.num_key_value_heads,
                head_dim=head_dim,
                eps=config.rms_norm_eps,
                source=model,
                kv_dtype=kv_dtype,
                copy_file=gguf if packed and gguf is not None and gguf_blocks.drafts_on_blocks(gguf) else None,
                **scales,
            )

    def with_weights(self, layers: list[Layer], lm_head: Linear, embed: Tensor | None,
                     kv_dtype: torch.dtype | None = None) -> LlamaTarget:
        """A target of this one's shape over other weights (a quantized copy's), with this one's final norm,
        rotary tables and scales, and a cache of its own (keys and values in `kv_dtype`)."""
        return LlamaTarget(
            layers, embed, self.norm, lm_head, self.cos, self.sin, heads=self.heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, eps=self.eps, kv_dtype=kv_dtype, attn_scale=self.attn_scale,
            embed_scale=self.embed_scale,
        )

    @property
    def length(self) -> int:
        return self._length

    def prefill(self, token_ids: Tensor) -> None:
        """Reset the cache and fill it with `token_ids` [n]; computes no logits."""
        self.rollback(0)
        self.extend(token_ids)

    def extend(self, token_ids: Tensor) -> None:
        """Append `token_ids` [n], PREFILL_CHUNK at a time; computes no logits."""
        for chunk in token_ids.reshape(-1).split(PREFILL_CHUNK):
            self.forward(chunk, logits=False)

    def score(self, token_ids: Tensor) -> Tensor:
        """Append `token_ids` [n]; return their logits [n, vocab] in float32."""
        return self.forward(token_ids)

    def score_tree(self, token_ids: Tensor, parents: Tensor) -> Tensor:
        """Append a tree of tokens [n] with `parents` [n] (`target.ScoresTrees`); their logits [n, vocab]. On
        the kernels a node's logits are bitwise its path's scored as a chain; on torch ops, to rounding."""
        return self.forward(token_ids, parents=parents.long().contiguous())

    @torch.inference_mode()
    def keep_path(self, start: int, nodes: Sequence[int]) -> None:
        """Keep tree tokens `nodes` as positions start.. (`target.ScoresTrees`): only rows that move are copied."""
        nodes = torch.as_tensor(list(nodes), dtype=torch.long)
        for i, node in enumerate(nodes.tolist()):  # slot start + i is never a later node's (nodes increase)
            if node != i:
                self._move_position(start + node, start + i)
        self._features.keep(start, nodes)
        self.rollback(start + nodes.shape[0])

    def _move_position(self, source: int, target: int) -> None:
        """Copy the keys and values of cache slot `source` to slot `target`, in every layer and head."""
        for mine, theirs in zip(self._cache_positions(target + 1, target), self._cache_positions(source + 1, source)):
            mine.copy_(theirs)

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions of the cache."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self._length}")
        self._length = length
        self._features.truncate(length)

    def shares_cache_layout(self, other: Target) -> bool:
        """True if `other` keeps K and V as this one does (a LlamaTarget of the same shapes, either dtype)."""
        if not isinstance(other, LlamaTarget):
            return False
        same_shapes = self.k_cache.shape == other.k_cache.shape and self.v_cache.shape == other.v_cache.shape
        return self.kernels == other.kernels and same_shapes

    @torch.inference_mode()
    def adopt_cache(self, source: Target, length: int, start: int = 0) -> bool:
        """Keep this cache's first `start` positions and take positions start..length-1 of `source`'s
        (converted to this dtype), in place of scoring them: a draft model of the target's architecture
        starts from the target's K and V, and later catches up on the tokens it did not draft. False,
        changing nothing, where `source` keeps them in another layout or holds fewer positions, or this
        cache holds fewer than `start`."""
        if not self.shares_cache_layout(source) or not 0 <= start <= min(self._length, length) <= source.length:
            return False
        for mine, theirs in zip(self._cache_positions(length, start), source._cache_positions(length, start)):
            mine.copy_(theirs)
        self.rollback(start)
        self._length = length
        return True

    @property
    def instruction_set(self) -> str | None:
        """The vector instruction set of the C++ kernels it runs on; None on torch ops (`QuantizedCopies`)."""
        return kernels.instruction_set() if self.kernels else None

    @property
    def copy_cost(self) -> float | None:
        """The quantized copy's single-token pass per target pass (`target.CopyCost`): over float32 weights
        INT8_COPY_COST, or FILE_COPY_COST where the copy is the file's own blocks; over GGUF blocks, the
        lower-bit copy's as measured for the target's block types (`gguf_blocks.block_copy_cost`), None
        where not measured."""
        from specsample.models import gguf_blocks

        if gguf_blocks.on_blocks(self):
            return gguf_blocks.block_copy_cost(self)
        return INT8_COPY_COST if self.copy_file is None else gguf_blocks.FILE_COPY_COST

    def quantized_copy(self) -> LlamaTarget:
        """A quantized copy of this target with its own cache of the same length: over float32 weights read
        from a GGUF file of at most 8 bits, the file's own blocks (`copy_file`: half the bytes of an int8
        copy or fewer, and the file's weights exactly where int8 would round them again), else an int8 copy
        (models/quantize.py) of the source model, or of this target's weights where it has none (a float
        GGUF file); over GGUF blocks a lower-bit copy of the blocks (`gguf_blocks.lower_bit_copy`).
        Its first cache slots are committed now: page faults at its first draft would make drafting look
        slower than it is to a K policy that times it (about 8 ms on SmolLM2, for what then costs 0.5 ms)."""
        from specsample.models import gguf_blocks
        from specsample.models.quantize import int8_copy, int8_target

        if gguf_blocks.on_blocks(self):
            copy = gguf_blocks.lower_bit_copy(self)
        elif self.copy_file is not None:
            copy = gguf_blocks.gguf_target(self.source, self.copy_file, self.max_length)
        elif self.source is None or kernels.available():
            # this target's own float32 weights (a float GGUF file has no source): on the kernels the same
            # copy as the source's, logit for logit, without a second float32 target built on the way
            copy = int8_copy(self)
        else:  # the torch path's copy keeps its activations in ACTIVATIONS (models/quantize.py)
            copy = int8_target(self.source, self.max_length)
        copy.commit_cache(COMMITTED_POSITIONS)
        return copy

    @torch.inference_mode()
    def commit_cache(self, length: int) -> None:
        """Empty the cache and write the slots of positions 0..length-1, so that their memory pages are
        committed now and not at first use (page faults that cost milliseconds)."""
        for part in self._cache_positions(min(length, self.max_length)):
            part.zero_()
        self.rollback(0)

    def _cache_positions(self, length: int, start: int = 0) -> list[Tensor]:
        """Views of keys and values at positions start..length-1, in this cache's layout (two caches of one
        layout give views that pair up)."""
        if self.kernels:  # keys [layers, kv_heads, cap / 16, dim, 16]
            return [*kernels.key_views(self.k_cache, start, length), self.v_cache[:, :, start:length]]
        return [self.k_cache[:, :, start:length], self.v_cache[:, :, start:length]]

    def slots(self, count: int) -> LlamaSlots:
        """`count` empty KV caches over these weights, scored together (`target.SlottedTarget`)."""
        return LlamaSlots(self, count)

    def record_features(self, layers: Iterable[int]) -> None:
        """From the next pass on, keep per position the final state and these layers' `normalized` outputs."""
        self._features.record(layers)

    def features(self, start: int, end: int, layers: Sequence[int] = ()) -> Tensor:
        """[end - start, (len(layers) + 1) * hidden] of positions start..end-1 (`RecordsFeatures`)."""
        return self._features.read(start, end, layers)

    @torch.inference_mode()
    def forward(
        self, token_ids: Tensor, layers: Sequence[int] | None = None, logits: bool = True,
        parents: Tensor | None = None,
    ) -> Tensor | None:
        """Append `token_ids` [n] running only `layers` (default: all); logits [n, vocab] or None.
        With `parents` [n] int64, the tokens are a tree (`score_tree`)."""
        return self.forward_embeddings(self._embed(token_ids.reshape(-1).long()), layers, logits, parents)

    @torch.inference_mode()
    def forward_embeddings(
        self, x: Tensor, layers: Sequence[int] | None = None, logits: bool = True,
        parents: Tensor | None = None,
    ) -> Tensor | None:
        """`forward` from input embeddings x [n, hidden] (overwritten): for decoders whose input is
        not a token embedding, such as a draft head's fused (feature, token) input."""
        n = int(x.shape[0])
        start = self._length
        if start + n > self.max_length:
            raise ValueError(f"{start + n} positions exceed max_length {self.max_length}")
        recording = self._features.layers if layers is None else frozenset()
        outputs = {}  # [n, hidden] `normalized` outputs of the recorded layers, by 1-based layer
        if n:
            layer_ids = range(len(self.layers)) if layers is None else layers
            if self.kernels:
                scratch = torch.empty(n * self._scratch_per_token, dtype=torch.float32)
                for run in runs_to(layer_ids, recording):
                    kernels.layers(self._table(run), x, start, scratch, parents)
                    if run[-1] + 1 in recording:  # `normalized` in one call, not torch's several ops
                        outputs[run[-1] + 1] = kernels.rms_norm(x, self._unit, FEATURE_EPS)
            else:
                # a tree's token t sits at position start + its depth
                positions = torch.arange(start, start + n) if parents is None else start + depths(parents)  # [n]
                windows = {w.window for w in self.layers}
                masks = {window: self._mask(start, positions, parents, window) for window in windows}
                for i in layer_ids:
                    x = self._layer(i, x, start, positions, masks[self.layers[i].window])
                    if i + 1 in recording:
                        outputs[i + 1] = normalized(x)
        self._length = start + n
        self.last_hidden = self.final_norm(x)  # [n, hidden]
        if layers is not None:  # a pass through some of the layers leaves these positions' features stale
            self._features.truncate(start)
        elif self._features.recording and n:  # an empty prefill (a one-token prompt) ran no layer
            self._features.write(start, self.last_hidden, outputs)
        if not logits:
            return None
        return self.lm_head(self.last_hidden).float()  # [n, vocab]

    def _table(self, run: list[int]) -> object:
        """The kernels' table (`kernels.layer_table`) of the consecutive layers `run`, made on first use."""
        table = self._tables.get(tuple(run))
        if table is None:
            table = self._tables[tuple(run)] = kernels.layer_table([self._kernel_layers[i] for i in run])
        return table

    def final_norm(self, x: Tensor) -> Tensor:
        """The norm after the last layer, of x [n, hidden]: on the kernels, theirs (one call; torch's
        rms_norm is several ops there), else torch's (bitwise transformers')."""
        return kernels.rms_norm(x, self.norm, self.eps) if self.kernels else rms_norm(x, self.norm, self.eps)

    def _kernel_args(self, i: int) -> kernels.LayerArgs:
        """Pointers to layer i's packed weights and cache, for `kernels.layers`."""
        w = self.layers[i]

        def ptr(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        cos, sin = self._rotary(w)
        return kernels.LayerArgs(
            hidden=self.hidden_size, heads=self.heads, kv_heads=self.kv_heads, d=self.head_dim,
            inter=w.gate_up.out_features // 2, cap=self.v_cache.shape[2], eps=self.eps,
            attn_norm=ptr(w.attn_norm), mlp_norm=ptr(w.mlp_norm), wqkv=ptr(w.qkv.weight), bqkv=ptr(w.qkv.bias),
            wo=ptr(w.o.weight), bo=ptr(w.o.bias), wgu=ptr(w.gate_up.weight), wdown=ptr(w.down.weight),
            sqkv=ptr(w.qkv.scales), so=ptr(w.o.scales), sgu=ptr(w.gate_up.scales), sdown=ptr(w.down.scales),
            cos=ptr(cos), sin=ptr(sin), keys=ptr(self.k_cache[i]), values=ptr(self.v_cache[i]),
            q_norm=ptr(w.q_norm), k_norm=ptr(w.k_norm), post_attn_norm=ptr(w.post_attn_norm),
            post_mlp_norm=ptr(w.post_mlp_norm),
            fqkv=w.qkv.qtype, fo=w.o.qtype, fgu=w.gate_up.qtype, fdown=w.down.qtype,
            kv_half=int(self.k_cache.dtype == torch.float16), gelu=int(w.gelu), window=w.window,
            scale=inverse_sqrt(self.head_dim) if self.attn_scale is None else self.attn_scale,
        )

    def _rotary(self, layer: Layer) -> tuple[Tensor, Tensor]:
        """The rotary tables (cos, sin) [max_length, head_dim] of `layer`: its own, else the target's."""
        return layer.rotary or (self.cos, self.sin)

    def _embed(self, token_ids: Tensor) -> Tensor:
        """Input embeddings [n, hidden] (times `embed_scale`); a tied LM head doubles as the embedding table."""
        rows = self.embed[token_ids] if self.tied_rows is None else self.tied_rows(token_ids)
        return rows if self.embed_scale == 1.0 else rows * self.embed_scale

    def _lm_head_rows(self, token_ids: Tensor) -> Tensor:
        """Rows `token_ids` [n] of the LM head's weight, float32 [n, hidden], unpacked from its storage."""
        if self.lm_head.qtype:
            from specsample.models.gguf_blocks import linear_rows

            return linear_rows(self.lm_head, token_ids)
        if self.lm_head.packed:
            return kernels.unpack_rows(self.lm_head.weight, token_ids, self.lm_head.scales)
        return self.lm_head.weight.index_select(1, token_ids).t().contiguous()

    def _mask(self, start: int, positions: Tensor, parents: Tensor | None, window: int) -> Tensor | None:
        """Additive mask [groups * n, start + n] of grouped query rows for n tokens at slots start.. and
        `positions` [n]: each sees the cached positions and the earlier new tokens (a tree's: its ancestors),
        within the last `window` positions of its own if `window`; None where every token sees everything."""
        n = positions.shape[0]
        keys = torch.cat([torch.arange(start), positions])  # [start + n] the position of each slot
        if parents is None:
            visible = keys[None, :] <= positions[:, None]  # [n, start + n]
        else:
            visible = torch.ones(n, start + n, dtype=torch.bool)
            visible[:, start:] = visibility(parents)
        if window:
            visible &= positions[:, None] - keys[None, :] < window
        if bool(visible.all()):
            return None
        mask = torch.zeros(n, start + n, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        return mask.repeat(self.heads // self.kv_heads, 1)  # [groups * n, start + n]

    def _layer(self, i: int, x: Tensor, start: int, positions: Tensor, mask: Tensor | None) -> Tensor:
        """One decoder layer over x [n, hidden] at `positions` [n]; writes K and V of slots start.. into the cache."""
        w = self.layers[i]
        x = self._add_output(w.o, self._attention(i, rms_norm(x, w.attn_norm, self.eps), start, positions, mask),
                             x, w.post_attn_norm)
        gate, up = w.gate_up(rms_norm(x, w.mlp_norm, self.eps)).chunk(2, dim=-1)  # [n, intermediate] each
        act = F.gelu(gate, approximate="tanh") if w.gelu else F.silu(gate)
        return self._add_output(w.down, act * up, x, w.post_mlp_norm)

    def _add_output(self, linear: Linear, inputs: Tensor, x: Tensor, post_norm: Tensor | None) -> Tensor:
        """x [n, hidden] plus linear(inputs), in place: normed by `post_norm` first where the layer has one."""
        if post_norm is None:
            return linear(inputs, residual=x)
        return x.add_(rms_norm(linear(inputs), post_norm, self.eps))

    def _attention(self, i: int, x: Tensor, start: int, positions: Tensor, mask: Tensor | None) -> Tensor:
        """Attention of x [n, hidden] over the cached positions and itself: the heads' outputs [n, heads d],
        before the output projection."""
        w = self.layers[i]
        cos, sin = (table[positions, None] for table in self._rotary(w))  # [n, 1, dim]
        n, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = w.qkv(x)  # [n, (h + 2 kvh) d]
        qk = qkv[:, : (h + kvh) * d].view(n, h + kvh, d)
        if w.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :h], w.q_norm, self.eps), rms_norm(qk[:, h:], w.k_norm, self.eps)], dim=1)
        qk = rotate(qk, cos, sin)  # [n, h + kvh, d]
        q, k = qk[:, :h], qk[:, h:]  # [n, h, d], [n, kvh, d]
        v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
        end = start + n
        self.k_cache[i, :, start:end] = k.transpose(0, 1)
        self.v_cache[i, :, start:end] = v.transpose(0, 1)
        keys = self.k_cache[i, :, :end]  # [kvh, end, d]
        values = self.v_cache[i, :, :end]
        groups = h // kvh
        q = q.view(n, kvh, groups, d).permute(1, 2, 0, 3).reshape(kvh, groups * n, d)  # [kvh, groups n, d]
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                             scale=self.attn_scale)[0]  # [kvh, groups n, d]
        return out.view(kvh, groups, n, d).permute(2, 0, 1, 3).reshape(n, h * d)  # [n, h d]


class LlamaSlots:
    """`count` KV caches over one LlamaTarget's weights, one per request (`target.Slots`).

    A pass stacks the new tokens of several slots: the C++ layer (`kernels.layers_slots`) runs each
    linear map once over all the rows, and each slot's rows attend over that slot's cache, laid out
    as the target's own. The target's kernels compute each row on its own (one chain of
    multiply-adds per output, norms per row), so a row's logits are bitwise those of the same tokens
    scored alone, and those of the target's own `score` after the same prefill. The first
    COMMITTED_POSITIONS positions of every slot are committed when the slots are made (a server makes
    them at start): committed at first use, a slot's page faults would cost the whole batch time
    when a request first takes it.

    A prefill starts from the longest prefix of its tokens that another slot holds (the chat
    template's system turn, a shared document), copying those positions' keys and values instead of
    computing them again: a position's keys and values depend only on the tokens up to it, bitwise
    (the kernels compute each row on its own), so the copy is what the prefill would write.
    """

    def __init__(self, target: LlamaTarget, count: int) -> None:
        if not target.kernels:
            raise ValueError("slots (batched decoding) run on the C++ kernels: float32 or GGUF weights and a C++ compiler")
        if count < 1:
            raise ValueError(f"need at least one slot, got {count}")
        self.target, self.count = target, count
        self.vocab_size, self.max_length = target.vocab_size, target.max_length
        self.max_rows = self.max_length
        self.drafts_pass_alone = False  # every row of a pass streams the weights once
        self.k_cache = torch.empty(count, *target.k_cache.shape, dtype=target.k_cache.dtype)  # [slots, layers, kv_heads, cap / 16, dim, 16]
        self.v_cache = torch.empty(count, *target.v_cache.shape, dtype=target.v_cache.dtype)  # [slots, layers, kv_heads, cap, dim]
        layers = range(len(target.layers))
        # addresses of each slot's cache of each layer, [layers, slots], for the C++ layer
        self._keys = torch.tensor([[self.k_cache[s, i].data_ptr() for s in range(count)] for i in layers])
        self._values = torch.tensor([[self.v_cache[s, i].data_ptr() for s in range(count)] for i in layers])
        self._lengths = [0] * count
        self._tokens: list[list[int]] = [[] for _ in range(count)]  # each slot's cached token ids
        committed = min(COMMITTED_POSITIONS, self.max_length)
        for part in kernels.key_views(self.k_cache, 0, committed):
            part.zero_()
        self.v_cache[:, :, :, :committed].zero_()

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def prefill(self, slot: int, token_ids: Tensor, budget: int | None = None) -> int:
        """Reset `slot`'s cache and fill it with `token_ids` [n]: the longest prefix another slot holds
        copied from it, the rest (at most `budget` positions of it) in the target's prefill chunks."""
        self.rollback(slot, 0)
        token_ids = token_ids.reshape(-1)
        source, shared = self._longest_prefix(slot, token_ids.tolist())
        if shared:
            for mine, theirs in zip(kernels.key_views(self.k_cache[slot], 0, shared), kernels.key_views(self.k_cache[source], 0, shared)):
                mine.copy_(theirs)
            self.v_cache[slot, :, :, :shared] = self.v_cache[source, :, :, :shared]  # [layers, kv_heads, n, dim]
            self._lengths[slot], self._tokens[slot] = shared, self._tokens[source][:shared]
        end = token_ids.shape[0] if budget is None else min(token_ids.shape[0], shared + budget)
        self.extend(slot, token_ids[shared:end])
        return end

    def extend(self, slot: int, token_ids: Tensor) -> None:
        """Append `token_ids` [n] to `slot`'s cache in the target's prefill chunks; no logits."""
        for chunk in token_ids.reshape(-1).split(PREFILL_CHUNK):
            self.forward([(slot, chunk)], logits=False)

    def _longest_prefix(self, slot: int, token_ids: list[int]) -> tuple[int, int]:
        """(another slot, the number of leading `token_ids` it holds) with the most, (slot, 0) if none."""
        best = (slot, 0)
        for other, cached in enumerate(self._tokens):
            if other == slot:
                continue
            n = 0
            for mine, theirs in zip(token_ids, cached):
                if mine != theirs:
                    break
                n += 1
            best = max(best, (other, n), key=lambda pair: pair[1])
        return best

    def score(self, segments: Sequence[tuple[int, Tensor]]) -> list[Tensor]:
        """Append each segment's tokens [n_s] to its slot in one pass; logits [n_s, vocab] float32 each."""
        return self.forward(segments)

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self._lengths[slot]}")
        self._lengths[slot] = length
        del self._tokens[slot][length:]

    @torch.inference_mode()
    def forward(self, segments: Sequence[tuple[int, Tensor]], logits: bool = True) -> list[Tensor]:
        """One pass over the stacked tokens of `segments` (slot, token_ids [n_s]), slots distinct; their
        logits [n_s, vocab] (none when `logits` is False)."""
        slots = [slot for slot, _ in segments]
        tokens = [ids.reshape(-1).long() for _, ids in segments]
        if len(set(slots)) != len(slots) or not all(0 <= slot < self.count for slot in slots):
            raise ValueError(f"slots {slots} are not distinct slots of 0..{self.count - 1}")
        rows = torch.tensor([t.shape[0] for t in tokens], dtype=torch.int64)  # [segments]
        starts = torch.tensor([self._lengths[slot] for slot in slots], dtype=torch.int64)  # [segments]
        if bool((starts + rows > self.max_length).any()):
            raise ValueError(f"{int((starts + rows).max())} positions exceed max_length {self.max_length}")
        target, n = self.target, int(rows.sum())
        if n == 0:
            return [torch.empty(0, self.vocab_size) for _ in segments] if logits else []
        x = target._embed(torch.cat(tokens))  # [n, hidden]
        index = torch.tensor(slots)
        keys, values = self._keys[:, index], self._values[:, index]  # [layers, segments]
        scratch = torch.empty(n * target._scratch_per_token, dtype=torch.float32)
        kernels.layers_slots(target._layer_table, x, rows, starts, keys, values, scratch)
        for slot, start, count, ids in zip(slots, starts.tolist(), rows.tolist(), tokens):
            self._lengths[slot] = start + count
            self._tokens[slot] += ids.tolist()
        if not logits:
            return []
        hidden = target.final_norm(x)  # [n, hidden]
        return list(target.lm_head(hidden).float().split(rows.tolist()))  # [n_s, vocab] each
