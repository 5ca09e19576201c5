"""Two CPU kernels for decoding a few tokens: a small-row matrix multiply and attention.

Decoding multiplies 1 to 16 activation rows by weight matrices far larger than
the caches, so its speed is the speed of streaming the weights from memory.
MKL's sgemm is tuned for large matrices: on a small CPU it reads the weights
at about half the memory bandwidth for one row and gets slower with every row
added, so scoring 8 tokens costs 2 to 3 times scoring one. `matmul` reads each
weight once, in the order it lies in memory, and keeps up to 12 rows of
results in vector registers, so 12 rows cost about what one does. Weights are
packed in panels of 32 output columns, [blocks, in, 32]: one panel is a
contiguous stream, and the 32 columns are two AVX-512 registers.

Weights are float32 (`pack`) or int8 with one float scale per output column
(`pack_int8`): the same code, a template over the weight type, converts int8
weights to float in registers, accumulates in float32 and scales the columns
at the end, so an int8 matrix streams a quarter of the bytes.

`layer` runs a whole decoder layer in one call: the four products, and what
takes about 40 small torch ops (norms, rotary embedding, cache writes,
grouped-query attention, SwiGLU), whose dispatch overhead, not arithmetic, is
what they cost at 1 to 16 tokens.

The C++ source is compiled on first use with the system compiler (`g++`/`c++`,
-O3 -march=native, OpenMP: the libgomp torch already loaded) into the user's
cache and loaded with ctypes; without a compiler, or with
SPECSAMPLE_NO_KERNELS=1, `available()` is False and callers use torch ops.
Sums run in another order than MKL's, so results differ by float32 rounding.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32  # output columns per panel
MAX_HEAD_DIM = 1024  # rotary embedding works on a stack copy of one head

SOURCE = r"""
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int8_t v16b __attribute__((vector_size(16), aligned(1)));
typedef int v16i __attribute__((vector_size(64)));
enum { NB = 32, MAX_ROWS = 12 };

// 16 consecutive weights as floats: float32 as stored, int8 converted in registers. GCC 12
// lowers the conversion of an int8 vector loaded from memory byte by byte, so AVX-512 gets
// the two instructions it takes (vpmovsxbd, vcvtdq2ps) as intrinsics.
static inline v16 load16(const float* w) { return *(const v16*)w; }
static inline v16 load16(const int8_t* w) {
#ifdef __AVX512F__
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
#else
  return __builtin_convertvector(__builtin_convertvector(*(const v16b*)w, v16i), v16);
#endif
}

// y[0:MR, panel] (+)= (x[0:MR, :] @ w_panel[K, NB]) * scale (+ bias): accumulators stay in registers.
// scale (one per column) is null for float32 weights.
template <typename W, int MR>
static void panel(const float* __restrict x, long ldx, const W* __restrict w, const float* __restrict scale,
                  long K, float* __restrict y, long ldy, const float* __restrict bias, int ncols, int add) {
  v16 a0[MR], a1[MR];
  for (int m = 0; m < MR; m++) { a0[m] = (v16){}; a1[m] = (v16){}; }
  for (long k = 0; k < K; k++) {
    v16 w0 = load16(w + k * NB);
    v16 w1 = load16(w + k * NB + 16);
    for (int m = 0; m < MR; m++) { float s = x[m * ldx + k]; a0[m] += s * w0; a1[m] += s * w1; }
  }
  for (int m = 0; m < MR; m++) {
    float out[NB];
    *(v16u*)out = a0[m];
    *(v16u*)(out + 16) = a1[m];
    float* row = y + m * ldy;
    if (scale) for (int j = 0; j < ncols; j++) out[j] *= scale[j];
    if (bias) for (int j = 0; j < ncols; j++) out[j] += bias[j];
    if (add) for (int j = 0; j < ncols; j++) row[j] += out[j];
    else memcpy(row, out, ncols * sizeof(float));
  }
}

