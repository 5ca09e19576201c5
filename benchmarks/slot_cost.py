"""The cost of a batched pass through slots: S requests of R new rows each against one request of S R rows.

A batch step of the server scores the rows of several requests in one pass (`Slots.score`); its
products run once over all rows, but each request's attention reads its own cache. This times, on
the bundled model (or `--model`) on `--backend`, one pass of S slots x R rows for S in `--slots` and
R in `--rows`, every slot's cache holding `--context` positions, and the same S R rows as one
request's (one slot), each as a ratio to a one-row pass f(1) measured in the same round. Rounds
alternate the configurations; the medians over `--rounds` rounds of `--reps` passes are printed.

    python benchmarks/slot_cost.py --context 16,300,1000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernel_isa_curve import cpu_name
from specsample.models import load_target


def pass_ms(slots, context: int, segments: int, rows: int, reps: int, generator: torch.Generator) -> float:
    """Median milliseconds of one pass of `segments` slots x `rows` new tokens, each rolled back after."""
    times = []
    for _ in range(reps):
        batch = [(s, torch.randint(100, 40_000, (rows,), generator=generator)) for s in range(segments)]
        start = time.perf_counter()
        slots.score(batch)
        times.append(time.perf_counter() - start)
        for s in range(segments):
            slots.rollback(s, context)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--backend", default="gguf")
    parser.add_argument("--context", default="300", help="positions in every slot's cache, comma-separated")
    parser.add_argument("--slots", default="1,2,4,8")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    slot_counts = [int(s) for s in args.slots.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    _, target = load_target(args.model, args.backend)
    slots = target.slots(max(slot_counts))
    generator = torch.Generator().manual_seed(0)
    print(f"{cpu_name()}, backend {args.backend}, torch threads {torch.get_num_threads()}")
    for context in (int(c) for c in args.context.split(",")):
        for s in range(max(slot_counts)):
            slots.prefill(s, torch.randint(100, 40_000, (context,), generator=generator))
        shapes = [(1, 1)] + [(n, r) for r in row_counts for n in slot_counts if n > 1] + \
                 [(1, n * r) for r in row_counts for n in slot_counts if n * r > 1]
        ratios: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
        ones = []
        for _ in range(args.rounds):
            one = pass_ms(slots, context, 1, 1, args.reps, generator)
            ones.append(one)
            for shape in shapes:
                ratios[shape].append(pass_ms(slots, context, *shape, args.reps, generator) / one)
        print(f"context {context}: f(1) {statistics.median(ones):.2f} ms")
        for (segments, rows), values in ratios.items():
            if (segments, rows) != (1, 1):
                print(f"  {segments} slot(s) x {rows} row(s) = {segments * rows:2d} rows: "
                      f"{statistics.median(values):.2f} f(1)")


if __name__ == "__main__":
    main()
