"""llama.cpp's CPU variants besides the one ggml picks for this CPU (SPECSAMPLE_LLAMACPP_VARIANT).

The build holds a ggml CPU backend per x86 feature level and loads the best one at run time, so
CI on an AVX-512 machine would never run the code an AVX2-only machine runs: its flash attention,
its repacked Q4_0 products, and so whether the batch-invariance patch holds there, on which greedy
speculation's token identity on that machine kind rests. Here the AVX2 variant (`haswell`), which
every machine of either kind can run, goes through the batch-invariance and greedy-identity tests
of test_llamacpp.py and test_llamacpp_slots.py, in a process of its own (a process loads one
CPU backend, once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specsample.models.llamacpp import VARIANT_VARIABLE

ROOT = Path(__file__).resolve().parent.parent
FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
HASWELL = {"avx2", "fma", "f16c", "bmi2"}  # what ggml's haswell variant needs (its ggml_backend_score)
# The tests that say a position's logits do not depend on its batch, and the one that the loaded
# backend is the variant asked for.
INVARIANCE = (
    "cpu_backend_matches or batch_invariant or batched_pass or alone_and_in_a_batch or "
    "token_identical or splits_the_cache or equals_alone"
)


def run(variant: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python args...` in the repository with SPECSAMPLE_LLAMACPP_VARIANT=variant."""
    env = {**os.environ, VARIANT_VARIABLE: variant}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not HASWELL <= FLAGS, reason="this CPU cannot run ggml's AVX2 variant")
def test_the_avx2_variant_keeps_a_position_the_same_alone_and_in_a_batch():
    result = run(
        "haswell", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
        "tests/test_llamacpp.py", "tests/test_llamacpp_slots.py", "-k", INVARIANCE,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "deselected" in summary, summary


def test_an_unknown_variant_is_a_one_line_error():
    result = run("no-such-cpu", "-m", "specsample.cli", "generate", "hi", "--backend", "llamacpp", "--max-new-tokens", "2", timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and VARIANT_VARIABLE in lines[0] and "haswell" in lines[0], result.stderr


@pytest.mark.skipif("amx_int8" in FLAGS, reason="this CPU runs every variant the build has")
def test_a_variant_this_cpu_cannot_run_is_a_one_line_error():
    result = run("sapphirerapids", "-m", "specsample.cli", "generate", "hi", "--backend", "llamacpp", "--max-new-tokens", "2", timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "lacks instructions" in lines[0], result.stderr