template <typename W>
using panel_fn = void (*)(const float*, long, const W*, const float*, long, float*, long, const float*, int, int);
template <typename W>
static const panel_fn<W> PANELS[MAX_ROWS + 1] = {
    0, panel<W, 1>, panel<W, 2>, panel<W, 3>, panel<W, 4>, panel<W, 5>, panel<W, 6>,
    panel<W, 7>, panel<W, 8>, panel<W, 9>, panel<W, 10>, panel<W, 11>, panel<W, 12>};

template <typename W>
static void gemm(const float* x, long M, long K, long ldx, const W* w, const float* scale, long N,
                 float* y, long ldy, const float* bias, int add) {
  long blocks = (N + NB - 1) / NB;
  long chunks = (M + MAX_ROWS - 1) / MAX_ROWS;
  // Threads pay off only once the weights outgrow the cache of one core.
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (long b = 0; b < blocks; b++) {
    int ncols = (int)(N - b * NB < NB ? N - b * NB : NB);
    for (long c = 0; c < chunks; c++) {
      long m0 = c * M / chunks, m1 = (c + 1) * M / chunks;
      PANELS<W>[m1 - m0](x + m0 * ldx, ldx, w + b * K * NB, scale ? scale + b * NB : 0, K,
                         y + m0 * ldy + b * NB, ldy, bias ? bias + b * NB : 0, ncols, add);
    }
  }
}

// y[M, N] (+)= x[M, K] @ w (* scale) (+ bias); w packed [ceil(N / NB), K, NB], float32 with scale
// null, or int8 with one scale per column; row strides ldx, ldy.
extern "C" void specsample_gemm(const float* x, long M, long K, long ldx, const void* w, const float* scale,
                                long N, float* y, long ldy, const float* bias, int add) {
  if (scale) gemm(x, M, K, ldx, (const int8_t*)w, scale, N, y, ldy, bias, add);
  else gemm(x, M, K, ldx, (const float*)w, scale, N, y, ldy, bias, add);
}

// exp(x) of 16 lanes, x <= 0: 2^k * p(r) with x = k ln2 + r, |r| <= ln2 / 2, p of degree 7
// (relative error below float32 rounding).
static inline v16 exp16(v16 x) {
  x = x < -87.0f ? (v16){} - 87.0f : x;
  v16 k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  v16 r = x - k * 0.693145752f - k * 1.42860677e-6f;
  v16 p = 1.0f / 5040 + r * (1.0f / 40320);
  p = 1.0f / 720 + r * p;
  p = 1.0f / 120 + r * p;
  p = 1.0f / 24 + r * p;
  p = 1.0f / 6 + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  v16i bits = (__builtin_convertvector(k, v16i) + 127) << 23;
  return p * (v16)bits;
}

// o[0:d] = sum over i < len of p[i] * scale * v[i, 0:d], accumulators in registers for d = 16 NV.
template <int NV>
static void weighted_sum_v(const float* p, float scale, const float* v, long len, float* o) {
  v16 acc[NV] = {};
  for (long i = 0; i < len; i++)
    for (int u = 0; u < NV; u++) acc[u] += (p[i] * scale) * *(const v16u*)(v + i * NV * 16 + u * 16);
  for (int u = 0; u < NV; u++) *(v16u*)(o + u * 16) = acc[u];
}

static void weighted_sum(const float* p, float scale, const float* v, long len, long d, float* o) {
  if (d == 64) return weighted_sum_v<4>(p, scale, v, len, o);
  if (d == 128) return weighted_sum_v<8>(p, scale, v, len, o);
  for (long j = 0; j < d; j++) o[j] = 0;
  for (long i = 0; i < len; i++)
    for (long j = 0; j < d; j++) o[j] += (p[i] * scale) * v[i * d + j];
}

