"""The Target protocol, what the engine needs from the model it accelerates, and the optional
capabilities a backend may declare for drafters that need more.

A target keeps a KV cache of the positions it has seen. `score` runs one forward
pass over n new tokens and returns the logits of every one of them, which is
what makes verifying K draft tokens cost one pass. `rollback` forgets rejected
positions by moving the cache length back; it never copies tensors.

Every backend provides `Target`. The capabilities below are separate Protocols:
a backend declares one by implementing it, and a drafter that needs it asks with
`require`, which names the drafter and the backend in a one-line error when the
backend lacks it. The engine never asks for any of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

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

    def extend(self, token_ids: Tensor) -> None:
        """Append `token_ids` [n] to the cache; no logits (a long prompt prefilled in parts, `engine.prefill`)."""
        ...

    def score(self, token_ids: Tensor) -> Tensor:
        """Append `token_ids` [n] to the cache; return their logits [n, vocab]."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached positions."""
        ...


@runtime_checkable
class RecordsFeatures(Protocol):
    """Keeps, for every cached position, the hidden states a draft head reads (EAGLE's features).

    Features are indexed by position like the KV cache, so a drafter reads those
    of the positions it has not read yet, whatever calls came in between.
    """

    def record_features(self, layers: Iterable[int]) -> None:
        """From the next pass on, also keep the `normalized` outputs of these decoder layers (1-based)."""
        ...

    def features(self, start: int, end: int, layers: Sequence[int] = ()) -> Tensor:
        """[end - start, (len(layers) + 1) * hidden] of cached positions start..end-1: the recorded
        outputs of `layers`, then the final (normed) state."""
        ...


@runtime_checkable
class RunsLayerSubsets(Protocol):
    """Runs a pass through a subset of its layers in its own cache (self-speculation by layer skipping)."""

    layers: Sequence

    def forward(self, token_ids: Tensor, layers: Sequence[int] | None = None, logits: bool = True) -> Tensor | None:
        """Append `token_ids` [n] running only `layers` (default: all); logits [n, vocab] or None."""
        ...


@runtime_checkable
class QuantizedCopies(Protocol):
    """Makes a cheaper copy of itself with low-bit weights and its own cache (the `quantized` drafter)."""

    @property
    def instruction_set(self) -> str | None:
        """The vector instruction set its kernels (and the copy's) run on ("avx512", "avx2", "portable"),
        or None where they run on torch ops, where a quantized copy is not cheaper."""
        ...

    def quantized_copy(self) -> Target:
        """A copy of this target with quantized weights; it may offer `adopt_cache` for this target."""
        ...


@runtime_checkable
class AdoptsCache(Protocol):
    """Starts its cache from another target's K and V instead of a prefill of its own."""

    def adopt_cache(self, source: Target, length: int, start: int = 0) -> bool:
        """Keep this cache's first `start` positions and take `source`'s positions start..length-1 if it
        keeps them in this layout; False, changing nothing, if not."""
        ...


@runtime_checkable
class ScoresTrees(Protocol):
    """Scores a tree of tokens in one pass (tree attention) and keeps one root-to-node path of it.

    The n tokens of a tree (`specsample.tree`: `parents` [n], -1 for a child of the cached text) are
    appended at cache slots length..length+n-1; each is scored at the position after its ancestors
    and sees the cached text, its ancestors and itself. `keep_path` then moves the K and V of a
    path's tokens (a few rows) to consecutive slots, so the cache holds one contiguous text again.
    """

    def score_tree(self, token_ids: Tensor, parents: Tensor) -> Tensor:
        """Append the tree `token_ids` [n] with `parents` [n]; return their logits [n, vocab]."""
        ...

    def keep_path(self, start: int, nodes: Sequence[int]) -> None:
        """After `score_tree` at cache length `start`: keep tokens `nodes` (a root-to-node path, indices into
        the tree) as positions start, start + 1, ..., and the cache length start + len(nodes)."""
        ...


@runtime_checkable
class CopyCost(Protocol):
    """Declares what a backend's quantized copy (`QuantizedCopies`) costs: the default configuration
    (`specsample.defaults`) drafts with it only where it is cheap."""

    @property
    def copy_cost(self) -> float | None:
        """Seconds of the copy's single-token pass per second of the target's, as measured for this
        backend and kind of file; None where not measured."""
        ...


@runtime_checkable
class Slots(Protocol):
    """The KV caches of several requests at once, one slot each, whose rows are scored in one pass.

    Each slot is a `Target`'s cache of its own: its own length, prefill and rollback (a length,
    never a copy). `score` runs one forward pass over the new tokens of several slots, each its own
    number of positions after its own context; the linear maps stream the weights once for all the
    rows (or, where `drafts_pass_alone`, once for one row of every slot and once more for each slot's
    further rows), and a row's logits are bitwise what they would be without the other rows.
    """

    vocab_size: int
    max_length: int  # positions each slot can hold
    max_rows: int  # positions a slot can score in one pass (a draft and the pending token)
    count: int  # slots: 0..count-1
    # False: every row of a `score` goes in one pass over the weights. True: one pass takes one row of
    # every segment, and a segment's further rows (a draft) pass on their own (llama.cpp), so a draft
    # costs what it costs alone: the batch's K policy prices it so (`policy.PassCost`).
    drafts_pass_alone: bool

    def length(self, slot: int) -> int:
        """Number of positions in `slot`'s cache."""
        ...

    def prefill(self, slot: int, token_ids: Tensor, budget: int | None = None) -> int:
        """Reset `slot`'s cache and fill it with `token_ids` [n] (n may be 0); no logits. With `budget`, at
        most that many positions are computed (positions copied from another slot's cache cost nothing),
        and `extend` adds the rest later: a long prompt's prefill between other requests' steps. Returns
        the number of positions held."""
        ...

    def extend(self, slot: int, token_ids: Tensor) -> None:
        """Append `token_ids` [n] to `slot`'s cache; no logits."""
        ...

    def score(self, segments: Sequence[tuple[int, Tensor]]) -> list[Tensor]:
        """Append each segment's tokens [n_s] to its slot's cache (slots distinct) in one pass;
        their logits [n_s, vocab], segment by segment."""
        ...

    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first `length` positions of `slot`'s cache."""
        ...


