"""The Llama family's small operations, shared by the fast backend and the draft head.

RMSNorm is one fused torch op (bitwise equal to transformers' float32 one).
Rotary embedding uses the rotate-half layout of transformers with the first
half of sin negated (`rope_tables`), so cat(-x2, x1) * sin becomes
roll(x) * signed_sin: one op instead of four.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., hidden] with `weight` [hidden]."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_tables(inv_freq: Tensor, scaling: float, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin [length, head_dim] for positions 0..length-1, computed as transformers does."""
    positions = torch.arange(length, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [length, head_dim / 2]
    cos = freqs.cos() * scaling
    sin = freqs.sin() * scaling
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding of x [..., heads, dim] with cos, signed_sin broadcastable to it ([n, 1, dim])."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
