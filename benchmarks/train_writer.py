"""How fast `train-draft` writes its answers: the target's batched slots against transformers' `generate`.

Both writers answer the same batches of Spec-Bench prompts (the tuned split, `--split even`, which is what
`train-draft --question-ids even` trains on), greedily, the two alternating batch by batch so that a
shared machine's load falls on both. It prints each writer's tokens per second over the answers it
wrote (prompt prefill included, the features pass excluded: that one is the same either way), their
ratio, and how many answers the two wrote alike (the slots run on `--backend`'s kernels, generate in
float32, so a near tie can go either way).

    python benchmarks/train_writer.py --backend fast --batch 16 --batches 4   # or --backend gguf
"""

from __future__ import annotations

import argparse
import time

import torch
from coupled_cost import cpu_model  # this directory is on sys.path when run as a script

from specsample.models import backend_of, load_model, make_target
from specsample.prompts import packaged_prompts, read_prompts
from specsample.text import encode_prompt
from specsample.training.generate import Writer, generate_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fast", help="the slots' backend (fast, gguf, llamacpp)")
    parser.add_argument("--batch", type=int, default=16, help="prompts per batch, as --generate-batch")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args()
    model = load_model(None)
    target = make_target(model, args.backend)
    texts = [p.turns[0] for p in read_prompts(packaged_prompts(), split="even")][: args.batch * args.batches]
    prompts = [encode_prompt(model.tokenizer, text, True)[-384:] for text in texts]
    writer = Writer(model, lambda: target, args.batch, backend_of(model, args.backend))
    seconds, tokens, alike = {"slots": 0.0, "generate": 0.0}, {"slots": 0, "generate": 0}, 0
    for i in range(0, len(prompts), args.batch):
        batch = prompts[i : i + args.batch]
        order = ["slots", "generate"] if i // args.batch % 2 == 0 else ["generate", "slots"]
        answers = {}
        for name in order:
            start = time.perf_counter()
            answers[name] = (writer(batch, args.max_new_tokens, None) if name == "slots"
                             else generate_batch(model, batch, args.max_new_tokens))
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(map(len, answers[name]))
        alike += sum(a == b for a, b in zip(answers["slots"], answers["generate"]))
    rates = {name: tokens[name] / seconds[name] for name in seconds}
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompts)} prompts "
          f"in batches of {args.batch}, at most {args.max_new_tokens} new tokens")
    for name in ("slots", "generate"):
        print(f"{name:9s} {tokens[name]:6d} tokens in {seconds[name]:6.1f} s: {rates[name]:6.1f} tokens/s")
    print(f"slots / generate: {rates['slots'] / rates['generate']:.2f}x; answers written alike: {alike} of {len(prompts)}")


if __name__ == "__main__":
    main()
