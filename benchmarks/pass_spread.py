"""Where a cost curve's spread between processes comes from: one GGUF file on its blocks, f(1) and f(8)
(the median of `--repeats` passes of 1 and 8 tokens after `--context` cached positions) timed round by
round in one process, with the share of the process on 2 MiB pages. Run it several times, and under
`setarch "$(uname -m)" -R` (every buffer at the same address each run): a spread that stays with fixed
addresses, and moves between rounds of one process, is the machine's memory bandwidth, not placement.

    python benchmarks/pass_spread.py --model /tmp/specsample-1b/random-1b-Q8_0.gguf
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch

from specsample.models.gguf_blocks import file_target


def median_ms(target, tokens: torch.Tensor, context: int, repeats: int) -> float:
    """The median milliseconds of `repeats` passes over `tokens` after `context` cached positions."""
    times = []
    for _ in range(repeats):
        target.rollback(context)
        start = time.perf_counter()
        target.score(tokens)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file the blocks run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args()
    target = file_target(args.model)
    ids = torch.randint(0, target.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    target.prefill(ids)
    smaps = Path("/proc/self/smaps_rollup").read_text()
    huge, rss = (int(re.search(rf"{key}:\s+(\d+)", smaps).group(1)) // 1024 for key in ("AnonHugePages", "Rss"))
    print(f"{args.model}: {huge} MB of {rss} MB on 2 MiB pages")
    for round_ in range(args.rounds):
        f1, f8 = (median_ms(target, ids[:n], args.context, args.repeats) for n in (1, 8))
        print(f"round {round_}: f(1) {f1:.1f} ms, f(8) {f8:.1f} ms, f(8)/f(1) {f8 / f1:.2f}", flush=True)


if __name__ == "__main__":
    main()
