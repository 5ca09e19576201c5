"""A weight-only int8 copy of a Llama-family target, to serve as its own draft model.

Every linear map, the LM head included, keeps int8 weights with one float
scale per output channel (symmetric, absmax / 127) and multiplies with
`torch._weight_int8pack_mm`, activations in bfloat16. The copy is a
LlamaTarget on the backend's torch path, with its own KV cache; the embedding
table stays in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from specsample.models.llama import Layer, Linear, LlamaTarget

ACTIVATIONS = torch.bfloat16


@dataclass
class Int8Linear:
    """A linear map with int8 weights [out, in] and per-output-channel scales [out]."""

    weight: Tensor  # [out, in] int8
    scales: Tensor  # [out]
    bias: Tensor | None  # [out]
    out_features: int
    packed: bool = False  # not the packed float32 layout: the target takes its torch path

    @classmethod
    def quantize(cls, linear: Linear) -> Int8Linear:
        """From a Linear in the [in, out] layout."""
        weight = linear.weight.t().float()  # [out, in]
        scales = weight.abs().amax(1).clamp_min(1e-12) / 127  # [out]
        quantized = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        return cls(quantized, scales.to(linear.weight.dtype), linear.bias, linear.out_features)

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x [n, in] -> [n, out]; with `residual` [n, out], adds into it in place and returns it."""
        y = torch._weight_int8pack_mm(x.contiguous(), self.weight, self.scales)  # [n, out]
        if self.bias is not None:
            y += self.bias
        return y if residual is None else residual.add_(y)


def quantize_layer(layer: Layer) -> Layer:
    return replace(
        layer,
        qkv=Int8Linear.quantize(layer.qkv),
        o=Int8Linear.quantize(layer.o),
        gate_up=Int8Linear.quantize(layer.gate_up),
        down=Int8Linear.quantize(layer.down),
    )


def int8_target(model, max_length: int | None = None) -> LlamaTarget:
    """A LlamaTarget of a transformers Llama-family model with int8 weights; raises UnsupportedModel
    (a ValueError) for architectures the fast backend does not reproduce."""
    base = LlamaTarget.from_hf(model, max_length, dtype=ACTIVATIONS)  # [in, out] weights: the torch path
    embed = base.embed if base.embed is not None else base.lm_head.weight.t().contiguous()  # [vocab, hidden]
    return LlamaTarget(
        [quantize_layer(layer) for layer in base.layers],
        embed,
        base.norm,
        Int8Linear.quantize(base.lm_head),
        base.cos,
        base.sin,
        heads=base.heads,
        kv_heads=base.kv_heads,
        head_dim=base.head_dim,
        eps=base.eps,
    )