// One layer's attention for n new tokens at positions start..start+n-1.
// qkv [n, (heads + 2 kv_heads) d]: q and k are rotated in place (x cos + roll(x, d/2) signed_sin,
// cos and sin [n, d]); keys [kv_heads, d, cap] (transposed: 16 positions are one vector) and
// values [kv_heads, cap, d] get positions start.. written and 0..start+n-1 read, cap a multiple
// of 16 and not of 1024 (rows of keys a power of two apart would share cache sets); out [n, heads d]. Query head h reads KV head h / (heads / kv_heads); token t sees
// positions 0..start+t.
static void attention(float* qkv, long n, long heads, long kv_heads, long d, const float* cos,
                      const float* sin, float* keys, float* values, long cap, long start, float* out) {
  long width = (heads + 2 * kv_heads) * d, groups = heads / kv_heads, half = d / 2;
  for (long t = 0; t < n; t++) {
    float* row = qkv + t * width;
    const float *c = cos + t * d, *s = sin + t * d;
    for (long h = 0; h < heads + kv_heads; h++) {
      float x[1024], *y = row + h * d;
      memcpy(x, y, d * sizeof(float));
      for (long j = 0; j < half; j++) y[j] = x[j] * c[j] + x[j + half] * s[j];
      for (long j = half; j < d; j++) y[j] = x[j] * c[j] + x[j - half] * s[j];
    }
    for (long g = 0; g < kv_heads; g++) {
      for (long j = 0; j < d; j++) keys[(g * d + j) * cap + start + t] = row[(heads + g) * d + j];
      memcpy(values + (g * cap + start + t) * d, row + (heads + kv_heads + g) * d, d * sizeof(float));
    }
  }
  long end = start + n;
  float scale = 1.0f / __builtin_sqrtf((float)d);
#pragma omp parallel if (n * heads * end * d >= 500000)
  {
    float* scores = new float[(end + 15) / 16 * 16];
#pragma omp for schedule(static)
    for (long job = 0; job < n * heads; job++) {
      long t = job / heads, h = job % heads, g = h / groups, len = start + t + 1, blocks = (len + 15) / 16;
      const float* q = qkv + t * width + h * d;
      const float* kt = keys + g * d * cap;
      v16 top = (v16){} - __builtin_inff();
      for (long b = 0; b < blocks; b++) {
        v16 acc = {};
        for (long j = 0; j < d; j++) acc += q[j] * *(const v16u*)(kt + j * cap + b * 16);
        acc *= scale;
        if (b == blocks - 1)  // lanes past len are not positions of this token
          for (int l = (int)(len - b * 16); l < 16; l++) acc[l] = -__builtin_inff();
        *(v16u*)(scores + b * 16) = acc;
        top = acc > top ? acc : top;
      }
      float m = top[0];
      for (int l = 1; l < 16; l++) m = top[l] > m ? top[l] : m;
      v16 sum = {};
      for (long b = 0; b < blocks; b++) {
        v16 e = exp16(*(v16u*)(scores + b * 16) - m);
        *(v16u*)(scores + b * 16) = e;
        sum += e;
      }
      float total = 0;
      for (int l = 0; l < 16; l++) total += sum[l];
      float inv = 1.0f / total;
      weighted_sum(scores, inv, values + g * cap * d, len, d, out + t * heads * d + h * d);
    }
    delete[] scores;
  }
}

static void rms_norm(const float* x, const float* w, long M, long n, float eps, float* y) {
  for (long m = 0; m < M; m++) {
    const float* row = x + m * n;
    float acc[16] = {0}, sum = 0;
    long j = 0;
    for (; j + 16 <= n; j += 16)
      for (int l = 0; l < 16; l++) acc[l] += row[j + l] * row[j + l];
    for (; j < n; j++) sum += row[j] * row[j];
    for (int l = 0; l < 16; l++) sum += acc[l];
    float r = 1.0f / __builtin_sqrtf(sum / n + eps);
    for (j = 0; j < n; j++) y[m * n + j] = w[j] * (row[j] * r);
  }
}

