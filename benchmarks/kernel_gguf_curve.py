"""f(n)/f(1) of the GGUF block kernels (kernels_gguf.cpp) next to the float32 kernel, interleaved in one run.

Two measurements, each over the builds asked for (`--isa native,avx2`):

- `matmul`: one pass of products over the bundled model's weight shapes (576x576, 1536x576,
  576x1536, 49152x576; out x in), with random blocks of each format (Q4_0, Q4_1, Q8_0) and a
  float32 copy packed as `kernels.pack` does, for n = 1, 2, 4, 8, 16 rows; the K types (Q4_K,
  Q6_K: inputs in 256-blocks) over the same shapes with 512 inputs for 576, beside Q4_0 and Q8_0
  at those shapes;
- `products` (with --products): each of the bundled model's products alone (fused QKV 960x576, output
  576x576, fused gate and up 3072x576, down 576x1536, the tied head 49152x576), Q4_1, Q4_0 and Q8_0,
  at 1 and 8 rows, each timed right after an untimed call of its own size, the builds in turns: the
  cost of an extra row and its multiply-adds a ns a core, which bound how far f(8)/f(1) can fall;
- `target` (with --target): a whole forward pass of the bundled model on the fast backend, on
  its own GGUF blocks (`gguf_blocks.gguf_target`) and in float32, after a context of 200
  tokens (cost_curve.measure, as benchmarks/kernel_isa_curve.py does it).

Every configuration runs in the same rounds, so other jobs' load falls on all of them alike.
On a loaded machine two OpenMP threads wait for each other whenever one is descheduled;
`--cpu-time` with OMP_NUM_THREADS=1 times one thread's CPU time instead.

    nice -n 19 python benchmarks/kernel_gguf_curve.py --isa native,avx2 --target
    python benchmarks/kernel_gguf_curve.py --isa native --products --extra before=/tmp/kernels_gguf.cpp
    python benchmarks/kernel_gguf_curve.py --isa native --extra before=/tmp/kernels_gguf.cpp --target
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/kernel_gguf_curve.py --cpu-time
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from unittest import mock

import specsample  # noqa: F401, I001  first: its OpenMP wait policy (specsample.openmp) must be set before torch loads libgomp

import numpy as np
import torch
from gguf import GGMLQuantizationType

from specsample.models import gguf_blocks, kernels

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # [out, in]
SHAPES_K = [(512, 512), (1536, 512), (512, 1536), (49152, 512)]  # inputs in whole 256-blocks
Q = GGMLQuantizationType
# (label, format, shapes): float32 is None
PASSES = [(f.name, f, SHAPES) for f in (Q.Q4_0, Q.Q4_1, Q.Q8_0)] + [("float32", None, SHAPES)] + [
    (f"{f.name} (in 512)", f, SHAPES_K) for f in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)
]


def random_blocks(qtype: GGMLQuantizationType, out_features: int, in_features: int, rng) -> gguf_blocks.BlockMatrix:
    """Random integers with small fp16 scales (and mins) in the file layout, packed: timing needs no real weights."""
    values, block_bytes = gguf_blocks.gguf_quant_sizes(qtype)
    raw = rng.integers(0, 256, (out_features, in_features // values, block_bytes), dtype=np.uint8)
    # the fp16 scales: first in the block (Q4_0, Q4_1 d and m, Q8_0, Q4_K d and dmin), last in Q6_K's
    at, count = (block_bytes - 2, 1) if qtype == Q.Q6_K else (0, 2 if qtype in (Q.Q4_1, Q.Q4_K) else 1)
    raw[..., at : at + 2 * count] = np.full((out_features, in_features // values, count), 0.01, np.float16).view(np.uint8)
    return gguf_blocks.pack_blocks(raw.reshape(out_features, -1), qtype)


def matmul_passes(rng) -> dict[str, tuple[list[tuple[int, int]], Callable[[list[torch.Tensor]], None]]]:
    """Label -> (shapes, a pass of products over them for inputs xs [n, in], one per shape)."""
    passes = {}
    for label, qtype, shapes in PASSES:
        if qtype is None:
            packed = [kernels.pack(torch.randn(o, i)) for o, i in shapes]
            passes[label] = shapes, lambda xs, ps=packed, sh=shapes: [kernels.matmul(x, p, o) for p, x, (o, _) in zip(ps, xs, sh)]
        else:
            matrices = [random_blocks(qtype, o, i, rng) for o, i in shapes]
            passes[label] = shapes, lambda xs, ms=matrices: [m(x) for m, x in zip(ms, xs)]
    return passes


def time_rounds(jobs: dict[tuple, Callable[[], None]], repeats: int, clock) -> dict[tuple, float]:
    """Median seconds of each job, all jobs run once per round in `repeats` rounds (after one warm-up)."""
    times: dict[tuple, list[float]] = {key: [] for key in jobs}
    for round_ in range(repeats + 1):
        for key, job in jobs.items():
            start = clock()
            job()
            if round_:
                times[key].append(clock() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def matmul_curve(libs: dict[str, object], ns: list[int], repeats: int, clock) -> None:
    """Print f(1) and f(n)/f(1) of a pass of products over SHAPES, per build and format."""
    passes = matmul_passes(np.random.default_rng(0))
    jobs = {}
    for build, lib in libs.items():
        for label, (shapes, run) in passes.items():
            for n in ns:
                def job(run=run, xs=[torch.randn(n, i) for _, i in shapes], lib=lib):
                    with mock.patch.object(kernels, "_library", lambda: lib):
                        run(xs)
                jobs[(build, label, n)] = job
    medians = time_rounds(jobs, repeats, clock)
    print(f"\nmatmul pass over {', '.join(f'{o}x{i}' for o, i in SHAPES)} (out x in)")
    table(((f"{build} {label}", [medians[(build, label, n)] for n in ns]) for build in libs for label in passes), ns)


def table(rows, ns: list[int]) -> None:
    """A markdown table of f(1) in ms and the ratios f(n)/f(1)."""
    print("| build, weights | f(1) ms | " + " | ".join(f"f({n})/f(1)" for n in ns[1:]) + " |")
    print("|---|---|" + "---|" * (len(ns) - 1))
    for label, seconds in rows:
        print(f"| {label} | {seconds[0] * 1e3:.2f} | " + " | ".join(f"{s / seconds[0]:.2f}" for s in seconds[1:]) + " |")


PRODUCTS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # [out, in] of one layer, then the head


def product_costs(libs: dict[str, object], repeats: int, clock) -> None:
    """Print, per format and product of PRODUCTS, f(1) and f(8) in us and an extra row's cost (us and
    multiply-adds a ns a core, 2 cores), each build timed in turn, every call after one of its own size."""
    rng = np.random.default_rng(0)
    print()
    print("| build | format | product (out x in) | f(1) us | f(8) us | extra row us | multiply-adds a ns a core |")
    print("|---|---|---|---|---|---|---|")
    for qtype in (Q.Q4_1, Q.Q4_0, Q.Q8_0):
        for out_features, in_features in PRODUCTS:
            matrix = random_blocks(qtype, out_features, in_features, rng)
            jobs = {}
            for build, lib in libs.items():
                for n in (1, 8):
                    def job(x=torch.randn(n, in_features), lib=lib):
                        with mock.patch.object(kernels, "_library", lambda: lib):
                            matrix(x)  # untimed: the call before is of the same size, as in decoding
                            start = clock()
                            matrix(x)
                            return clock() - start
                    jobs[(build, n)] = job
            times: dict[tuple, list[float]] = {key: [] for key in jobs}
            for _ in range(repeats):  # rounds: a slower minute falls on every build alike
                for key, job in jobs.items():
                    times[key].append(job())
            seconds = {key: statistics.median(values) for key, values in times.items()}
            for build in libs:
                one, eight = seconds[(build, 1)], seconds[(build, 8)]
                rate = out_features * in_features * 7 / (eight - one) / 2 / 1e9
                print(f"| {build} | {qtype.name} | {out_features}x{in_features} | {one * 1e6:.1f} | {eight * 1e6:.1f} | "
                      f"{(eight - one) / 7 * 1e6:.2f} | {rate:.0f} |")


def target_curve(libs: dict[str, object], ns: list[int], repeats: int, clock, context: int) -> None:
    """Print f(n)/f(1) of whole forward passes of the bundled model, on its blocks and in float32."""
    from kernel_isa_curve import WithKernels

    from specsample import cost_curve
    from specsample.bench import cost_curve as cc
    from specsample.models.llama import LlamaTarget
    from specsample.models.loading import load_model

    loaded = load_model(None)
    first = next(iter(libs.values()))
    with mock.patch.object(kernels, "_library", lambda: first):
        models = {"GGUF blocks": gguf_blocks.gguf_target(loaded.model, loaded.gguf), "float32": LlamaTarget.from_hf(loaded.model)}
    ids = cc.context_tokens(loaded.tokenizer, CONTEXT, context + max(ns))
    targets = {f"{build} {label}": WithKernels(model, lib) for build, lib in libs.items() for label, model in models.items()}
    with mock.patch.object(cost_curve, "perf_counter", clock):
        curves = cost_curve.measure(targets, ids[:context], ids[context:], ns, repeats)
    print(f"\nwhole forward pass of {loaded.name} (Q4_1 layers, Q8_0 tied head), context {context}")
    table(((curve.backend, [ms / 1e3 for ms in curve.ms]) for curve in curves), ns)


CONTEXT = "Speculative decoding drafts a few tokens cheaply and verifies them in one pass of the target. " * 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="native,avx2", help="builds: " + ", ".join(kernels.ISA_FLAGS))
    parser.add_argument("--extra", action="append", default=[], metavar="LABEL=PATH[:ISA]",
                        help="another kernels_gguf.cpp (an older one, say) built beside today's kernels.cpp (repeatable)")
    parser.add_argument("--ns", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--target", action="store_true", help="also whole forward passes of the bundled model")
    parser.add_argument("--products", action="store_true", help="only the bundled model's products at 1 and 8 rows")
    parser.add_argument("--context-length", type=int, default=200)
    parser.add_argument("--cpu-time", action="store_true", help="time this process's CPU seconds, not wall time")
    args = parser.parse_args()

    from kernel_isa_curve import cpu_name, extra_build

    libs = {}
    for isa in args.isa.split(","):
        lib = kernels._load(isa)
        libs[f"{lib.specsample_gguf_isa().decode()} ({isa})"] = lib
    for extra in args.extra:
        label, source, isa = extra_build(extra)
        libs[f"{label} ({isa})"] = kernels._build(kernels._source(), isa, {"kernels_gguf.cpp": source})
    ns = [int(n) for n in args.ns.split(",")]
    clock = time.process_time if args.cpu_time else time.perf_counter
    threads = os.environ.get("OMP_NUM_THREADS", "all")
    print(f"{cpu_name()}; median of {args.repeats}; {'CPU' if args.cpu_time else 'wall'} time; OMP threads: {threads}; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    if args.products:
        product_costs(libs, args.repeats, clock)
    else:
        matmul_curve(libs, ns, args.repeats, clock)
    if args.target:
        target_curve(libs, ns, args.repeats, clock, args.context_length)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