@runtime_checkable
class SlottedTarget(Protocol):
    """Makes slots (`Slots`) over its weights: the caches of several requests decoded in one batch."""

    def slots(self, count: int) -> Slots:
        """`count` empty slots of this target's context window, sharing its weights."""
        ...


Capability = TypeVar("Capability")

# What each capability lets a backend do, for the error of a drafter that needs it.
ABILITIES: dict[type, str] = {
    RecordsFeatures: "keeps the hidden states of its cached positions",
    RunsLayerSubsets: "runs a subset of its layers",
    QuantizedCopies: "makes a quantized copy of itself",
    AdoptsCache: "adopts another target's cache",
    SlottedTarget: "scores the rows of several requests in one pass (slots)",
    ScoresTrees: "scores a tree of tokens in one pass",
}


class UnsupportedModel(ValueError):
    """The model is outside what this backend reproduces exactly; use another backend."""


class NotOnThisBackend(ValueError):
    """What a drafter needs, the target's backend cannot do (a capability, a cheaper copy): one line on the
    command line; `bench run` skips such a configuration and says why instead of stopping the run."""


def rolls_back(target: Target) -> bool:
    """Whether `target`'s cache rolls back to any shorter length (`Target.rollback`), as speculation needs
    after a rejected draft token: every backend's does, except llama.cpp's for a recurrent or hybrid model,
    whose memory keeps a state, not positions (its target says so: `rolls_back` False)."""
    return getattr(target, "rolls_back", True)


def require(target: Target, capability: type[Capability], user: str) -> Capability:
    """`target` as `capability`, or a one-line error naming `user` (a drafter) and the backend."""
    if not isinstance(target, capability):
        raise NotOnThisBackend(
            f"{user} needs a target backend that {ABILITIES[capability]}; "
            f"{type(target).__name__} does not (try --backend fast, or another drafter)"
        )
    return target


FEATURE_EPS = 1e-6  # of `normalized`


def normalized(x: Tensor, eps: float = FEATURE_EPS) -> Tensor:
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


class FeatureStore:
    """The per-position features of a backend that implements `RecordsFeatures`.

    Nothing is kept until the first `record`; then rows are preallocated for
    every position of the context window (uncommitted until written). `valid`
    counts the leading positions whose rows hold the current recording: a pass
    from `start` extends it when it writes on from there, a pass through a subset
    of the layers or a rollback shortens it.
    """

    def __init__(self, n_layers: int, hidden: int, capacity: int) -> None:
        self.n_layers, self.hidden, self.capacity = n_layers, hidden, capacity
        self.layers: frozenset[int] = frozenset()
        self.final: Tensor | None = None  # [capacity, hidden] once recording
        self.rows: dict[int, Tensor] = {}  # layer -> [capacity, hidden]
        self.valid = 0

    @property
    def recording(self) -> bool:
        return self.final is not None

    def record(self, layers: Iterable[int]) -> None:
        added = recordable(layers, self.n_layers) - self.layers
        if self.final is None:
            self.final = torch.empty(self.capacity, self.hidden)
        for i in added:
            self.rows[i] = torch.empty(self.capacity, self.hidden)
        if added:
            self.layers |= added
            self.valid = 0  # earlier positions lack the new layers

    def write(self, start: int, final: Tensor, outputs: dict[int, Tensor]) -> None:
        """Rows of positions start.. from the final state [n, hidden] and layer outputs (`normalized`)."""
        end = start + final.shape[0]
        self.final[start:end] = final
        for i in self.layers:
            self.rows[i][start:end] = outputs[i]
        if start <= self.valid:
            self.valid = end

    def keep(self, start: int, nodes: Tensor) -> None:
        """Rows of positions start + nodes [m] move to start..start+m-1 (`ScoresTrees.keep_path`)."""
        if self.final is None:
            return
        source, target = start + nodes, torch.arange(start, start + nodes.shape[0])
        for rows in (self.final, *self.rows.values()):
            rows[target] = rows[source]
        self.truncate(start + nodes.shape[0])

    def truncate(self, length: int) -> None:
        """Positions from `length` on no longer hold what a full pass over the text gives."""
        self.valid = min(self.valid, length)

    def read(self, start: int, end: int, layers: Sequence[int] = ()) -> Tensor:
        """`RecordsFeatures.features`: refuses positions or layers that were not recorded."""
        missing = [i for i in layers if i not in self.layers]
        if self.final is None or missing:
            raise ValueError(f"the outputs of layers {missing} were not recorded: call record_features({list(layers)}) first")
        if not 0 <= start <= end <= self.valid:
            raise ValueError(f"features of positions {start}..{end - 1} were not recorded (recorded: 0..{self.valid - 1})")
        return torch.cat([self.rows[i][start:end] for i in layers] + [self.final[start:end]], -1)
