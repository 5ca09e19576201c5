"""Where one forward pass on the GGUF blocks spends its time, stage by stage, at n = 1 and n = 8 tokens.

Builds a copy of kernels.cpp with a wall-clock timer around each stage of the decoder layer (the two
norms, the four products, the attention with its rotation and cache writes, the gated activation) and
runs the whole pass of a GGUF file's model on it, `--repeats` passes of each n after `--context` cached
positions, in alternating rounds. Per stage it prints the milliseconds a pass spends there, summed over
the layers, and what an extra token adds: which stages make f(8)/f(1) what it is. The timers cost a
little (about 30 ns a stage and layer), so the passes run slightly slower than the library's.

    python benchmarks/pass_stages.py                                   # the bundled model
    python benchmarks/pass_stages.py --model /tmp/formats/SmolLM2-135M-Instruct.Q8_0.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import specsample  # noqa: F401, I001  first: its OpenMP wait policy (specsample.openmp) must be set before torch loads libgomp

import torch

from specsample.models import bundled_gguf, kernels

STAGES = {  # stage -> the statement of kernels.cpp it times (each occurs once)
    "attention norm": "rms_norm(x, L->attn_norm, M, L->hidden, L->eps, s.h);",
    "QKV product": "linear(L->fqkv, s.h, M, L->hidden, L->wqkv, L->sqkv, s.qkv_width, s.qkv, L->bqkv, 0);",
    "attention": "layer_attention(L, s.qkv, M, start, L->keys, L->values, s.att, parents);",
    "output product": "residual(L, L->fo, s.att, M, s.att_width, L->wo, L->so, L->bo, L->post_attn_norm, s.out, x);",
    "MLP norm": "rms_norm(x, L->mlp_norm, M, H, L->eps, s.h);",
    "gate and up product": "linear(L->fgu, s.h, M, H, L->wgu, L->sgu, 2 * I, s.gu, 0, 0);",
    "gated activation": "gated_mul(s.gu, M, I, s.act, L->gelu);",
    "down product": "residual(L, L->fdown, s.act, M, I, L->wdown, L->sdown, 0, L->post_mlp_norm, s.out, x);",
    "all layers": "for (long i = 0; i < count; i++) layer(Ls[i], x, M, start, scratch, parents);",
}
TIMERS = """
#include <chrono>
static double stage_seconds[16];
static inline double stage_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
extern "C" void stage_read(double* out) { for (int i = 0; i < 16; i++) out[i] = stage_seconds[i]; }
extern "C" void stage_reset() { for (int i = 0; i < 16; i++) stage_seconds[i] = 0; }
"""


def timed_source() -> str:
    """kernels.cpp with each statement of STAGES wrapped in a timer of its own."""
    source = kernels._source()
    head = "#include <string.h>\n"
    assert source.count(head) == 1, "kernels.cpp changed: update pass_stages.py"
    source = source.replace(head, head + TIMERS, 1)
    for i, statement in enumerate(STAGES.values()):
        assert source.count(statement) == 1, f"kernels.cpp changed: update pass_stages.py ({statement})"
        source = source.replace(statement, f"{{ double t0 = stage_now(); {statement} stage_seconds[{i}] += stage_now() - t0; }}")
    return source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file the blocks run (default: the bundled model)")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lib = kernels._build(timed_source(), "native")
    lib.stage_read.argtypes, lib.stage_reset.argtypes = [ctypes.c_void_p], []
    kernels._load = lambda isa: lib  # every target made from here on runs the timed copy
    kernels._library.cache_clear()
    from specsample.models.gguf_blocks import file_target

    target = file_target(args.model or bundled_gguf())
    ids = torch.randint(0, target.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    target.prefill(ids)
    seconds = (ctypes.c_double * 16)()
    per_n: dict[int, list[list[float]]] = {1: [], 8: []}
    for _ in range(args.rounds):
        for n, runs in per_n.items():
            for _ in range(10):  # warm the caches up: a pass after a pause runs slower for several passes
                target.rollback(args.context)
                target.score(ids[:n])
            lib.stage_reset()
            walls = []
            for _ in range(args.repeats):
                target.rollback(args.context)
                start = time.perf_counter()
                target.score(ids[:n])
                walls.append(time.perf_counter() - start)
            lib.stage_read(seconds)
            runs.append([1000 * statistics.median(walls)] + [1000 * seconds[i] / args.repeats for i in range(len(STAGES))])
    rows = {n: [statistics.median(column) for column in zip(*runs)] for n, runs in per_n.items()}
    print(f"{args.model or 'bundled model'}, {args.context} cached positions, {args.rounds} rounds of {args.repeats} passes")
    print("| stage | n = 1, ms a pass | n = 8, ms a pass | an extra token, ms |")
    print("|---|---|---|---|")
    for i, name in enumerate(["whole pass (median)", *STAGES]):
        one, eight = rows[1][i], rows[8][i]
        print(f"| {name} | {one:.3f} | {eight:.3f} | {(eight - one) / 7:.3f} |")


if __name__ == "__main__":
    main()
