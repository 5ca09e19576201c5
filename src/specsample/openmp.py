"""How OpenMP threads wait between parallel regions, chosen before torch loads libgomp.

It decides the speed of a small model, whose pass is hundreds of short parallel regions. Measured
on the bundled model, `--backend gguf`, plain decoding, 2 threads (Intel Xeon VM, 2026-11-25),
tokens/s on an idle machine / with one core busy / under a load average of 9-12:

- OMP_WAIT_POLICY=PASSIVE (sleep at once): 61 / 91 / 26-82; a sleeping thread takes long to wake on a VM;
- GOMP_SPINCOUNT=10000000 (spin, then sleep): 199 / 36 / 1.1-2.9; a thread spins at a barrier while
  the thread it waits for is off its core;
- libgomp's default (300,000 rounds): 211 / 9.6 / not measured.

No one setting is good on both kinds of machine, so the threads spin where the machine is idle when
the process starts and sleep otherwise. "Idle" is measured now, over `SAMPLE_SECONDS` of the
kernel's CPU counters, not by the load average, which lags by a minute: runs of specsample one
after another would each see the last one's load and sleep. This module imports nothing that
loads libgomp.

Spinning needs one more thing: one team of threads. libgomp keeps a team for every thread that has
started a parallel region (torch and the project's kernels share one libgomp), and while its teams
hold more threads than there are cores it spins 100 rounds at most, whatever GOMP_SPINCOUNT says, so
every pass runs as if the threads slept. A server loads its model on the main thread and decodes on
a worker thread: two teams, and plain decoding at 112 tokens/s where the main thread alone decodes at
299 (bundled model, AMD EPYC, 2026-11-25). `in_passing_thread` runs a load on a thread that ends
when it returns, taking its team with it, so the decoding thread's team is the only one.
"""

from __future__ import annotations

import numbers
import os
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

MAX_THREADS = 512  # llama.cpp's GGML_MAX_N_THREADS: past it, ggml writes beyond its thread arrays (a segfault)
IDLE_BUSY_PER_CORE = 0.5  # fewer busy cores than this per core counts as idle
SAMPLE_SECONDS = 0.05
SPIN = {"GOMP_SPINCOUNT": "10000000"}
SLEEP = {"OMP_WAIT_POLICY": "PASSIVE"}


def choose_wait_policy(environ: Mapping[str, str], busy_cores: float, cores: int) -> dict[str, str]:
    """The variables to set: none if the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (theirs wins);
    spinning with fewer than `IDLE_BUSY_PER_CORE` busy cores per core; sleeping otherwise."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return dict(SPIN if busy_cores < IDLE_BUSY_PER_CORE * cores else SLEEP)


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """How many cores were busy (not idle or waiting for I/O) over the next `seconds`, from /proc/stat;
    the 1-minute load average where there is no /proc/stat."""
    try:
        before = cpu_times()
        time.sleep(seconds)
        after = cpu_times()
    except OSError:
        return os.getloadavg()[0]
    total, idle = (a - b for a, b in zip(after, before))
    return (total - idle) / total * (os.cpu_count() or 1) if total else 0.0


def cpu_times() -> tuple[int, int]:
    """All CPUs' (total, idle + iowait) time so far, in clock ticks."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def check_threads(threads: int | None, name: str = "--threads") -> None:
    """Refuse a thread count below 1 or above MAX_THREADS (None: all cores) on every backend, before anything slow."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, numbers.Integral)):
        raise ValueError(f"{name} must be an integer, got {threads!r}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"{name} must be from 1 to {MAX_THREADS}, got {threads}")


def default_threads() -> int:
    """All the cores this process may run on, or fewer where OMP_NUM_THREADS asks for fewer (its first
    level), as it does of torch's and the kernels' teams: without it, OMP_NUM_THREADS=1 ran the project's
    passes on one thread and llama.cpp's on every core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    asked = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return min(int(asked), cores) if asked.isdigit() and int(asked) > 0 else cores


def use_threads(threads: int | None) -> None:
    """Run the process's parallel regions, torch's and the project's kernels' (one libgomp), on `threads`
    threads (None: OpenMP's default, every core; llama.cpp's are its target's `n_threads`). Before torch
    loads libgomp, through OMP_NUM_THREADS, which every thread's teams start from (a server decodes on a
    thread of its own); once it has, through torch.set_num_threads, which holds for the calling thread."""
    check_threads(threads)
    if threads is None:
        return
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)


def in_passing_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), run on a new thread that ends when it returns: the OpenMP team its parallel
    regions started ends with it, so the thread that then decodes keeps the process's only team."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specsample-load") as thread:
        return thread.submit(fn, *args, **kwargs).result()
