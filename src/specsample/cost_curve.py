"""The cost curve f(n): the time of one target forward pass over n new tokens, against f(1).

Speculative sampling pays off only if verifying K draft tokens (one pass over
K+1 tokens) costs about one plain decoding step. `measure` times f(n) over a
cache: the context is prefilled once, each measurement scores n tokens and
rolls back. The values of n are interleaved within each repetition, so
background load hits them alike, and each f(n) is the median over repetitions.
Passes are timed as decoding at a steady K sees them, which on a CPU whose
last-level cache holds the model differs from a rotation through everything
(an Intel Xeon with 260 MiB of L3, the bundled model's blocks):
- each timed pass follows an untimed pass of the same n, and the repetitions
  run through n up and down by turns, so every n follows one near it: a
  single-token pass took 2.53 ms after a 2-token pass, 3.99 ms right after a
  16-token pass, 3.26 after one more single-token pass, 2.64 after four
  (what the larger pass displaced takes several passes to come back);
- the targets are measured one after another, each with all its repetitions,
  as decoding runs one alone: after a pass of the float32 model a single-token
  pass took 4.95 ms, and 3.86 ms after five more of its own, the weights
  refilling the cache over many passes.
With targets and n interleaved, f(8)/f(1) read 1.62; timed this way, 2.5 to 2.7.
`bench cost-curve` prints it (`bench/cost_curve.py`).

`machine_ratios` is the cost model's prior (`policy.SeesCostCurve`): the K
policy learns f(n)/f(1) online, one pass at a time, at the n it tries, so a
fresh process starts knowing nothing; one slow early pass over n tokens (a
cold cache, a burst of load) can keep K at 0 for a whole short request, since
an n that K = 0 never scores is not measured again. So before its first
request, a sampler under the cost model measures its target's curve over a
short cache and hands the ratios to the policy as a few measurements' worth of
evidence. For a GGUF file they are remembered in the cache directory per file,
backend, CPU, thread count and kernel version, so one run per machine pays
(under a second for the bundled model).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter

import torch
from torch import Tensor

from specsample.models.target import Target, rolls_back

PRIOR_NS = (1, 2, 3, 4, 5, 7, 9, 13, 17)  # n measured for the prior: every K up to CostModelK's k_max = 16
PRIOR_CONTEXT = 64  # cached tokens under the prior's passes
PRIOR_REPEATS = 5
METHOD = 2  # how `measure` times passes (2: as above; 1: targets and n in one rotation); part of the prior's key


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


def time_score(target: Target, tokens: Tensor, context: Tensor) -> float:
    """Seconds to score `tokens` after `context` [L]; the cache holds the context again afterwards."""
    if target.length != context.shape[0]:
        back_to(target, context)
    start = perf_counter()
    target.score(tokens)
    elapsed = perf_counter() - start
    back_to(target, context)
    return elapsed


def back_to(target: Target, context: Tensor) -> None:
    """The target's cache as after `context` [L], which what it holds starts with: rolled back, or filled
    again where it cannot roll back (`target.rolls_back`: a recurrent model on llama.cpp)."""
    if rolls_back(target):
        target.rollback(context.shape[0])
    else:
        target.prefill(context)


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
    curves = []
    for name, target in targets.items():  # one after another, as decoding runs one alone
        target.prefill(context)
        times: dict[int, list[float]] = {n: [] for n in ns}
        for rep in range(warmup + repeats):
            for n in ns if rep % 2 == 0 else ns[::-1]:  # up, then down: each n follows one near it
                time_score(target, continuation[:n], context)  # the pass before, of the same size
                elapsed = time_score(target, continuation[:n], context)
                if rep >= warmup:
                    times[n].append(elapsed)
        curves.append(CostCurve(name, context_length, list(ns), [1000 * statistics.median(times[n]) for n in ns]))
    return curves


def measure_synthetic(
    targets: dict[str, Target], context: int, ns: Sequence[int], repeats: int, warmup: int = 1
) -> list[CostCurve]:
    """`measure` over a cache of `context` made-up tokens (0, 1, 2, ...: the machine's cost needs no real
    text), leaving every target's cache empty."""
    ids = torch.arange(context + max(ns)) % min(target.vocab_size for target in targets.values())  # [context + max n]
    curves = measure(targets, ids[:context], ids[context:], ns, repeats, warmup)
    for target in targets.values():
        target.rollback(0)
    return curves


def remembered_ratios(key: str | None) -> dict[int, float] | None:
    """The ratios `machine_ratios` remembered under `key` on this machine, if it has measured them."""
    from specsample.models.loading import remembered

    return None if key is None else remembered(ratios_path(key), _parse_ratios)


def _parse_ratios(text: str) -> dict[int, float]:
    """Ratios as `machine_ratios` keeps them; ValueError for a file with no f(1)/f(1) of 1 (damaged)."""
    ratios = {int(n): float(ratio) for n, ratio in json.loads(text).items()}
    if ratios.get(1) != 1.0:
        raise ValueError("no f(1)/f(1)")
    return ratios


def machine_ratios(target: Target, key: str | None) -> dict[int, float]:
    """f(n)/f(1) of `target` on this machine at PRIOR_NS, remembered under `key` (None: measured anew,
    not remembered). Measuring leaves the target's cache empty."""
    from specsample.models.loading import remember

    def measure_ratios() -> dict[int, float]:
        ns = [n for n in PRIOR_NS if n < target.max_length]  # a cached token and n new ones fit
        context = min(PRIOR_CONTEXT, target.max_length - max(ns))
        (curve,) = measure_synthetic({"target": target}, context, ns, PRIOR_REPEATS)
        return dict(zip(curve.ns, curve.ratios))

    if key is None:
        return measure_ratios()
    return remember(ratios_path(key), _parse_ratios, measure_ratios, json.dumps)


def ratios_path(key: str) -> Path:
    """Where the ratios of `key` (a model file, backend and thread count) are kept on this CPU."""
    from specsample.models.choice import KERNELS_VERSION
    from specsample.models.kernels import machine_digest
    from specsample.models.loading import cache_root

    digest = machine_digest(key, KERNELS_VERSION, PRIOR_NS, PRIOR_CONTEXT, METHOD)
    return cache_root() / "cost-curve" / f"{digest}.json"
