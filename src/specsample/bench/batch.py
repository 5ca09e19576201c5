"""Batched decoding in one process: `SpecSampler.generate_batch` against the same prompts one at a time.

The server's figures (benchmarks/batch_clients.py) add HTTP, streaming and the clients' own CPU to
the batch; this measures the batch alone. For each K spec, the prompts run one after another through
`generate` (the one-at-a-time server's work) and together through `generate_batch` (at most
`max_batch` at once, a request joining as one ends), rounds interleaved so that a shared machine's
load falls on both alike. Each way runs on a sampler of its own, as two servers would, and each round
and K spec on prompts of its own: a lookup drafter learns every text it sees, so a prompt seen before
(by the other way, another K spec, or in an earlier round) would be drafted from its own earlier answer. A batch is made
once per K spec and reused, warm, as a server's is (its slots committed, its policies keeping what
they measured). Each batched run is split into the
prompts' prefill, the target passes of its steps and the rest of its steps (drafting, verifying,
policies, per-request Python): where the batch spends its time outside the pass it shares.
Every greedy completion of the batch must equal the prompt's alone (`differing`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter

from specsample.api import Completion, SpecSampler
from specsample.batch import Totals
from specsample.outputs import write_text


@dataclass
class Row:
    """One run: a K spec, one at a time or batched, all the prompts."""

    k: str
    mode: str  # "alone" or "batch N"
    round: int
    tokens: int
    seconds: float
    differing: int | None = None  # batched completions not equal to the prompt's alone
    steps: int | None = None  # batched: its steps, and per step rows, pass and other ms
    rows_per_step: float | None = None
    pass_ms: float | None = None
    other_ms: float | None = None
    prefill_seconds: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def alone(sampler: SpecSampler, prompts: list[str], k: str, max_new_tokens: int) -> tuple[list[Completion], float]:
    """The prompts one after another (greedy), and the wall seconds of all of them."""
    start = perf_counter()
    completions = [sampler.generate(p, max_new_tokens=max_new_tokens, temperature=0.0, k=k) for p in prompts]
    return completions, perf_counter() - start


def batched(sampler: SpecSampler, batch, prompts: list[str], max_new_tokens: int) -> tuple[list[Completion], float, Totals]:
    """The prompts through `batch` (greedy): completions, wall seconds, and the totals of this run alone."""
    before = Totals(**asdict(batch.totals))
    start = perf_counter()
    completions = sampler.generate_batch(prompts, batch=batch, max_new_tokens=max_new_tokens, temperature=0.0)
    seconds = perf_counter() - start
    after = batch.totals
    return completions, seconds, Totals(**{name: getattr(after, name) - value for name, value in asdict(before).items()})


def run(one: SpecSampler, many: SpecSampler, warmup: list[str], rounds: list[list[list[str]]], ks: list[str],
        max_batch: int, max_new_tokens: int) -> list[Row]:
    """Every K spec alone (on sampler `one`) and batched (on `many`), interleaved, after a warm-up of each on
    the `warmup` prompts; rounds[r][i] are the prompts of round r and K spec i. The two ways take turns
    going first, round by round, so that neither always runs on what the other left (caches, clocks)."""
    batches = {k: many.batch(max_batch, k) for k in ks}
    for k in ks:  # warm-up: compiled kernels, committed caches, first policy measurements
        alone(one, warmup, k, 8)
        batched(many, batches[k], warmup, 8)
    rows = []
    for round_, sets in enumerate(rounds):
        for k, prompts in zip(ks, sets, strict=True):
            if round_ % 2:
                completions, batch_seconds, totals = batched(many, batches[k], prompts, max_new_tokens)
            reference, seconds = alone(one, prompts, k, max_new_tokens)
            rows.append(Row(k, "alone", round_, sum(len(c.token_ids) for c in reference), seconds))
            if not round_ % 2:
                completions, batch_seconds, totals = batched(many, batches[k], prompts, max_new_tokens)
            seconds, steps = batch_seconds, max(totals.steps, 1)
            rows.append(Row(
                k, f"batch {max_batch}", round_, sum(len(c.token_ids) for c in completions), seconds,
                differing=sum(c.token_ids != r.token_ids for c, r in zip(completions, reference)),
                steps=totals.steps, rows_per_step=totals.rows / steps, pass_ms=1000 * totals.pass_seconds / steps,
                other_ms=1000 * (totals.step_seconds - totals.pass_seconds) / steps,
                prefill_seconds=totals.prefill_seconds,
            ))
    return rows


def save(path: Path, rows: list[Row], about: dict) -> None:
    write_text(path, json.dumps({**about, "rows": [{**asdict(r), "tokens_per_second": r.tokens_per_second}
                                                   for r in rows]}, indent=1))
