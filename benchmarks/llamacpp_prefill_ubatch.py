"""What batch invariance costs the llamacpp backend's prefill: a prompt prefilled in ubatches of 63 rows
(`llamacpp.N_BATCH`, below the 64 from which llama.cpp's flash attention and K-quant products tile a pass
with kernels whose rows depend on the pass) against 64, interleaved round by round in one process, each
round on a fresh target; the median tokens/s of `--rounds` rounds and their ratio.

    python benchmarks/llamacpp_prefill_ubatch.py --lengths 700 2000
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import specsample.models.llamacpp as llamacpp
from specsample.models.loading import bundled_gguf

ROWS = (63, 64)


def prefill_seconds(path: Path, rows: int, prompt: torch.Tensor, threads: int) -> float:
    """Seconds of one prefill of `prompt` on a new target whose contexts run ubatches of `rows`."""
    llamacpp.N_BATCH = rows  # read by the target's context and its batch
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
    args = parser.parse_args()
    path = args.model or bundled_gguf()
    probe = llamacpp.LlamaCppTarget(path, n_threads=args.threads, max_length=16)
    vocab = probe.vocab_size
    probe.close()
    prompt = torch.randint(10, vocab, (max(args.lengths),), generator=torch.Generator().manual_seed(3))
    seconds = {(n, rows): [] for n in args.lengths for rows in ROWS}
    for round_ in range(args.rounds):
        for n in args.lengths:
            for rows in ROWS if round_ % 2 == 0 else ROWS[::-1]:
                seconds[(n, rows)].append(prefill_seconds(path, rows, prompt[:n], args.threads))
    for n in args.lengths:
        t63, t64 = (statistics.median(seconds[(n, rows)]) for rows in ROWS)
        print(f"prompt {n}: ubatches of 63 rows {n / t63:.0f} tokens/s, of 64 rows {n / t64:.0f} tokens/s, "
              f"63 takes {t63 / t64:.2f}x as long (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
