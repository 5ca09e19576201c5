"""Figures of docs/llamacpp-backend.md: the llamacpp backend against the float32 fast backend
on the bundled model (plain decoding tokens/s, the cost curve f(n)/f(1)), and batch invariance
(a position's logits scored alone against inside a batch of 2..16), with and without the
backend's batch-invariant settings.

    python scripts/llamacpp_figures.py [--new-tokens 128] [--repeats 7] [--threads N]

Prints one JSON object; takes about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

from specsample.bench.cost_curve import context_tokens, measure
from specsample.drafters import NoDrafter
from specsample.engine import decode
from specsample.models import make_target
from specsample.models.llamacpp import LlamaCppTarget, system_info
from specsample.models.loading import bundled_gguf, load_model
from specsample.policy import FixedK
from specsample.sampling import GeneratorSource, SamplingParams
from specsample.stats import Stats
from specsample.text import encode_prompt

PROMPTS = [
    "Explain speculative decoding in two sentences.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip and say why each works.",
]
CONTEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the window. "


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def plain_tokens_per_second(target, tokenizer, new_tokens: int) -> float:
    """Greedy plain decoding through the engine, `new_tokens` per prompt: tokens/s over all prompts."""
    tokens = seconds = 0.0
    for prompt in PROMPTS:
        stats = Stats()
        ids = torch.tensor(encode_prompt(tokenizer, prompt))
        for _ in decode(target, NoDrafter(), FixedK(0), ids, SamplingParams(temperature=0), max_new_tokens=new_tokens,
                        eos_token_ids=frozenset(), random=GeneratorSource(torch.Generator().manual_seed(0)), stats=stats):
            pass
        tokens += stats.generated_tokens
        seconds += stats.decode_seconds
    return tokens / seconds


def max_batch_difference(target: LlamaCppTarget, prefix: torch.Tensor, ids: torch.Tensor) -> dict[int, float]:
    """max |logit difference| between each position scored alone and inside a batch of n, by n."""
    target.prefill(prefix)
    alone = torch.cat([target.score(ids[i : i + 1]) for i in range(len(ids))])
    out = {}
    for n in range(2, len(ids) + 1):
        target.rollback(len(prefix))
        out[n] = float((target.score(ids[:n]) - alone[:n]).abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="for both backends (default: all cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model()
    fast = make_target(loaded, "fast")
    llamacpp = LlamaCppTarget(bundled_gguf(), n_threads=args.threads)
    llamacpp_flash = LlamaCppTarget(bundled_gguf(), n_threads=args.threads, batch_invariant=False)
    targets = {"llamacpp": llamacpp, "llamacpp, flash attention": llamacpp_flash, "fast (float32)": fast}

    report: dict = {
        "cpu": cpu_name(), "llama.cpp": system_info(), "threads": llamacpp.n_threads, "model": bundled_gguf().name,
        "load_average": os.getloadavg()[0],  # other processes on the machine, at the start
    }
    report["plain_tokens_per_second"] = {
        name: round(plain_tokens_per_second(t, loaded.tokenizer, args.new_tokens), 1) for name, t in targets.items()
    }
    context = context_tokens(loaded.tokenizer, CONTEXT, 256)
    continuation = context_tokens(loaded.tokenizer, "Once upon a time there was a little robot who loved to sing.", 16)
    report["cost_curve"] = {
        c.backend: {"f1_ms": round(c.ms[0], 2), "ratios": [round(r, 2) for r in c.ratios]}
        for c in measure(targets, context, continuation, repeats=args.repeats)
    }
    draft = torch.randint(0, llamacpp.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    report["max_logit_difference_alone_vs_batch"] = {
        f"{name}, context {len(prefix)}": max_batch_difference(t, prefix, draft)
        for prefix in (torch.tensor(encode_prompt(loaded.tokenizer, PROMPTS[0])), context_tokens(loaded.tokenizer, CONTEXT, 600))
        for name, t in targets.items() if isinstance(t, LlamaCppTarget)
    }
    report["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
