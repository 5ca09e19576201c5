"""f(1) of the `quantized` drafter's lower-bit copy over its target's, on the GGUF blocks (issue 28).

For each GGUF file: the target built from the file (`gguf_blocks.file_target`) and its lower-bit
copy (`gguf_blocks.lower_bit_copy`: matrices above Q4_0's bits requantized to Q4_0), one
single-token pass each after a context of 200 tokens of English text, interleaved in the same
rounds; the median of each and their ratio, the figure `gguf_blocks.MEASURED_COPY_COST` declares.
Also the time to make the copy and the greedy agreement of copy and target over the context (the
share of positions where their argmax agree), about the acceptance of its drafts at temperature 0.

    python benchmarks/format_copies.py --out /tmp/formats --types Q4_0,Q8_0
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/block_copy_cost.py --cpu-time /tmp/formats/*.gguf BUNDLED
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specsample.models.gguf_blocks import file_target, lower_bit_copy
from specsample.models.loading import bundled_gguf, load_model

CONTEXT = 200
TEXT = (
    "The history of the Roman Empire spans many centuries. It began when Augustus became the first emperor "
    "in 27 BC, and the western half fell in 476 AD. During this time, Rome built roads, aqueducts and cities "
    "across Europe, North Africa and the Middle East. Latin, the language of the Romans, became the basis "
    "for many modern languages, among them Italian, French, Spanish, Portuguese and Romanian. "
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="GGUF files; BUNDLED for the bundled model")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cpu-time", action="store_true", help="time the process's CPU time, not the wall clock")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    ids = torch.tensor(load_model(tokenizer_only=True).tokenizer(TEXT * 4).input_ids[: CONTEXT + 1])
    pairs = {}
    for name in args.files:
        path = bundled_gguf() if name == "BUNDLED" else name
        target = file_target(path)
        start = time.perf_counter()
        copy = lower_bit_copy(target)
        made = time.perf_counter() - start
        logits = [model.score(ids[:CONTEXT]) for model in (target, copy)]
        agreement = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
        pairs[name] = (target, copy, made, agreement)
    times = {(name, role): [] for name in pairs for role in (0, 1)}
    for _ in range(args.rounds + 2):
        for name, (target, copy, _, _) in pairs.items():
            for role, model in enumerate((target, copy)):
                model.rollback(CONTEXT)
                begin = clock()
                model.score(ids[CONTEXT:])
                times[name, role].append(clock() - begin)
    print("| file | target f(1) ms | copy f(1) ms | copy / target | copy made in s | argmax agreement |")
    print("|---|---|---|---|---|---|")
    for name, (_, _, made, agreement) in pairs.items():
        target_ms, copy_ms = (1000 * statistics.median(times[name, role][2:]) for role in (0, 1))
        print(f"| {name} | {target_ms:.2f} | {copy_ms:.2f} | {copy_ms / target_ms:.2f} | {made:.1f} | {agreement:.3f} |")


if __name__ == "__main__":
    main()
