"""The llamacpp backend's prefill by the rows of its prompt passes: 63 (`llamacpp.N_BATCH`, below the 64
from which llama.cpp's flash attention and K-quant products tile a pass, what every pass ran before
2026-12-07's prompt blocks) against 256 (`llamacpp.PREFILL_ROWS`, the prompt blocks), or the `--rows`
given, interleaved round by round in one process, each round on a fresh target; the median tokens/s of
`--rounds` rounds and their ratio.

    python benchmarks/llamacpp_prefill_ubatch.py --lengths 300 700 2000
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import specsample.models.llamacpp as llamacpp
from specsample.models.loading import bundled_gguf

def prefill_seconds(path: Path, rows: int, prompt: torch.Tensor, threads: int) -> float:
    """Seconds of one prefill of `prompt` on a new target whose prompt passes hold `rows` positions."""
    llamacpp.PREFILL_ROWS = rows  # read by the target's context, its batch and its prompt
    target = llamacpp.LlamaCppTarget(path, n_threads=threads, max_length=prompt.shape[0] + 16)
    try:
        start = time.perf_counter()
        target.prefill(prompt)
        return time.perf_counter() - start
    finally:
        target.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the bundled model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[700, 2000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs=2, default=[llamacpp.N_BATCH, llamacpp.PREFILL_ROWS],
                        help="the two row counts compared (default: 63 and 256)")
    args = parser.parse_args()
    rows_compared = tuple(args.rows)
    path = args.model or bundled_gguf()
    probe = llamacpp.LlamaCppTarget(path, n_threads=args.threads, max_length=16)
    vocab = probe.vocab_size
    probe.close()
    prompt = torch.randint(10, vocab, (max(args.lengths),), generator=torch.Generator().manual_seed(3))
    seconds = {(n, rows): [] for n in args.lengths for rows in rows_compared}
    for round_ in range(args.rounds):
        for n in args.lengths:
            for rows in rows_compared if round_ % 2 == 0 else rows_compared[::-1]:
                seconds[(n, rows)].append(prefill_seconds(path, rows, prompt[:n], args.threads))
    a, b = rows_compared
    for n in args.lengths:
        ta, tb = (statistics.median(seconds[(n, rows)]) for rows in rows_compared)
        print(f"prompt {n}: passes of {a} rows {n / ta:.0f} tokens/s, of {b} rows {n / tb:.0f} tokens/s, "
              f"{a} takes {ta / tb:.2f}x as long (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
