"""Lookup drafting rules replayed on plain decoding's greedy answers: what each would give on a target's
cost curve, without running the target again, beside llama.cpp's own (`llama-lookup`'s n-gram cache).

The target answers each prompt greedily once (plain decoding). Then each rule drafts at each step of
that answer as the engine would let it (at most K tokens, its index grown by the tokens each step emits),
the step accepts the draft's prefix that matches the answer and emits one token more, and the step costs
f(1 + drafted)/f(1) of a plain step, from the target's cost curve measured on this machine (the curve the
K policy starts from, `SpecSampler.cost_ratios`). Printed per category and overall: the estimated speedup
over plain decoding (tokens over the steps' summed cost), the mean accepted length and the draft tokens
verified a step. The drafters' own time and the engine's per-step work are left out.

Rules: `suffix`, `ngram` and `ngram-cache` (the project's drafters at a fixed K; `suffix` keeps its counts
across the prompts, as in a server), and `llama-lookup`: `ngram-cache` at llama.cpp's own thresholds, which
is llama.cpp's `common_ngram_cache_draft` over its context cache (what `llama-lookup` runs without cache
files; drafters/ngram_cache.py).
On the bundled model's 30 held-out answers on the llamacpp backend the replay of `llama-lookup` at K = 4
gave a mean accepted length of 1.49 and 1.04 draft tokens a step, and 1.10x; the tool itself, built batch
invariant so that its answers are these, measured 1.51, 1.08 and 1.04x end to end (BENCHMARKS.md): the
estimate leaves out prefill and every cost but the target's passes, so read it for the differences
between rules, not as a speedup.

    python benchmarks/lookup_rules.py [--backend llamacpp] [--split odd --skip 6] [--limit 6] [--k 2 3 4]
        [--outputs answers.json]   # keeps the answers; a second run with the same file reads them
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specsample import SpecSampler
from specsample.drafters.ngram import LookupDrafter, NgramDrafter
from specsample.drafters.ngram_cache import LLAMA_PERCENT, NgramCacheDrafter
from specsample.drafters.suffix import SuffixDrafter
from specsample.prompts import packaged_prompts, read_prompts
from specsample.sampling import SamplingParams
from specsample.text import encode_prompt
from specsample.tokens import common_prefix

CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")
class Drafter:
    """One of the project's lookup drafters, driven as the engine drives it."""

    def __init__(self, drafter: LookupDrafter) -> None:
        self.drafter = drafter

    def begin(self, prompt: list[int]) -> None:
        self.drafter.begin(torch.tensor(prompt), SamplingParams(temperature=0))

    def observe(self, new: list[int]) -> None:
        self.drafter.observe(new)

    def propose(self, k: int) -> list[int]:
        return self.drafter.lookup(k)


RULES: dict[str, Callable[[], Drafter]] = {
    "suffix": lambda: Drafter(SuffixDrafter()),
    "ngram": lambda: Drafter(NgramDrafter()),
    "ngram-cache": lambda: Drafter(NgramCacheDrafter()),
    "llama-lookup": lambda: Drafter(NgramCacheDrafter(min_percent=LLAMA_PERCENT)),
}


def answers(args: argparse.Namespace) -> tuple[list[dict], dict[int, float]]:
    """Plain decoding's greedy answers to the selected prompts and the target's f(n)/f(1), from
    `--outputs` if it holds them, else measured (and written there)."""
    if args.outputs and Path(args.outputs).is_file():
        saved = json.loads(Path(args.outputs).read_text())
        return saved["answers"], {int(n): r for n, r in saved["ratios"].items()}
    sampler = SpecSampler.load(args.model, drafter="none", backend=args.backend)
    prompts = read_prompts(packaged_prompts(), split=args.split, skip=args.skip, limit=args.limit,
                           categories=CATEGORIES, spec_bench=True)
    rows = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt.turns[0]}]
        out = sampler.generate(messages, max_new_tokens=args.max_new_tokens, temperature=0, k=0)
        rows.append({"category": prompt.category, "prompt": encode_prompt(sampler.model.tokenizer, messages),
                     "answer": out.token_ids})
    ratios = sampler.cost_ratios()
    if args.outputs:
        Path(args.outputs).write_text(json.dumps({"answers": rows, "ratios": ratios}))
    return rows, ratios


def replay(rows: list[dict], rule: Drafter, k: int, cost: Callable[[int], float]) -> dict[str, list[float]]:
    """Per category (and "overall"): [tokens, steps, summed cost in plain steps, draft tokens]."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for row in rows:
        rule.begin(row["prompt"])
        answer, at = row["answer"], 0
        while at < len(answer):
            draft = rule.propose(min(k, len(answer) - at - 1))
            emitted = answer[at : at + common_prefix(draft, answer[at : at + len(draft)]) + 1]
            rule.observe(emitted)
            for key in (row["category"], "overall"):
                for i, value in enumerate((len(emitted), 1, cost(1 + len(draft)), len(draft))):
                    totals[key][i] += value
            at += len(emitted)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--backend", default="llamacpp")
    parser.add_argument("--split", default="odd")
    parser.add_argument("--skip", type=int, default=6)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--outputs", default=None, help="JSON file of the answers and the cost curve (read if it exists)")
    args = parser.parse_args()
    rows, ratios = answers(args)
    measured = sorted(ratios)
    cost = lambda n: float(np.interp(n, measured, [ratios[m] for m in measured]))  # between measured n, linear
    print("f(n)/f(1):", ", ".join(f"{n}: {ratios[n]:.2f}" for n in measured))
    columns = [*(c for c in CATEGORIES if any(r["category"] == c for r in rows)), "overall"]
    print("rule, K | " + " | ".join(columns) + "   (estimated speedup, mean accepted length, draft tokens a step)")
    for name, make in RULES.items():
        for k in args.k:
            totals = replay(rows, make(), k, cost)
            cells = (f"{t / c:.2f}x {t / s:.2f} {d / s:.2f}" for t, s, c, d in (totals[col] for col in columns))
            print(f"{name}, K = {k} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
