"""What coupling costs: acceptance, mean accepted length and speed of seeded requests (coupled sampling)
against unseeded ones (modified rejection sampling), with the same drafter and K.

For each never-tuned Spec-Bench prompt (odd question_ids past the first `TUNED_PER_CATEGORY` of each
category, `--split odd --skip 6` of the bench commands; the first turn, `--limit` per category), each
temperature and each seed in `--seeds`, it runs, interleaved:
- plain decoding with the seed (`CoupledSource`): the reference tokens and the speed baseline;
- for each drafter: coupled (`CoupledSource(seed)`, its tokens compared with plain decoding's: the
  promise requires them identical) and rejection sampling (`GeneratorSource` seeded with the seed);
- for each drafter, the coupled run again, untimed, recording at every verified draft token the
  probability that each rule accepts it given the tokens before it: sum(min(draft_probs, target_probs))
  for rejection sampling, and for coupling the Gumbel-max collision probability
  sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) (P-MinHash, Moulton and Jiang 2018), computed exactly
  (`collision`). The two rules are compared on the very same positions.
It prints, per drafter and temperature, the acceptance rate and mean accepted length (tokens per step,
bonus included) of the runs; tokens per wall second and per CPU second of the process (prefill
included) and their ratios to plain decoding's, pooled over the prompts; the fraction of coupled outputs
identical to plain decoding's; and the paired expected acceptance per draft token under each rule. CPU
seconds are what a shared machine's load moves least: run with `--threads 1`, where no thread waits
for another. `--out` writes the rows as JSON with the machine and the command.

    python benchmarks/coupled_cost.py --drafters quantized,head --temperatures 1,0.7 --limit 1 --threads 1 --out out/coupled.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict

import torch

from specsample.drafters import NoDrafter, make_drafter
from specsample.engine import decode
from specsample.models import load_target
from specsample.policy import FixedK
from specsample.prompts import TUNED_PER_CATEGORY, packaged_prompts, read_prompts
from specsample.sampling import CoupledSource, GeneratorSource, RandomSource, SamplingParams
from specsample.stats import Stats
from specsample.text import encode_prompt


def tokens(target, drafter, k: int, prompt_ids: torch.Tensor, params: SamplingParams, random: RandomSource,
           max_new_tokens: int, eos: frozenset[int], stats: Stats, cpu: dict | None = None, key=None) -> list[int]:
    """The new tokens of one generation; its process CPU seconds added to cpu[key]."""
    start = time.process_time()
    steps = decode(target, drafter, FixedK(k), prompt_ids, params, max_new_tokens=max_new_tokens,
                   eos_token_ids=eos, random=random, stats=stats)
    out = [t for step in steps for t in step]
    if cpu is not None:
        cpu[key] += time.process_time() - start
    return out


def collision(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """P(the Gumbel-max of target_probs and of draft_probs [vocab] under shared noise agree), exactly:
    sum over i of 1 / sum_j max(p_j / p_i, q_j / q_i). p_j / p_i is the larger term exactly when
    p_j / q_j >= p_i / q_i, so with the tokens sorted by p / q the inner sum is (p's mass from i on) / p_i
    + (q's mass before i) / q_i: O(vocab log vocab), not O(vocab ** 2)."""
    p, q = target_probs.double(), draft_probs.double()
    keep = (p > 0) | (q > 0)
    p, q = p[keep], q[keep]
    order = (p / q).argsort()  # p / q: inf where q = 0, 0 where p = 0
    p, q = p[order], q[order]
    q_before = q.cumsum(0) - q
    p_from = p.flip(0).cumsum(0).flip(0)
    both = (p > 0) & (q > 0)
    return float((1 / (p_from[both] / p[both] + q_before[both] / q[both])).sum())


class Recording(CoupledSource):
    """A coupled source that records, at each verified draft token, the probability that rejection
    sampling and coupling accept it given the tokens before it."""

    def __init__(self, seed: int, position: int = 0, rows: dict | None = None, seen: list | None = None) -> None:
        super().__init__(seed, position, rows)
        self.seen = [] if seen is None else seen  # (rejection [k], coupled [k]) per step

    def at(self, position: int) -> "Recording":
        return Recording(self.seed, position, super().at(position).rows, self.seen)

    def verify(self, verifier, draft_tokens, draft_probs, target_probs):
        if draft_probs is not None and len(draft_tokens):
            rows = [(float(torch.minimum(target_probs[i], draft_probs[i]).sum()),
                     collision(target_probs[i], draft_probs[i])) for i in range(len(draft_tokens))]
            self.seen.append(tuple(zip(*rows)))
        return super().verify(verifier, draft_tokens, draft_probs, target_probs)


def expected_length(acceptance: tuple[float, ...]) -> float:
    """Expected tokens of a step whose draft tokens are accepted with these probabilities in turn."""
    total, through = 1.0, 1.0
    for a in acceptance:
        through *= a
        total += through
    return total


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", default="quantized,head")
    parser.add_argument("--temperatures", default="0.7,1")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--limit", type=int, default=2, help="prompts per category")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per prompt (0, 1, ...)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specsample.cli import quiet_transformers

    quiet_transformers()
    loaded, target = load_target(None, "fast")  # the drafters measured (quantized, head) need the fast backend
    names = [d.strip() for d in args.drafters.split(",") if d.strip()]
    drafters = {name: make_drafter(name, loaded, target) for name in names}
    prompts = read_prompts(packaged_prompts(), split="odd", skip=TUNED_PER_CATEGORY, limit=args.limit, spec_bench=True)
    eos = loaded.eos_token_ids
    stats: dict[tuple, Stats] = defaultdict(Stats)
    cpu: dict[tuple, float] = defaultdict(float)
    identical: dict[tuple, list[bool]] = defaultdict(list)
    recorded: dict[tuple, list] = defaultdict(list)
    for temperature in map(float, args.temperatures.split(",")):
        params = SamplingParams(temperature=temperature, top_p=args.top_p)
        for n, prompt in enumerate(prompts):
            prompt_ids = torch.tensor(encode_prompt(loaded.tokenizer, prompt.turns[0], True), dtype=torch.long)
            for seed in range(args.seeds):
                key = ("plain", temperature, "coupled")
                plain = tokens(target, NoDrafter(), 0, prompt_ids, params, CoupledSource(seed), args.max_new_tokens,
                               eos, stats[key], cpu, key)
                for name, drafter in drafters.items():
                    key = (name, temperature, "coupled")
                    coupled = tokens(target, drafter, args.k, prompt_ids, params, CoupledSource(seed),
                                     args.max_new_tokens, eos, stats[key], cpu, key)
                    identical[name, temperature].append(coupled == plain)
                    key = (name, temperature, "rejection")
                    tokens(target, drafter, args.k, prompt_ids, params,
                           GeneratorSource(torch.Generator().manual_seed(seed)), args.max_new_tokens, eos,
                           stats[key], cpu, key)
                    recording = Recording(seed)
                    tokens(target, drafter, args.k, prompt_ids, params, recording, args.max_new_tokens, eos, Stats())
                    recorded[name, temperature] += recording.seen
            print(f"t={temperature} prompt {n + 1}/{len(prompts)}", file=sys.stderr, flush=True)

    rows = []
    for (name, temperature, mode), s in stats.items():
        key, plain_key = (name, temperature, mode), ("plain", temperature, "coupled")
        plain, wall = stats[plain_key], s.generated_tokens / (s.decode_seconds + s.prefill_seconds)
        plain_wall = plain.generated_tokens / (plain.decode_seconds + plain.prefill_seconds)
        same = identical.get((name, temperature), [])
        steps = recorded.get((name, temperature), [])
        # the paired expected acceptance: rule 0 rejection sampling, rule 1 coupling
        paired = [sum(sum(step[rule]) for step in steps) / max(1, sum(len(step[0]) for step in steps)) for rule in range(2)]
        lengths = [sum(expected_length(step[rule]) for step in steps) / max(1, len(steps)) for rule in range(2)]
        rows.append({
            "drafter": name, "temperature": temperature, "mode": mode, "k": 0 if name == "plain" else args.k,
            "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 3),
            "tokens_per_second": round(wall, 2), "speedup": round(wall / plain_wall, 3),
            "tokens_per_cpu_second": round(s.generated_tokens / cpu[key], 2),
            "cpu_speedup": round(s.generated_tokens / cpu[key] / (plain.generated_tokens / cpu[plain_key]), 3),
            "generated_tokens": s.generated_tokens, "steps": s.steps,
            "identical_to_plain": f"{sum(same)}/{len(same)}" if mode == "coupled" and name != "plain" else None,
            "paired_draft_tokens": sum(len(step[0]) for step in steps),
            "paired_acceptance": {"rejection": round(paired[0], 4), "coupled": round(paired[1], 4)}
            if steps and mode == "coupled" else None,
            "paired_expected_length": {"rejection": round(lengths[0], 3), "coupled": round(lengths[1], 3)}
            if steps and mode == "coupled" else None,
        })
    print(f"{'drafter':<10} {'t':>4} {'mode':<10} {'accept':>7} {'MAL':>6} {'tok/s':>7} {'speedup':>8} "
          f"{'tok/cpu-s':>9} {'cpu speedup':>11} {'identical':>10}  paired acceptance, expected length (rejection, coupled)")
    for r in sorted(rows, key=lambda r: (r["temperature"], r["drafter"] != "plain", r["drafter"], r["mode"])):
        paired = ""
        if r["paired_acceptance"]:
            a, n = r["paired_acceptance"], r["paired_expected_length"]
            paired = (f"{a['rejection']:.3f} {a['coupled']:.3f}, {n['rejection']:.2f} {n['coupled']:.2f} "
                      f"over {r['paired_draft_tokens']} draft tokens")
        print(f"{r['drafter']:<10} {r['temperature']:>4} {r['mode']:<10} {r['acceptance_rate']:>7.3f} "
              f"{r['mean_accepted_length']:>6.2f} {r['tokens_per_second']:>7.1f} {r['speedup']:>8.3f} "
              f"{r['tokens_per_cpu_second']:>9.1f} {r['cpu_speedup']:>11.3f} {r['identical_to_plain'] or '':>10}  {paired}")
    if args.out:
        machine = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads()}
        with open(args.out, "w") as f:
            json.dump({"command": sys.argv, "machine": machine, "prompts": len(prompts), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
