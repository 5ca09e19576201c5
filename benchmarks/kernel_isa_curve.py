"""f(n)/f(1) of the fast backend under several builds of its C++ kernels, interleaved in one run.

`specsample bench cost-curve` measures the build the process loads (one instruction
set per process, SPECSAMPLE_KERNEL_ISA). Comparing builds across processes on a
shared machine mixes in whatever else ran meanwhile; this script times every build
on one target in the same repetitions (`specsample.cost_curve.measure` interleaves them),
so their f(1) compare as well as their ratios. Builds are `kernels.cpp` for each
instruction set asked for, and optionally other sources (an older kernels.cpp):

    python benchmarks/kernel_isa_curve.py --isa native,avx2 --extra before=/tmp/before.cpp

On a machine other jobs load, two OpenMP threads wait for each other whenever one
is descheduled, and wall times swing tenfold; `--cpu-time` with
OMP_NUM_THREADS=1 times the process's CPU time on one thread instead, which
that load barely moves.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path
from unittest import mock

import specsample  # noqa: F401, I001  first: its OpenMP wait policy (specsample.openmp) must be set before torch loads libgomp

from torch import Tensor

from specsample import cost_curve
from specsample.bench import cost_curve as cc
from specsample.models import kernels, load_model
from specsample.models.llama import LlamaTarget

# An older source has no instruction-set query; the library loader expects one.
# What the passes attend over: the cost of attention depends on its length, not its words.
CONTEXT = "Speculative decoding drafts a few tokens cheaply and verifies them in one pass of the target. " * 8
ISA_QUERY = '\nextern "C" const char* specsample_isa() { return "%s"; }\n'


class WithKernels:
    """`target` with its kernel calls sent to `lib`: one target, and its weights, serves every build."""

    def __init__(self, target: LlamaTarget, lib: ctypes.CDLL) -> None:
        self.target, self.lib = target, lib

    def prefill(self, token_ids: Tensor) -> None:
        with mock.patch.object(kernels, "_library", lambda: self.lib):
            self.target.prefill(token_ids)

    def score(self, token_ids: Tensor) -> Tensor:
        with mock.patch.object(kernels, "_library", lambda: self.lib):
            return self.target.score(token_ids)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)


def extra_build(spec: str) -> tuple[str, str, str]:
    """An --extra option, LABEL=PATH[:ISA], as (label, the file's text, instruction set; default native)."""
    label, rest = spec.split("=", 1)
    path, _, isa = rest.partition(":")
    return label, Path(path).read_text(), isa or "native"


def cpu_name() -> str:
    """The CPU model and its widest vector instruction set, as /proc/cpuinfo names them."""
    text = Path("/proc/cpuinfo").read_text()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
    flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
    return f"{name}, {'AVX-512' if 'avx512f' in flags else 'AVX2 only' if 'avx2' in flags else 'no AVX2'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="native,avx2", help="builds of kernels.cpp: " + ", ".join(kernels.ISA_FLAGS))
    parser.add_argument("--extra", action="append", default=[], metavar="LABEL=PATH[:ISA]",
                        help="another C++ source with the same entry points (repeatable)")
    parser.add_argument("--context-length", type=int, default=200)
    parser.add_argument("--ns", default="1,2,4,8,12,16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cpu-time", action="store_true", help="time CPU seconds of this process, not wall time")
    args = parser.parse_args()

    libs: dict[str, ctypes.CDLL] = {}
    for isa in args.isa.split(","):
        lib = kernels._load(isa)
        libs[f"{lib.specsample_isa().decode()} ({isa})"] = lib
    for extra in args.extra:
        label, source, isa = extra_build(extra)
        if "specsample_isa" not in source:
            source += ISA_QUERY % label
        libs[f"{label} ({isa})"] = kernels._build(source, isa)

    loaded = load_model(None)
    with mock.patch.object(kernels, "_library", lambda: next(iter(libs.values()))):
        target = LlamaTarget.from_hf(loaded.model)
    ns = [int(n) for n in args.ns.split(",")]
    ids = cc.context_tokens(loaded.tokenizer, CONTEXT, args.context_length + max(ns))
    targets = {label: WithKernels(target, lib) for label, lib in libs.items()}
    clock = time.process_time if args.cpu_time else time.perf_counter
    with mock.patch.object(cost_curve, "perf_counter", clock):
        curves = cost_curve.measure(targets, ids[: args.context_length], ids[args.context_length :], ns, args.repeats)
    threads = os.environ.get("OMP_NUM_THREADS", "all")
    print(f"{cpu_name()}; {loaded.name}; context {args.context_length}; median of {args.repeats}; "
          f"{'CPU' if args.cpu_time else 'wall'} time; OMP threads: {threads}")
    print("| build | f(1) ms | " + " | ".join(f"f({n})/f(1)" for n in ns[1:]) + " |")
    print("|---|---|" + "---|" * (len(ns) - 1))
    for curve in curves:
        print(f"| {curve.backend} | {curve.ms[0]:.1f} | " + " | ".join(f"{r:.2f}" for r in curve.ratios[1:]) + " |")


if __name__ == "__main__":
    main()
