"""Decoding speed: our engine against transformers `generate`, greedy, on the same prompts.

A thin use of the harness: transformers `generate` is the reference, then
plain decoding through the engine (its Target backend, the fast Llama backend
where it applies), then speculative decoding with each given drafter, e.g. the
target as its own draft model ("self": every draft token is accepted, so its
speed against plain decoding is the overhead of drafting and verifying). Each
prompt's first turn is answered; the harness warms every system up, runs them
prompt by prompt, interleaved, and times every call end to end, prefill
included. The engine's decode-only rate is also kept. Greedy outputs must agree
with transformers' token for token. On the llamacpp backend llama.cpp's own
plain decoding runs too ("llama.cpp", `llamacpp_baselines`), on the same GGUF
file at the same thread count.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specsample.bench import harness
from specsample.bench.harness import Config, Record
from specsample.models import LoadedModel, Target
from specsample.outputs import write_text
from specsample.prompts import Prompt

TRANSFORMERS = "transformers"
PLAIN = "specsample"
LLAMACPP = "llama.cpp"


@dataclass
class Summary:
    """One system's figures over all prompts."""

    system: str
    tokens: int
    seconds: float
    tokens_per_second: float  # aggregate: all tokens over all seconds
    median_tokens_per_second: float  # median over prompts
    decode_tokens_per_second: float | None  # the engine's decoding time alone; None for transformers
    speedup_vs_transformers: float
    matches_transformers: int  # prompts with token-identical output
    prompts: int


def configs(drafters: Sequence[str], k: int, max_new_tokens: int, llamacpp: bool = False) -> list[Config]:
    """transformers `generate` (the reference), plain decoding, speculative decoding with each drafter,
    and with `llamacpp`, llama.cpp's own plain decoding."""
    common = {"k": str(k), "temperature": 0.0, "max_new_tokens": max_new_tokens}
    return [
        harness.make_config({**common, "name": TRANSFORMERS, "kind": "hf-generate"}),
        harness.make_config({**common, "name": PLAIN, "drafter": "none", "k": "0"}),
        *(harness.make_config({**common, "name": f"{PLAIN}+{spec}", "drafter": spec}) for spec in drafters),
        *([harness.make_config({**common, "name": LLAMACPP, "kind": "llamacpp-plain", "k": "0"})] if llamacpp else []),
    ]


def run(
    model: LoadedModel,
    target: Target,
    prompts: Sequence[Prompt],
    drafters: Sequence[str] = (),
    k: int = 4,
    max_new_tokens: int = 128,
    backend: str = "auto",
    threads: int | None = None,
    unavailable: dict[str, str] | None = None,
) -> list[Record]:
    """The harness's records of every system on the first turn of every prompt (on the llamacpp
    backend, llama.cpp's plain decoding too; `unavailable` gets the systems that cannot run here)."""
    first_turns = [replace(p, turns=p.turns[:1]) for p in prompts]
    systems = configs(drafters, k, max_new_tokens, llamacpp=backend == "llamacpp")
    return harness.run(model, target, systems, first_turns, backend=backend, threads=threads, unavailable=unavailable)


def summarize(records: Sequence[Record]) -> list[Summary]:
    """Aggregate rates per system, speedups over transformers and agreement with its tokens."""
    systems = list(dict.fromkeys(r.config for r in records))
    rates = {}
    summaries = []
    for system in systems:
        mine = [r for r in records if r.config == system]
        tokens = sum(r.generated_tokens for r in mine)
        seconds = sum(r.wall_seconds for r in mine)
        decode_seconds = sum(r.stats["decode_seconds"] for r in mine if r.stats is not None)
        rates[system] = tokens / seconds if seconds else 0.0
        summaries.append(Summary(
            system=system, tokens=tokens, seconds=seconds, tokens_per_second=rates[system],
            median_tokens_per_second=statistics.median(
                r.generated_tokens / r.wall_seconds if r.wall_seconds else 0.0 for r in mine),
            decode_tokens_per_second=tokens / decode_seconds if decode_seconds else None,
            speedup_vs_transformers=rates[system] / rates[TRANSFORMERS] if rates.get(TRANSFORMERS) else 0.0,
            matches_transformers=sum(bool(r.matches_plain) for r in mine),
            prompts=len(mine),
        ))
    return summaries


def save(path: str | Path, summaries: Sequence[Summary], records: Sequence[Record]) -> None:
    """The summaries and every answer's record as JSON."""
    data = {"summaries": [asdict(s) for s in summaries], "records": harness.record_dicts(records)}
    write_text(Path(path), json.dumps(data, indent=2))
