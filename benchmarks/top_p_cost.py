"""What top-p costs a decoding: the bundled model at temperature 1 and top-p 0.95, plain (`--drafter
none`) and with the default drafter, with `sampling._top_p` (the most likely tokens as candidates)
against a sort of the whole vocabulary (the implementation before it), interleaved in one process.

Each round decodes the held-out Spec-Bench prompts (`--split odd`, first turns, 64 new tokens) once
per implementation, the order flipping every round; each run has its own seeds, since the suffix
drafter remembers earlier texts and would copy a repeated one. Prints tokens per second by
implementation and the ratio of each round.

    python benchmarks/top_p_cost.py --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specsample.sampling as sampling
from specsample import SpecSampler
from specsample.bench.cli import read_bench_prompts


def sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by a sort of the whole vocabulary, the baseline."""
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


IMPLEMENTATIONS = {"candidates": sampling._top_p, "sort": sort_top_p}


def tokens_per_second(sampler: SpecSampler, prompts: list[str], seed: int, top_p: float) -> float:
    """Decode every prompt once; new tokens per second of the whole round."""
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        out = sampler.generate(prompt, max_new_tokens=64, temperature=1.0, top_p=top_p, seed=seed + i)
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts per round")
    parser.add_argument("--top-p", type=float, default=0.95)
    args = parser.parse_args()
    prompts = [p.turns[0] for p in read_bench_prompts(None, "odd")][: args.prompts]
    samplers = {"none": SpecSampler.load(drafter="none"), "default": SpecSampler.load()}
    print(f"default: {samplers['default'].configuration}")
    rates = {(config, impl): [] for config in samplers for impl in IMPLEMENTATIONS}
    for r in range(args.rounds):
        order = list(IMPLEMENTATIONS) if r % 2 == 0 else list(IMPLEMENTATIONS)[::-1]
        for config, sampler in samplers.items():
            for impl in order:
                sampling._top_p = IMPLEMENTATIONS[impl]
                seed = 1000 * r + 100 * list(IMPLEMENTATIONS).index(impl)
                rates[(config, impl)].append(tokens_per_second(sampler, prompts, seed, args.top_p))
    sampling._top_p = IMPLEMENTATIONS["candidates"]
    for config in samplers:
        ours, base = rates[(config, "candidates")], rates[(config, "sort")]
        ratios = [a / b for a, b in zip(ours, base)]
        print(f"{config}: candidates {statistics.median(ours):.1f} tokens/s, sort {statistics.median(base):.1f}, "
              f"ratio median {statistics.median(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
