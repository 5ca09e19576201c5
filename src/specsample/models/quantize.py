"""A weight-only int8 copy of a Llama-family target, to serve as its own draft model.

Every linear map, the LM head included, keeps int8 weights with one float
scale per output channel (symmetric, absmax / 127). Where the C++ kernels are
available the copy is a float32 LlamaTarget on them: int8 panels
(`kernels.pack_int8`) converted to float in registers, a quarter of the bytes
of the float32 target to stream per forward pass, whole decoder layers in one
call, and a tied embedding read from the int8 LM head. Without them it takes
the backend's torch path: `torch._weight_int8pack_mm` with bfloat16
activations and a bfloat16 embedding table. Either way it has its own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from specsample.models import kernels
from specsample.models.llama import Layer, Linear, LlamaTarget

ACTIVATIONS = torch.bfloat16  # of the torch path


@dataclass
class Int8Linear:
    """The torch path's int8 linear map: weights [out, in] and per-output-channel scales [out]."""

    weight: Tensor  # [out, in] int8
    scales: Tensor  # [out]
    bias: Tensor | None  # [out]
    out_features: int
    packed: bool = False  # not packed panels: the target takes its torch path

    @classmethod
    def quantize(cls, linear: Linear) -> Int8Linear:
        """From a Linear in the [in, out] layout."""
        quantized, scales = kernels.quantize_int8(linear.weight.t())
        return cls(quantized.contiguous(), scales.to(linear.weight.dtype), linear.bias, linear.out_features)

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x [n, in] -> [n, out]; with `residual` [n, out], adds into it in place and returns it."""
        y = torch._weight_int8pack_mm(x.contiguous(), self.weight, self.scales)  # [n, out]
        if self.bias is not None:
            y += self.bias
        return y if residual is None else residual.add_(y)


def quantize_linear(linear: Linear) -> Linear | Int8Linear:
    """`linear` in int8: int8 panels for the kernels if it is packed, else an Int8Linear."""
    if not linear.packed:
        return Int8Linear.quantize(linear)
    weight, scales = kernels.pack_int8(kernels.unpack(linear.weight, linear.out_features))
    return Linear(weight, linear.bias, linear.out_features, packed=True, scales=scales)


def quantize_layer(layer: Layer) -> Layer:
    """`layer` with its four linear maps in int8; norms as they are."""
    return replace(
        layer,
        qkv=quantize_linear(layer.qkv),
        o=quantize_linear(layer.o),
        gate_up=quantize_linear(layer.gate_up),
        down=quantize_linear(layer.down),
    )


def int8_target(model, max_length: int | None = None) -> LlamaTarget:
    """A LlamaTarget of a transformers Llama-family model with int8 weights; raises UnsupportedModel
    (a ValueError) for architectures the fast backend does not reproduce."""
    dtype = torch.float32 if kernels.available() else ACTIVATIONS
    return int8_copy(LlamaTarget.from_hf(model, max_length, dtype=dtype))  # packed when the kernels take it


def int8_copy(base: LlamaTarget) -> LlamaTarget:
    """`base` with int8 weights and a cache of its own: for a target with no transformers model behind it
    (float weights read from a GGUF file)."""
    embed = base.embed
    if embed is None and not base.lm_head.packed:  # the torch path's tied head has no row lookup
        embed = base.lm_head.weight.t().contiguous()  # [vocab, hidden]
    return base.with_weights([quantize_layer(layer) for layer in base.layers], quantize_linear(base.lm_head), embed)