// Weights and cache of one decoder layer; matrices packed as by `pack` (scales null) or by
// `pack_int8` (each with its column scales).
struct Layer {
  long hidden, heads, kv_heads, d, inter, cap;
  float eps;
  const float *attn_norm, *mlp_norm;
  const void* wqkv;
  const float* bqkv;
  const void* wo;
  const float* bo;
  const void *wgu, *wdown;
  const float *sqkv, *so, *sgu, *sdown, *cos, *sin;
  float *keys, *values;
};

// One decoder layer over x [M, hidden] (the residual stream, updated in place) at positions
// start..start+M-1. scratch holds M (hidden + (heads + 2 kv_heads) d + heads d + 3 inter) floats.
extern "C" void specsample_layer(const Layer* L, float* x, long M, long start, float* scratch) {
  long H = L->hidden, qkv_width = (L->heads + 2 * L->kv_heads) * L->d, att_width = L->heads * L->d;
  long I = L->inter;
  float *h = scratch, *qkv = h + M * H, *att = qkv + M * qkv_width, *gu = att + M * att_width;
  float* act = gu + M * 2 * I;
  rms_norm(x, L->attn_norm, M, H, L->eps, h);
  specsample_gemm(h, M, H, H, L->wqkv, L->sqkv, qkv_width, qkv, qkv_width, L->bqkv, 0);
  attention(qkv, M, L->heads, L->kv_heads, L->d, L->cos + start * L->d, L->sin + start * L->d,
            L->keys, L->values, L->cap, start, att);
  specsample_gemm(att, M, att_width, att_width, L->wo, L->so, H, x, H, L->bo, 1);
  rms_norm(x, L->mlp_norm, M, H, L->eps, h);
  specsample_gemm(h, M, H, H, L->wgu, L->sgu, 2 * I, gu, 2 * I, 0, 0);
  for (long m = 0; m < M; m++)
    for (long j = 0; j < I; j++) {
      float g = gu[m * 2 * I + j];
      act[m * I + j] = g / (1.0f + __builtin_expf(-g)) * gu[m * 2 * I + I + j];
    }
  specsample_gemm(act, M, I, I, L->wdown, L->sdown, H, x, H, 0, 1);
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
        source = Path(tmp) / "kernels.cpp"
        source.write_text(SOURCE)
        library = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(source), "-o", str(library)], check=True, capture_output=True)
        os.replace(library, target)


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where that is impossible or disabled."""
    if os.environ.get("SPECSAMPLE_NO_KERNELS") or platform.system() != "Linux":
        return None
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, compiler, _cpu_id()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{key}.so"
    try:
        if not target.is_file():
            _compile(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or str(error).encode()
        warnings.warn(f"specsample: C++ kernels unavailable, using torch ops: {detail.decode()[-500:]}", stacklevel=2)
        return None
    fn = lib.specsample_gemm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    fn = lib.specsample_layer
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    fn.restype = None
    return lib


def available() -> bool:
    """True if the kernels are built (or buildable) and loaded."""
    return _library() is not None


def _panels(weight: Tensor) -> Tensor:
    """A weight [out, in] as panels [ceil(out / 32), in, 32] of its dtype, zero-padded."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK)
    padded = torch.zeros(blocks * BLOCK, in_features, dtype=weight.dtype)
    padded[:out_features] = weight.detach()
    return padded.view(blocks, BLOCK, in_features).transpose(1, 2).contiguous()  # [blocks, in, 32]


