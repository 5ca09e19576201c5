"""A per-step trace of the cost-model K policy (`--k auto`) on the bundled model: what it chose, what it
expected and what each step gave, to see why it drafts as it does.

For every step: its index in its request, the K chosen, the draft tokens verified, cut (`keep`) and accepted, the drafting and
verification milliseconds, and the policy's expectations at the choice (P(accepted >= i | verified),
the expected speedup over plain decoding of each K). For an `A+B` drafter each step is attributed to
the drafter that drafted it (`FallbackDrafter.first_steps`). Prints the K chosen (K: steps), per source
the steps, tokens per step, milliseconds per step and tokens per millisecond, and with `--show A:B` the
steps A to B; `--out FILE` writes every step as a JSON line.

    python benchmarks/policy_trace.py [--drafter suffix+quantized] [--backend fast] [--temperature 1]
        [--split all --limit 2] [--max-new-tokens 128] [--show 200:260] [--out trace.jsonl]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

from specsample import SpecSampler
from specsample.policy import CostModelK
from specsample.prompts import packaged_prompts, read_prompts
from specsample.stats import Step

CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")


class TracedCostModelK(CostModelK):
    """The cost model, recording each choice and the step that followed it."""

    def __init__(self, drafter, **options) -> None:
        self.drafter, self.steps, self.choice, self.request_step = drafter, [], {}, 0
        super().__init__(**options)

    def begin(self) -> None:
        super().begin()
        self.request_step = 0

    def choose(self) -> int:
        k = super().choose()
        plain = self.rates[0] or 1.0
        self.choice = {
            "k": k,
            "first_steps": getattr(self.drafter, "first_steps", 0),
            "p_accepted_if_verified": [round(p, 3) for p in self.accepted_if_verified[:8]],
            "expected_speedup": [round(r / plain, 3) for r in self.rates[:9]],
        }
        return k

    def observe(self, step: Step) -> None:
        drafted_by_first = getattr(self.drafter, "first_steps", 0) > self.choice.get("first_steps", 0)
        source = "none" if step.drafted + step.cut == 0 else "first" if drafted_by_first else "model"
        self.steps.append({
            **{key: value for key, value in self.choice.items() if key != "first_steps"},
            "source": source, "drafted": step.drafted, "cut": step.cut, "accepted": step.accepted, "emitted": step.emitted,
            "draft_ms": round(1e3 * step.draft_seconds, 2), "verify_ms": round(1e3 * step.verify_seconds, 2),
            "step_in_request": self.request_step,
        })
        self.request_step += 1
        super().observe(step)


def summary(steps: list[dict]) -> None:
    print("K chosen (K: steps):", ", ".join(f"{k}: {n}" for k, n in sorted(Counter(s["k"] for s in steps).items())))
    by_source: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for s in steps:
        totals = by_source[s["source"]]
        totals[0] += 1
        totals[1] += s["emitted"]
        totals[2] += s["draft_ms"] + s["verify_ms"]
    for source, (n, tokens, ms) in sorted(by_source.items()):
        print(f"{source:6s} {n:5d} steps, {tokens / n:.2f} tokens/step, {ms / n:.1f} ms/step, {tokens / ms:.4f} tokens/ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="suffix+quantized")
    parser.add_argument("--backend", default="fast")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--split", default="all")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--show", default=None, help="A:B, the steps to print")
    parser.add_argument("--out", default=None, help="write every step as a JSON line")
    args = parser.parse_args()
    sampler = SpecSampler.load(None, args.drafter, backend=args.backend)
    policy = sampler.policies["auto"] = TracedCostModelK(sampler.drafter)
    prompts = read_prompts(packaged_prompts(), split=args.split, limit=args.limit, skip=args.skip)
    for i, prompt in enumerate(p for p in prompts if p.category in CATEGORIES):
        sampler.generate(prompt.turns[0], max_new_tokens=args.max_new_tokens, temperature=args.temperature, k="auto", seed=i)
    summary(policy.steps)
    if args.show:
        start, end = map(int, args.show.split(":"))
        for step in policy.steps[start:end]:
            print(json.dumps(step))
    if args.out:
        with open(args.out, "w") as out:
            out.writelines(json.dumps(step) + "\n" for step in policy.steps)


if __name__ == "__main__":
    main()
