"""A matrix multiply for a handful of rows against packed float32 weights.

Decoding multiplies 1 to 16 activation rows by weight matrices far larger than
the caches, so its speed is the speed of streaming the weights from memory.
MKL's sgemm is tuned for large matrices: on a small CPU it reads the weights
at half the memory bandwidth for one row and gets slower with every row added,
so scoring 8 tokens costs 2 to 3 times scoring one. This kernel reads each
weight once, in the order it lies in memory, and keeps up to 12 rows of
results in vector registers, so 12 rows cost about what one does.

Weights are packed in panels of 32 output columns, [blocks, in, 32]: one panel
is a contiguous stream, and the 32 columns are two AVX-512 registers. The C++
source is compiled on first use with the system compiler (`g++`/`c++`,
-march=native, OpenMP) into the user's cache and loaded with ctypes; without a
compiler, or with SPECSAMPLE_NO_KERNELS=1, `available()` is False and callers
fall back to `torch.mm`. Sums run in a different order than MKL's, so results
differ from it by float32 rounding only.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32  # output columns per panel

SOURCE = r"""
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
enum { NB = 32, MAX_ROWS = 12 };

// y[0:MR, panel] (+)= x[0:MR, :] @ w_panel[K, NB] (+ bias): accumulators stay in registers.
template <int MR>
static void panel(const float* __restrict x, long ldx, const float* __restrict w, long K,
                  float* __restrict y, long ldy, const float* __restrict bias, int ncols, int add) {
  v16 a0[MR], a1[MR];
  for (int m = 0; m < MR; m++) { a0[m] = (v16){}; a1[m] = (v16){}; }
  for (long k = 0; k < K; k++) {
    v16 w0 = *(const v16*)(w + k * NB);
    v16 w1 = *(const v16*)(w + k * NB + 16);
    for (int m = 0; m < MR; m++) { float s = x[m * ldx + k]; a0[m] += s * w0; a1[m] += s * w1; }
  }
  for (int m = 0; m < MR; m++) {
    float out[NB];
    *(v16u*)out = a0[m];
    *(v16u*)(out + 16) = a1[m];
    float* row = y + m * ldy;
    if (bias) for (int j = 0; j < ncols; j++) out[j] += bias[j];
    if (add) for (int j = 0; j < ncols; j++) row[j] += out[j];
    else memcpy(row, out, ncols * sizeof(float));
  }
}

typedef void (*panel_fn)(const float*, long, const float*, long, float*, long, const float*, int, int);
static const panel_fn PANELS[MAX_ROWS + 1] = {0, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>, panel<6>,
                                              panel<7>, panel<8>, panel<9>, panel<10>, panel<11>, panel<12>};

// y[M, N] (+)= x[M, K] @ w (+ bias); w packed [ceil(N / NB), K, NB]; row strides ldx, ldy.
extern "C" void specsample_gemm(const float* x, long M, long K, long ldx, const float* w, long N,
                                float* y, long ldy, const float* bias, int add) {
  long blocks = (N + NB - 1) / NB;
  long chunks = (M + MAX_ROWS - 1) / MAX_ROWS;
  // Threads pay off only once the weights outgrow the cache of one core.
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (long b = 0; b < blocks; b++) {
    int ncols = (int)(N - b * NB < NB ? N - b * NB : NB);
    for (long c = 0; c < chunks; c++) {
      long m0 = c * M / chunks, m1 = (c + 1) * M / chunks;
      PANELS[m1 - m0](x + m0 * ldx, ldx, w + b * K * NB, K, y + m0 * ldy + b * NB, ldy,
                      bias ? bias + b * NB : 0, ncols, add);
    }
  }
}
"""
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cache_dir() -> Path:
    from specsample.models.loading import cache_root

    return cache_root() / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compile(compiler: str, target: Path) -> None:
    """Build the shared library into `target`, atomically (concurrent builds are harmless)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "gemm.cpp"
        source.write_text(SOURCE)
        library = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(source), "-o", str(library)], check=True, capture_output=True)
        os.replace(library, target)


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None where that is impossible or disabled."""
    if os.environ.get("SPECSAMPLE_NO_KERNELS") or platform.system() != "Linux":
        return None
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, compiler, _cpu_id()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemm-{key}.so"
    try:
        if not target.is_file():
            _compile(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError):
        return None
    fn = lib.specsample_gemm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                   ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return lib


def available() -> bool:
    """True if the kernel is built (or buildable) and loaded."""
    return _library() is not None


def pack(weight: Tensor) -> Tensor:
    """An nn.Linear weight [out, in] as float32 panels [ceil(out / 32), in, 32], zero-padded."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK)
    padded = torch.zeros(blocks * BLOCK, in_features, dtype=torch.float32)
    padded[:out_features] = weight.detach()
    return padded.view(blocks, BLOCK, in_features).transpose(1, 2).contiguous()  # [blocks, in, 32]


def unpack_rows(packed: Tensor, rows: Tensor) -> Tensor:
    """Rows `rows` [n] of the original [out, in] weight: [n, in] (an embedding lookup in a tied LM head)."""
    return packed[rows // BLOCK, :, rows % BLOCK]


def matmul(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """x [n, in] @ weight.T (+ bias) -> [n, out]; with `out` given, adds the product into it."""
    assert x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == packed.shape[1]
    n = x.shape[0]
    add = out is not None
    if out is None:
        out = torch.empty(n, out_features, dtype=torch.float32)
    assert out.stride(1) == 1 and out.shape == (n, out_features)
    _library().specsample_gemm(
        x.data_ptr(), n, x.shape[1], x.stride(0), packed.data_ptr(), out_features,
        out.data_ptr(), out.stride(0), None if bias is None else bias.data_ptr(), int(add),
    )
    return out