def pack(weight: Tensor) -> Tensor:
    """An nn.Linear weight [out, in] as float32 panels [ceil(out / 32), in, 32], zero-padded."""
    return _panels(weight.detach().float())


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 of a weight [out, in]: (int8 [out, in], float32 scales [out]),
    weight ~ int8 * scale with scale = absmax / 127, so each weight is off by at most scale / 2."""
    weight = weight.detach().float()
    scales = weight.abs().amax(1).clamp_min(1e-12) / 127  # [out]
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def pack_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """An nn.Linear weight [out, in] quantized as by `quantize_int8`: int8 panels [ceil(out / 32), in, 32]
    (a quarter of the float32 bytes to stream) and float32 scales [out]."""
    quantized, scales = quantize_int8(weight)
    return _panels(quantized), scales


def unpack(packed: Tensor, out_features: int) -> Tensor:
    """The weight [out, in] that `pack` or `pack_int8` (before scaling) turned into `packed`."""
    blocks, in_features, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, in_features)[:out_features]


def unpack_rows(packed: Tensor, rows: Tensor, scales: Tensor | None = None) -> Tensor:
    """Rows `rows` [n] of the original [out, in] weight, float32 (int8 times its scales):
    [n, in] (an embedding lookup in a tied LM head)."""
    picked = packed[rows // BLOCK, :, rows % BLOCK]  # [n, in]
    return picked if scales is None else picked.float() * scales[rows, None]


def matmul(
    x: Tensor,
    packed: Tensor,
    out_features: int,
    bias: Tensor | None = None,
    out: Tensor | None = None,
    scales: Tensor | None = None,
) -> Tensor:
    """x [n, in] @ weight.T (+ bias) -> [n, out]; with `out` given, adds the product into it.

    `packed` is float32 from `pack`, or int8 from `pack_int8` with its `scales` [out]:
    the product is then x @ (int8 * scales).T, the int8 weights converted to float in registers.
    """
    assert x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == packed.shape[1]
    assert packed.dtype == (torch.float32 if scales is None else torch.int8)
    assert scales is None or (scales.dtype == torch.float32 and scales.shape == (out_features,))
    n = x.shape[0]
    add = out is not None
    if out is None:
        out = torch.empty(n, out_features, dtype=torch.float32)
    assert out.stride(1) == 1 and out.shape == (n, out_features)
    _library().specsample_gemm(
        x.data_ptr(), n, x.shape[1], x.stride(0), packed.data_ptr(), None if scales is None else scales.data_ptr(),
        out_features, out.data_ptr(), out.stride(0), None if bias is None else bias.data_ptr(), int(add),
    )
    return out


def capacity(length: int) -> int:
    """Cache capacity for `length` positions: a multiple of 16 plus 16, so that rows of the
    transposed keys are never a power of two apart (they would fall into the same cache sets)."""
    return -(-length // 16) * 16 + 16


class LayerArgs(ctypes.Structure):
    """The C `Layer`: pointers into tensors that the caller keeps alive. The scales sqkv, so,
    sgu and sdown belong to int8 matrices (`pack_int8`) and are null for float32 ones (`pack`)."""

    _fields_ = [(name, ctypes.c_long) for name in ("hidden", "heads", "kv_heads", "d", "inter", "cap")] + [
        ("eps", ctypes.c_float)
    ] + [(name, ctypes.c_void_p) for name in (
        "attn_norm", "mlp_norm", "wqkv", "bqkv", "wo", "bo", "wgu", "wdown", "sqkv", "so", "sgu", "sdown",
        "cos", "sin", "keys", "values",
    )]


def scratch_size(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Floats of scratch `layer` needs per token."""
    return hidden + (2 * heads + 2 * kv_heads) * head_dim + 3 * intermediate


def layer(args: LayerArgs, x: Tensor, start: int, scratch: Tensor) -> None:
    """One decoder layer over the residual stream x [n, hidden] (updated in place) at positions start..

    In one call: RMSNorm, the fused QKV product, rotary embedding, K/V written into the
    cache, causal grouped-query attention, the output projection added into x, RMSNorm,
    the fused gate/up product, SiLU(gate) * up and the down projection added into x.
    """
    _library().specsample_layer(ctypes.addressof(args), x.data_ptr(), x.shape[0], start, scratch.data_ptr())
