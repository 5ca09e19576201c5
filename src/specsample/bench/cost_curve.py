"""The cost curve: f(n), the time of one forward pass over n new tokens, against f(1).

Speculative sampling pays off only if verifying K draft tokens (one pass over
K+1 tokens) costs about one plain decoding step. This measures f(n)/f(1) for
n = 1..16 over a realistic cache: the context is prefilled once, each
measurement scores n tokens and rolls back. Backends and values of n are
interleaved within each repetition, so background load hits them alike, and
each f(n) is the median over repetitions. The llamacpp backend times the GGUF
file at its own quantization on llama.cpp (its own threads, `threads`), the
others its float32 weights on torch's threads.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from time import perf_counter

import torch
from torch import Tensor

from specsample.models import LoadedModel, make_target
from specsample.models.target import Target


@dataclass
class CostCurve:
    backend: str
    context_length: int
    ns: list[int]
    ms: list[float]  # median milliseconds of score(n tokens), one per n

    @property
    def ratios(self) -> list[float]:
        return [m / self.ms[0] for m in self.ms]

    def ratio(self, n: int) -> float:
        return self.ratios[self.ns.index(n)]

    def to_dict(self) -> dict:
        return {**asdict(self), "ratios": self.ratios}


def _time_score(target: Target, tokens: Tensor, context_length: int) -> float:
    """Seconds to score `tokens` after the context; the cache is rolled back to the context."""
    target.rollback(context_length)
    start = perf_counter()
    target.score(tokens)
    elapsed = perf_counter() - start
    target.rollback(context_length)
    return elapsed


def measure(
    targets: dict[str, Target],
    context: Tensor,
    continuation: Tensor,
    ns: Sequence[int] = tuple(range(1, 17)),
    repeats: int = 7,
    warmup: int = 1,
) -> list[CostCurve]:
    """f(n) for each target, prefilled with `context` [L], scoring the first n of `continuation`."""
    if continuation.shape[0] < max(ns):
        raise ValueError(f"the continuation has {continuation.shape[0]} tokens, fewer than n = {max(ns)}")
    if 1 not in ns:
        raise ValueError("ns must include 1, the reference of the ratios")
    ns = sorted(ns)
    context_length = int(context.shape[0])
    for target in targets.values():
        target.prefill(context)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in ns} for name in targets}
    for rep in range(warmup + repeats):
        for n in ns:
            for name, target in targets.items():
                elapsed = _time_score(target, continuation[:n], context_length)
                if rep >= warmup:
                    times[name][n].append(elapsed)
    return [
        CostCurve(name, context_length, list(ns), [1000 * statistics.median(times[name][n]) for n in ns])
        for name in targets
    ]


def targets(loaded: LoadedModel, backends: Sequence[str], threads: int | None = None) -> dict[str, Target]:
    """A target per backend name, of the one model; `threads` for llama.cpp's passes (None: all cores)."""
    return {name: make_target(loaded, name, threads=threads) for name in backends}


def describe(targets: dict[str, Target]) -> list[str]:
    """One line per target: its class and threads (and llama.cpp's CPU variant)."""
    lines = []
    for name, target in targets.items():
        if hasattr(target, "n_threads"):  # LlamaCppTarget
            from specsample.models.llamacpp import system_info

            lines.append(f"{name}: {type(target).__name__}, {target.n_threads} threads, {system_info()}")
        else:
            lines.append(f"{name}: {type(target).__name__}, {torch.get_num_threads()} torch threads")
    return lines


def context_tokens(tokenizer, text: str, length: int) -> Tensor:
    """`length` token ids of `text`, repeated as needed: a realistic context to attend over."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError("the context text has no tokens")
    ids = (ids * (length // len(ids) + 1))[:length]
    return torch.tensor(ids, dtype=torch.long)
