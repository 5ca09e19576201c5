"""The Target protocol: what the engine needs from the model it accelerates.

A target keeps a KV cache of the positions it has seen. `score` runs one forward
pass over n new tokens and returns the logits of every one of them, which is
what makes verifying K draft tokens cost one pass. `rollback` forgets rejected
positions by moving the cache length back; it never copies tensors.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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

    def hidden_states(self) -> Tensor | None:
        """Final (normed) hidden states [n, hidden] of the last prefill or score call."""
        ...
