"""What reading the target's rows lazily saves at temperature 1 (`sampling.Rows`): the shipped verifier
against one that computes all k + 1 rows' sampling transform and noise before its first comparison, as
verification did before, in one process, each with its own sampler (its own K policy and suffix
history), alternated prompt by prompt over tuned prompts (even question_ids), seeded (coupled
verification), `--k auto`.

    python benchmarks/lazy_rows_cost.py --drafter suffix --backend gguf
    python benchmarks/lazy_rows_cost.py --drafter quantized --backend fast
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import Tensor

from specsample import SpecSampler
from specsample.prompts import packaged_prompts, read_prompts
from specsample.sampling import Rows
from specsample.verify import ChainVerifier, Verdict, coupled_verify


def eager(draft_tokens: Tensor, target_probs: Rows, noise: Rows) -> Verdict:
    """Coupled verification over every row, all made before the first comparison."""
    rows = range(len(target_probs))
    return coupled_verify(draft_tokens, torch.stack([target_probs[i] for i in rows]), torch.stack([noise[i] for i in rows]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--backend", default="gguf")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    verifiers = {"eager": ChainVerifier(coupled=eager), "lazy": ChainVerifier()}
    samplers = {name: SpecSampler.load(None, args.drafter, backend=args.backend) for name in verifiers}
    prompts = [p.turns[0] for p in read_prompts(packaged_prompts(), split="even")][: args.prompts]
    for name, sampler in samplers.items():
        sampler.verifier = verifiers[name]
        sampler.generate(prompts[-1], temperature=1, max_new_tokens=16, seed=0)  # warm up
    runs: dict[str, list] = {name: [] for name in samplers}
    for i, prompt in enumerate(prompts):
        for name in sorted(samplers, reverse=i % 2 == 1):
            stats = samplers[name].generate(prompt, temperature=1, max_new_tokens=args.max_new_tokens, seed=0, k="auto").stats
            runs[name].append((stats.decode_seconds, stats.generated_tokens, stats.mean_accepted_length))
    for name, r in runs.items():
        tokens_per_second = sum(x[1] for x in r) / sum(x[0] for x in r)
        print(f"{name}: decode {tokens_per_second:.1f} tokens/s, mean accepted length {statistics.mean(x[2] for x in r):.2f}")
    ratio = statistics.median(a[0] / b[0] for a, b in zip(runs["eager"], runs["lazy"]))
    print(f"eager / lazy decode seconds, median over prompts: {ratio:.3f}")


if __name__ == "__main__":
    main()
