"""The Target protocol: what the engine needs from the model it accelerates.

A target keeps a KV cache of the positions it has seen. `score` runs one forward
pass over n new tokens and returns the logits of every one of them, which is
what makes verifying K draft tokens cost one pass. `rollback` forgets rejected
positions by moving the cache length back; it never copies tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor


@runtime_checkable
class Target(Protocol):
    vocab_size: int
    max_length: int  # positions the cache can hold (the context window)

    @property
    def length(self) -> int:
        """Number of positions currently in the KV cache."""
        ...

    def prefill(self, token_ids: Tensor) -> None:
        """Reset the cache and fill it with `token_ids` [n] (n may be 0); no logits."""
        ...

    def score(self, token_ids: Tensor) -> Tensor:
        """Append `token_ids` [n] to the cache; return their logits [n, vocab]."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached positions."""
        ...

    def record_layers(self, layers: Iterable[int]) -> None:
        """From now on also keep the outputs of these decoder layers (1-based), for `hidden_states`."""
        ...

    def hidden_states(self, layers: Sequence[int] = ()) -> Tensor | None:
        """Hidden states [n, (len(layers) + 1) * hidden] of the last prefill or score call: the
        `normalized` outputs of the recorded decoder `layers`, then the final (normed) state."""
        ...


def normalized(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x [..., hidden] scaled to unit RMS, in float32: a middle layer's output as a draft head reads
    it (the residual stream's scale grows through the layers, and a few dimensions reach 10^4)."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps)


def recordable(layers: Iterable[int], n_layers: int) -> frozenset[int]:
    """`layers` as a set, checked to be decoder layers a target can record: 1..n_layers - 1 (the
    last layer's output is the final state, always kept)."""
    layers = frozenset(layers)
    if not layers <= set(range(1, n_layers)):
        raise ValueError(f"layers {sorted(layers)} are not all among this target's 1..{n_layers - 1}")
    return layers


def stacked_states(recorded: Mapping[int, Tensor], final: Tensor | None, layers: Sequence[int]) -> Tensor | None:
    """`Target.hidden_states(layers)` from the recorded layer outputs [n, hidden] and the final state."""
    if final is None or not layers:
        return final
    missing = [i for i in layers if i not in recorded]
    if missing:
        raise ValueError(f"the outputs of layers {missing} were not recorded: call record_layers({list(layers)}) first")
    return torch.cat([recorded[i] for i in layers] + [final.float()], -1)
