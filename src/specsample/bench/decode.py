"""Decoding speed: our engine against transformers `generate`, greedy, on the same prompts.

One model is loaded; transformers generates from it directly and our engine
from its Target backend (the fast Llama backend where it applies). Systems
run prompt by prompt, interleaved, after a warm-up, so background load hits
them alike. Tokens per second count the generated tokens over the whole call,
prefill included, for every system; the engine's decode-only rate is also
kept. Greedy outputs must agree token for token.

Optional extra systems run speculative decoding with a drafter, e.g. the
target as its own draft model ("self"): every draft token is accepted, so its
speed against plain decoding is the overhead of drafting and verifying.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter

import torch

DEFAULT_PROMPTS = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "spec_bench" / "dev.jsonl"
TRANSFORMERS = "transformers"
PLAIN = "specsample"


@dataclass
class Run:
    system: str
    prompt_index: int
    prompt_tokens: int
    tokens: list[int]
    seconds: float  # the whole call, prefill included
    decode_seconds: float | None = None  # the engine's decode loop alone

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


@dataclass
class Summary:
    system: str
    tokens: int
    seconds: float
    tokens_per_second: float  # aggregate: all tokens over all seconds
    median_tokens_per_second: float  # median over prompts
    decode_tokens_per_second: float | None
    speedup_vs_transformers: float
    matches_transformers: int  # prompts with token-identical output
    prompts: int


@dataclass
class DecodeBench:
    runs: list[Run] = field(default_factory=list)
    summaries: list[Summary] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "summaries": [asdict(s) for s in self.summaries],
            "runs": [{**asdict(r), "tokens_per_second": r.tokens_per_second} for r in self.runs],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First turns of a Spec-Bench style JSONL file (`turns` lists), or `prompt`/`text` fields."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompts.append(row["turns"][0] if "turns" in row else row.get("prompt") or row["text"])
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def _transformers_run(loaded, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy transformers generate, stopping at the same EOS tokens as the engine."""
    ids = torch.tensor([prompt_ids])
    start = perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=sorted(loaded.eos_token_ids), pad_token_id=sorted(loaded.eos_token_ids)[0],
            top_p=None, top_k=None, temperature=None,
        )
    return out[0, len(prompt_ids):].tolist(), perf_counter() - start


def _engine_run(sampler, prompt: str, max_new_tokens: int, k: int) -> tuple[list[int], float, float]:
    start = perf_counter()
    out = sampler.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0, k=k)
    return out.token_ids, perf_counter() - start, out.stats.decode_seconds


def run(
    prompts: list[str],
    model: str | None = None,
    max_new_tokens: int = 128,
    drafters: dict[str, str] | None = None,
    k: int = 4,
    backend: str = "auto",
    progress=None,
) -> DecodeBench:
    """Benchmark transformers, plain decoding and each drafter in `drafters` (system name: spec)."""
    from specsample.api import SpecSampler
    from specsample.drafters import DraftModelDrafter, NoDrafter, make_drafter
    from specsample.models import load_model, make_target

    loaded = load_model(model)
    target = make_target(loaded, backend)
    samplers = {PLAIN: SpecSampler(loaded, target, NoDrafter())}
    for name, spec in (drafters or {}).items():
        # "self": the target as its own draft model, with a cache of its own.
        drafter = DraftModelDrafter(make_target(loaded, backend)) if spec == "self" else make_drafter(spec, loaded, target)
        samplers[name] = SpecSampler(loaded, target, drafter)
    encoded = [samplers[PLAIN].encode(p) for p in prompts]
    _transformers_run(loaded, encoded[0], 8)  # warm-up
    for sampler in samplers.values():
        _engine_run(sampler, prompts[0], 8, k)
    bench = DecodeBench()
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        tokens, seconds = _transformers_run(loaded, ids, max_new_tokens)
        bench.runs.append(Run(TRANSFORMERS, i, len(ids), tokens, seconds))
        for name, sampler in samplers.items():
            tokens, seconds, decode_seconds = _engine_run(sampler, prompt, max_new_tokens, k)
            bench.runs.append(Run(name, i, len(ids), tokens, seconds, decode_seconds))
        if progress is not None:
            progress(i, [r for r in bench.runs if r.prompt_index == i])
    bench.summaries = summarize(bench.runs)
    return bench


def summarize(runs: list[Run]) -> list[Summary]:
    """Aggregate rates per system, speedups over transformers and agreement with its tokens."""
    reference = {r.prompt_index: r.tokens for r in runs if r.system == TRANSFORMERS}
    systems = list(dict.fromkeys(r.system for r in runs))
    rates = {}
    summaries = []
    for system in systems:
        mine = [r for r in runs if r.system == system]
        tokens = sum(len(r.tokens) for r in mine)
        seconds = sum(r.seconds for r in mine)
        decode = [r.decode_seconds for r in mine if r.decode_seconds is not None]
        rates[system] = tokens / seconds if seconds else 0.0
        summaries.append(Summary(
            system=system, tokens=tokens, seconds=seconds, tokens_per_second=rates[system],
            median_tokens_per_second=statistics.median(r.tokens_per_second for r in mine),
            decode_tokens_per_second=tokens / sum(decode) if decode and sum(decode) else None,
            speedup_vs_transformers=rates[system] / rates[TRANSFORMERS] if rates.get(TRANSFORMERS) else 0.0,
            matches_transformers=sum(r.tokens == reference.get(r.prompt_index) for r in mine),
            prompts=len(mine),
        ))
    return summaries
