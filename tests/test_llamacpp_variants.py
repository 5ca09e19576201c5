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

from specsample.bench import llamacpp_baselines
from specsample.models.llamacpp import VARIANT_VARIABLE

pytestmark = pytest.mark.llamacpp  # skipped without llama-cpp-python (conftest.py)

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


def fake_tools(root: Path) -> Path:
    """A tools directory as scripts/build_llamacpp_tools.sh lays it out: tools, libraries, CPU variants."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("libllama.so", "libggml-base.so", "libggml-cpu-haswell.so", "libggml-cpu-zen4.so", "libggml-cpu-x64.so"):
        (bin_dir / name).write_bytes(b"\x7fELF")
    tool = bin_dir / llamacpp_baselines.LOOKUP_TOOL
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    return root


def test_the_tools_run_from_a_directory_with_only_the_variant_asked_for(tmp_path, monkeypatch):
    """ggml loads the best CPU variant beside the running executable (/proc/self/exe, which names a
    symbolic link's target): the tool is copied, the libraries linked, the other variants left out."""
    monkeypatch.setenv(llamacpp_baselines.TOOLS_ENV, str(fake_tools(tmp_path / "tools")))
    monkeypatch.delenv(VARIANT_VARIABLE, raising=False)
    original = llamacpp_baselines.tool_path(llamacpp_baselines.LOOKUP_TOOL)
    assert original.parent == tmp_path / "tools" / "bin"
    monkeypatch.setenv(VARIANT_VARIABLE, "haswell")
    tool = llamacpp_baselines.tool_path(llamacpp_baselines.LOOKUP_TOOL)
    assert tool.parent != original.parent and tool.is_file() and not tool.is_symlink() and os.access(tool, os.X_OK)
    assert sorted(p.name for p in tool.parent.glob("libggml-cpu-*.so")) == ["libggml-cpu-haswell.so"]
    assert (tool.parent / "libllama.so").resolve() == original.parent / "libllama.so"
    assert "CPU variant haswell" in llamacpp_baselines.variant_label()
    monkeypatch.setenv(VARIANT_VARIABLE, "no-such-cpu")
    with pytest.raises(llamacpp_baselines.Unavailable, match="no such CPU variant"):
        llamacpp_baselines.tool_path(llamacpp_baselines.LOOKUP_TOOL)


TOOL = llamacpp_baselines.tools_dir() / "bin" / "llama-simple"


@pytest.mark.skipif(not (TOOL.is_file() and HASWELL <= FLAGS), reason="llama.cpp's tools are not built here (scripts/build_llamacpp_tools.sh)")
def test_a_real_tool_loads_the_variant_asked_for(monkeypatch):
    from specsample.models.loading import bundled_gguf

    monkeypatch.setenv(VARIANT_VARIABLE, "haswell")
    tool = llamacpp_baselines.tool_path("llama-simple")
    result = subprocess.run([str(tool), "-m", str(bundled_gguf()), "-n", "2", "Hello"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"loaded CPU backend from {tool.parent / 'libggml-cpu-haswell.so'}" in result.stderr, result.stderr[-2000:]
