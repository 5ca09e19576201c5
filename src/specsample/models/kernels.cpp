// Small-row matrix multiply and one decoder layer for decoding a few tokens on the CPU; loaded by
// kernels.py (whose docstring says why these exist), compiled there with -O3 -march=native -fopenmp.
//
// The register blocking follows the instruction set the compiler targets, read from its predefined
// macros: AVX-512 (32 registers of 16 floats), AVX2 with FMA (16 registers of 8 floats), or
// portable 4-float vectors (SSE, NEON) for anything else. A vector type wider than the hardware's
// is split by the compiler into halves that all need registers: on AVX2, 512-bit accumulators
// for 12 rows would need 48 of its 16 registers and spill on every multiply-add.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include <string.h>

#include <utility>
#include <vector>

// VL: floats per vector register; MAX_ROWS: rows of one register block; vectors(MR): the vectors
// of one row in a register block of MR rows, so a block covers vectors(MR) VL columns.
#if defined(__AVX512F__)
// A row's 32 panel columns are two registers: 12 rows are 24 accumulators of the 32 registers.
#define SPECSAMPLE_ISA "avx512"
enum { VL = 16, MAX_ROWS = 12 };
static constexpr int vectors(int) { return 2; }
#else
// 16 registers (AVX2: 8 floats; SSE: 4; NEON has 32): up to 6 rows of 2 vectors, 12 accumulators,
// 2 weight vectors and a broadcast; 1 or 2 rows take 4 vectors (AVX2: the whole panel).
#if defined(__AVX2__) && defined(__FMA__)
#define SPECSAMPLE_ISA "avx2"
enum { VL = 8, MAX_ROWS = 6 };
#else
#define SPECSAMPLE_ISA "portable"
enum { VL = 4, MAX_ROWS = 6 };
#endif
static constexpr int vectors(int rows) { return rows <= 2 ? 4 : 2; }
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VL * 4)));
typedef int8_t vb __attribute__((vector_size(VL), aligned(1)));
// NB: output columns per packed panel (kernels.BLOCK); KC: the panel rows (inputs) a register
// block runs over before the next block of the same rows, so that every block but the first reads
// them from L1 (4 KiB of int8, 16 KiB of float32 weights); PF_L1, PF_L2: how far ahead in the panel
// the first block prefetches into L1 and into L2, in bytes (a panel is contiguous, and the next
// panel follows it). The hardware prefetchers alone fall behind: they miss the lines of the second
// half of a float32 panel, which the first half's block skips, and even on the contiguous stream of
// AVX-512, 8 rows took 1.5 (float32) to 2.4 (int8) times as long without (docs/kernels-avx2.md).
enum { NB = 32, KC = 128, PF_L1 = 2048, PF_L2 = 8192 };

extern "C" const char* specsample_isa() { return SPECSAMPLE_ISA; }

// VL consecutive weights as floats: float32 as stored, int8 converted in registers. GCC 12 lowers
// the conversion of an int8 vector loaded from memory byte by byte, so AVX-512 and AVX2 get the
// two instructions it takes (vpmovsxbd, vcvtdq2ps) as intrinsics.
static inline vf load(const float* w) { return *(const vfu*)w; }
static inline vf load(const int8_t* w) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
#elif defined(__AVX2__) && defined(__FMA__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
#else
  return __builtin_convertvector(__builtin_convertvector(*(const vb*)w, vi), vf);
#endif
}
// Float16 keys and values where the compiler has the type (GCC 12 on x86, any aarch64 compiler): a
// library built without it keeps float32 caches only (`specsample_half_caches`).
#if defined(__FLT16_MAX__)
#define SPECSAMPLE_HALF 1
// VL consecutive float16 keys or values as floats (exact: every float16 is a float).
static inline vf load(const _Float16* w) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
#else
  vf r;
  for (int l = 0; l < VL; l++) r[l] = (float)w[l];
  return r;
#endif
}
#else
#define SPECSAMPLE_HALF 0
#endif
extern "C" int specsample_half_caches() { return SPECSAMPLE_HALF; }

// y[0:MR, panel] (+)= (x[0:MR, :] @ w_panel[K, NB]) * scale (+ bias), scale (one per column) null
// for float32 weights. Each register block of SUB columns keeps MR x NV accumulators in registers
// over KC inputs (all K where one block is the panel), parked in `acc` between input chunks; the
// first block prefetches the panel ahead. Each output is one chain of multiply-adds over
// k = 0..K-1 in order, so a row's result does not depend on MR or on the other rows.
template <typename W, int MR>
static void panel(const float* __restrict x, long ldx, const W* __restrict w, const float* __restrict scale,
                  long K, float* __restrict y, long ldy, const float* __restrict bias, int ncols, int add) {
  constexpr int NV = vectors(MR), SUB = NV * VL, SUBS = NB / SUB;
  static_assert(NB % SUB == 0, "a panel is a whole number of register blocks");
  float acc[MR][NB];
  const long chunk = SUBS == 1 ? K : KC;
  for (long k0 = 0; k0 < K; k0 += chunk) {
    long k1 = k0 + chunk < K ? k0 + chunk : K;
    for (int s = 0; s < SUBS; s++) {
      vf a[MR][NV];
      for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) a[m][v] = k0 ? *(const vfu*)&acc[m][s * SUB + v * VL] : (vf){};
      const W* ws = w + s * SUB;
      for (long k = k0; k < k1; k++) {
        if (s == 0)
          for (int l = 0; l < (int)(NB * sizeof(W)); l += 64) {
            __builtin_prefetch((const char*)(w + k * NB) + PF_L1 + l);
            __builtin_prefetch((const char*)(w + k * NB) + PF_L2 + l, 0, 1);
          }
        vf wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = load(ws + k * NB + v * VL);
        for (int m = 0; m < MR; m++) {
          float xm = x[m * ldx + k];
          for (int v = 0; v < NV; v++) a[m][v] += xm * wv[v];
        }
      }
      for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) *(vfu*)&acc[m][s * SUB + v * VL] = a[m][v];
    }
  }
  for (int m = 0; m < MR; m++) {
    float* out = acc[m];
    float* row = y + m * ldy;
    if (scale) for (int j = 0; j < ncols; j++) out[j] *= scale[j];
    if (bias) for (int j = 0; j < ncols; j++) out[j] += bias[j];
    if (add) for (int j = 0; j < ncols; j++) row[j] += out[j];
    else memcpy(row, out, ncols * sizeof(float));
  }
}

template <typename W>
using panel_fn = void (*)(const float*, long, const W*, const float*, long, float*, long, const float*, int, int);

// panel<W, 1> .. panel<W, MAX_ROWS>, indexed by the row count less one.
template <typename W, int... I>
static const panel_fn<W>* panels(std::integer_sequence<int, I...>) {
  static const panel_fn<W> table[] = {panel<W, I + 1>...};
  return table;
}

template <typename W>
static void gemm(const float* x, long M, long K, long ldx, const W* w, const float* scale, long N,
                 float* y, long ldy, const float* bias, int add) {
  const panel_fn<W>* by_rows = panels<W>(std::make_integer_sequence<int, MAX_ROWS>{});
  long blocks = (N + NB - 1) / NB;
  long chunks = (M + MAX_ROWS - 1) / MAX_ROWS;
  // Threads pay off only once the weights outgrow the cache of one core.
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (long b = 0; b < blocks; b++) {
    int ncols = (int)(N - b * NB < NB ? N - b * NB : NB);
    for (long c = 0; c < chunks; c++) {
      long m0 = c * M / chunks, m1 = (c + 1) * M / chunks;
      by_rows[m1 - m0 - 1](x + m0 * ldx, ldx, w + b * K * NB, scale ? scale + b * NB : 0, K,
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

// exp(x) of each lane, x <= 0: 2^k * p(r) with x = k ln2 + r, |r| <= ln2 / 2, p of degree 7
// (relative error below float32 rounding).
static inline vf exp_nonpositive(vf x) {
  x = x < -87.0f ? (vf){} - 87.0f : x;
  vf k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = x - k * 0.693145752f - k * 1.42860677e-6f;
  vf p = 1.0f / 5040 + r * (1.0f / 40320);
  p = 1.0f / 720 + r * p;
  p = 1.0f / 120 + r * p;
  p = 1.0f / 24 + r * p;
  p = 1.0f / 6 + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
  return p * (vf)bits;
}

// log(x) for x > 0 (normal, finite), VL lanes at a time: Cephes' logf (x = m 2^e, m in [sqrt(1/2),
// sqrt(2)), a degree-9 polynomial in m - 1), within about 1 ulp.
static inline vf log_positive(vf x) {
  vi bits = (vi)x;
  vi e = ((bits >> 23) & 0xff) - 126;
  vf m = (vf)((bits & 0x007fffff) | 0x3f000000);  // in [0.5, 1)
  vi small = m < 0.70710678f;  // -1 where m is below sqrt(1/2): use 2m and e - 1
  e += small;
  m = m + (vf)((vi)m & small) - 1.0f;
  vf z = m * m;
  vf y = (vf){} + 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  vf ef = __builtin_convertvector(e, vf);
  y = y * m * z + ef * -2.12194440e-4f - 0.5f * z;
  return m + y + ef * 0.693359375f;
}

typedef uint64_t vu64 __attribute__((vector_size(VL * 8)));

// SplitMix64's output function: a bijection of 64-bit integers whose outputs over consecutive inputs pass
// BigCrush.
template <typename T>
static inline T mix64(T z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Standard Gumbel noise out[j] = -log(-log(u_j)), j < vocab, of output `position` of a request with
// `seed`: u_j = (top 23 bits of mix64(key + (j + 1) golden) + 1/2) / 2^23, key a mix of the seed and the
// position; u_j is exact in float32 and within [2^-24, 1 - 2^-24] (24 bits would round 1 - 2^-25 to 1,
// whose noise is infinite). Number j is a function of (seed, position, j) alone, so a shorter
// vocabulary reads a prefix. About 46 us for 49,152 tokens on one thread (AMD EPYC, AVX-512), where
// numpy's Philox and logs took 220; a large vocabulary is split among the team, which waits between
// passes anyway.
extern "C" void specsample_gumbel_noise(uint64_t seed, uint64_t position, long vocab, float* out) {
  const uint64_t golden = 0x9E3779B97F4A7C15ull;
  const uint64_t key = mix64(seed + golden) ^ mix64(position ^ 0x632BE59BD9B4E019ull);
  vu64 lane;
  for (int l = 0; l < VL; l++) lane[l] = (uint64_t)l;
#pragma omp parallel for schedule(static) if (vocab >= 16384)
  for (long j = 0; j < vocab; j += VL) {  // the tail through a whole vector's lanes, stored in part
    vu64 z = mix64(key + (lane + (uint64_t)(j + 1)) * golden);
    vf u = (__builtin_convertvector(z >> 41, vf) + 0.5f) * (1.0f / 8388608.0f);
    vf g = 0.0f - log_positive(0.0f - log_positive(u));
    memcpy(out + j, &g, (vocab - j < VL ? vocab - j : VL) * sizeof(float));
  }
}

// Whether a lane of v is above t (NaN never is).
static inline bool any_above(vf v, float t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(t), _CMP_GT_OQ)) != 0;
#else
  vi above = v > t;
  for (int l = 0; l < VL; l++)
    if (above[l]) return true;
  return false;
#endif
}

// Entry i (value v) into a row's best `count` so far (values best, indices at, largest first), after
// those it does not beat: equal entries stay in index order.
static inline void admit(float v, long i, float* best, int64_t* at, int count) {
  int j = count - 1;
  for (; j > 0 && v > best[j - 1]; j--) best[j] = best[j - 1], at[j] = at[j - 1];
  best[j] = v, at[j] = i;
}

// The indices of the k largest entries of each row of x [rows, n] (rows ld apart; k <= 64, k <= n),
// largest first, the earlier of equal entries first: out [rows, k]. One pass over a row: a vector of
// entries is looked at one by one only where one beats the k-th best so far, which after the first few
// hundred entries of a row of logits is rare (19 us a row of 49,152; torch.topk 122 to 170, Intel Xeon).
extern "C" void specsample_top_k(const float* x, long rows, long n, long ld, int k, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows >= 4)
  for (long r = 0; r < rows; r++) {
    const float* row = x + r * ld;
    int64_t* at = out + r * k;
    float best[64];
    for (int j = 0; j < k; j++) admit(row[j], j, best, at, j + 1);
    long i = k;
    for (; i + VL <= n; i += VL)
      if (any_above(load(row + i), best[k - 1]))
        for (long l = i; l < i + VL; l++)
          if (row[l] > best[k - 1]) admit(row[l], l, best, at, k);
    for (; i < n; i++)
      if (row[i] > best[k - 1]) admit(row[i], i, best, at, k);
  }
}

// Attention works on the query heads that share a KV head together, up to HEADS of them, so that
// each key and value vector loaded serves them all; REGS: the vector registers there are.
#if defined(__AVX512F__)
enum { REGS = 32 };
#else
enum { REGS = 16 };
#endif
// IC: positions a block of values columns runs over before the next block; PF_ROWS: how many rows
// of values ahead the first block prefetches (24 rather than 8: an 8-token pass over 1,500 cached
// positions of the bundled model 4% faster, Intel Xeon; the same at 200 and 600); PF_KEYS: how many
// blocks of VL positions ahead `dot_keys` prefetches its keys (without, a token's attention over 2,000
// positions read its keys at about 15 GB/s).
enum { HEADS = 4, IC = 64, PF_ROWS = 24, PF_KEYS = 8 };
// Attention runs on every thread from this many multiply-adds a head dimension (tokens x heads x positions),
// within one request (`attention`) or over a batch's requests (`layer_slots`); below, one thread does it.
static constexpr long PARALLEL_ATTENTION = 50000;

// Vectors of keys or values a register block of G heads covers: G x that accumulators, that many
// key or value vectors and one broadcast fit in the registers.
static constexpr int span(int G) { return (REGS - 1) / (G + 1) < 4 ? (REGS - 1) / (G + 1) : 4; }

// Keys are stored in tiles of TILE positions, [tiles, d, TILE]: key j of position p is
// kt[key_at(p, d) + j TILE], so a vector of VL positions (VL divides TILE) is contiguous, and a tile's
// keys, d TILE values, are one run of memory. Transposed whole ([d, cap]), each of the d rows of a
// block of positions was its own stream, cap positions away from the next: a job's loads missed the
// caches the prefetchers keep, and a pass's pages outran the TLB.
enum { TILE = 16 };
static inline long key_at(long p, long d) { return p / TILE * d * TILE + p % TILE; }

// scores[h ld + (b + u) VL + l] = q_h . key of position (b + u) VL + l, for heads h < G (q_h at
// q + h d) and u < B: one chain of multiply-adds over j per score.
template <int G, int B, typename KV>
static void dot_keys(const float* q, const KV* kt, long d, long b, float* scores, long ld, bool prefetch) {
  vf acc[G][B] = {};
  const KV* at[B];  // the keys of block b + u's positions, tiled (`key_at`)
  for (int u = 0; u < B; u++) at[u] = kt + key_at((b + u) * VL, d);
  // the blocks PF_KEYS ahead, B VL d keys from their first (tiles follow each other), per_j lines every j
  // (no division in the loop: an idiv a j took two thirds of a single token's key scoring on AVX2)
  const char* ahead = (const char*)(kt + key_at((b + PF_KEYS) * VL, d));
  const long lines = (B * VL * d * (long)sizeof(KV) + 63) / 64, per_j = (lines + d - 1) / d;
  for (long j = 0; j < d; j++) {
    if (prefetch)
      for (long l = j * per_j; l < (j + 1) * per_j && l < lines; l++) __builtin_prefetch(ahead + 64 * l);
    vf k[B];
    for (int u = 0; u < B; u++) k[u] = load(at[u] + j * TILE);
    for (int h = 0; h < G; h++) {
      float qj = q[h * d + j];
      for (int u = 0; u < B; u++) acc[h][u] += qj * k[u];
    }
  }
  for (int h = 0; h < G; h++)
    for (int u = 0; u < B; u++) *(vfu*)(scores + h * ld + (b + u) * VL) = acc[h][u];
}

// o_h[0:C VL] (+)= sum over i0 <= i < i1 of p_h[i] v[i, 0:C VL], for heads h < G (p_h at p + h ld,
// o_h at o + h d; v's rows d apart), o_h overwritten where i0 = 0: one chain of multiply-adds over i
// per output, parked in o between calls. With `prefetch`, fetches the rows PF_ROWS ahead.
template <int G, int C, typename KV>
static void weighted_values(const float* p, long ld, const KV* v, long i0, long i1, long d, float* o,
                            bool prefetch) {
  vf acc[G][C];
  for (int h = 0; h < G; h++)
    for (int u = 0; u < C; u++) acc[h][u] = i0 ? load(o + h * d + u * VL) : (vf){};
  for (long i = i0; i < i1; i++) {
    if (prefetch)
      for (long l = 0; l < d; l += 64 / (long)sizeof(KV)) __builtin_prefetch(v + (i + PF_ROWS) * d + l);
    vf x[C];
    for (int u = 0; u < C; u++) x[u] = load(v + i * d + u * VL);
    for (int h = 0; h < G; h++) {
      float s = p[h * ld + i];
      for (int u = 0; u < C; u++) acc[h][u] += s * x[u];
    }
  }
  for (int h = 0; h < G; h++)
    for (int u = 0; u < C; u++) *(vfu*)(o + h * d + u * VL) = acc[h][u];
}

// Tree attention: copies of the keys (tiled as in the cache, from the tile of position `tile`, a
// multiple of TILE) of positions from..len-1 of a row whose positions from `start` on are the cache
// slots slots[i - start] (a tree node's path), and of the values ([len - start, d]) of positions
// start..len-1, so that `dot_keys` and `weighted_values` run on them as on keys and values in place:
// the same chains of float operations, bitwise.
template <typename KV>
static void gather_path(const KV* kt, const KV* v, long d, long tile, long from, long len, const long* slots,
                        long start, float* keys, float* values) {
  for (long i = from; i < len; i++) {
    long pos = i < start ? i : slots[i - start];
    for (long j = 0; j < d; j++) keys[key_at(i - tile, d) + j * TILE] = (float)kt[key_at(pos, d) + j * TILE];
    if (i >= start)
      for (long j = 0; j < d; j++) values[(i - start) * d + j] = (float)v[pos * d + j];
  }
}

// QUERIES: the most queries one attention job runs together (several tokens' query heads of one KV
// head), so that each key and value vector loaded serves them all. Measured on AMD EPYC (AVX-512),
// bundled model, 8 tokens after 1,000 and 2,000: 6 (two tokens of 3 heads) 8% to 10% faster than 12;
// on AVX2, 6 is what the 16 registers hold.
enum { QUERIES = 6 };

// Scores of Q queries (q [Q, d]) for the key blocks b0..b1-1 (`dot_keys`, span(Q) blocks at a time).
template <int Q, typename KV>
static void score_blocks(const float* q, const KV* kt, long d, long b0, long b1, float* scores, long ld) {
  constexpr int B = span(Q);
  long b = b0;
  for (; b + B <= b1; b += B) dot_keys<Q, B>(q, kt, d, b, scores, ld, b + PF_KEYS + B <= b1);
  for (; b < b1; b++) dot_keys<Q, 1>(q, kt, d, b, scores, ld, false);
}

// o_h (+)= the values of positions i0..i1-1 weighted by p_h, for Q queries (`weighted_values`, over
// column blocks of C vectors; d a multiple of VL), in blocks of IC positions.
template <int Q, typename KV>
static void value_blocks(const float* p, long ld, const KV* v, long i0, long i1, long d, float* o, bool prefetch) {
  constexpr int C = span(Q) == 3 ? 2 : span(Q);  // 2 + 2 + ... rather than 3 + 3 + 1 + 1 for d = 8 VL
  for (long a = i0; a < i1; a = a + IC < i1 ? a + IC : i1) {
    long b = a + IC < i1 ? a + IC : i1, c = 0;
    for (; c + C * VL <= d; c += C * VL) weighted_values<Q, C>(p, ld, v + c, a, b, d, o + c, prefetch && c == 0);
    for (; c < d; c += VL) weighted_values<Q, 1>(p, ld, v + c, a, b, d, o + c, false);
  }
}

template <typename KV>
struct ByQueries {
  using scores_fn = void (*)(const float*, const KV*, long, long, long, float*, long);
  using values_fn = void (*)(const float*, long, const KV*, long, long, long, float*, bool);
  scores_fn scores[QUERIES];
  values_fn values[QUERIES];
};

// score_blocks<1..QUERIES> and value_blocks<1..QUERIES>, indexed by the number of queries less one.
template <typename KV, int... I>
static const ByQueries<KV>& by_queries(std::integer_sequence<int, I...>) {
  static const ByQueries<KV> table = {{score_blocks<I + 1, KV>...}, {value_blocks<I + 1, KV>...}};
  return table;
}

// Softmax of a row of scores over its positions lo..len-1 (scaled; blocks VL-wide from lo's; the scores
// before lo, outside a sliding window, need not be there): positions before lo get weight 0 exactly, so
// that values read from any earlier position on add nothing; the rest of the last block gets about 0.
static void softmax_row(float* row, long lo, long len, long blocks, float scale) {
  const long first = lo / VL;
  for (long i = first * VL; i < lo; i++) row[i] = -__builtin_inff();  // before the token's window
  for (long i = len; i < blocks * VL; i++) row[i] = -__builtin_inff();  // not positions of this token
  vf top = (vf){} - __builtin_inff();
  for (long b = first; b < blocks; b++) {
    vf s = load(row + b * VL) * scale;
    *(vfu*)(row + b * VL) = s;
    top = s > top ? s : top;
  }
  float m = top[0];
  for (int l = 1; l < VL; l++) m = top[l] > m ? top[l] : m;
  vf sum = {};
  for (long b = first; b < blocks; b++) {
    vf e = exp_nonpositive(load(row + b * VL) - m);
    *(vfu*)(row + b * VL) = e;
    sum += e;
  }
  float total = 0;
  for (int l = 0; l < VL; l++) total += sum[l];
  float inv = 1.0f / total;
  for (long b = first; b < blocks; b++) *(vfu*)(row + b * VL) = load(row + b * VL) * inv;
  for (long i = 0; i < lo; i++) row[i] = 0;
}

// One attention job: T tokens' G query heads each, of one KV head (keys kt tiled, `key_at`; values v [cap, d]);
// q [T G, d] (token by token), out [T G, d], scores T G rows of ld floats. Token u sees positions
// 0..lens[u]-1, or with a sliding `window` (0: none) the last `window` of them (the others weigh 0, and
// key blocks before every token's window are not read); with `paths` (tree attention), its positions
// start..lens[u]-1 are the cache slots paths[u][0..], read through copies at gathered + u stride
// (`gather_path`: its keys tiled, width positions, then its values [lens[u] - start, d]). Positions
// 0..common-1, which every token sees in place, are scored and weighted for all T G queries at once (each
// key and value vector loaded once); each token's others after, for its G queries. Every output is the
// same chain of float operations whatever T and the other tokens.
template <typename KV>
static void attend(const float* q, long T, long G, const KV* kt, const KV* v, long d, const long* lens,
                   long common, long window, float scale, float* scores, long ld, float* out, const long* const* paths,
                   long start, long stride, float* gathered) {
  const ByQueries<KV>& fn = by_queries<KV>(std::make_integer_sequence<int, QUERIES>{});
  const ByQueries<float>& copies = by_queries<float>(std::make_integer_sequence<int, QUERIES>{});  // paths'
  long Q = T * G, shared = common / VL;  // key blocks every token reads in place
  // the first key block any token's window reaches (0 without a window): the blocks before weigh nothing
  auto window_block = [&](long u) { return window && lens[u] > window ? (lens[u] - window) / VL : 0; };
  long skip = window_block(0);
  for (long u = 1; u < T; u++) skip = window_block(u) < skip ? window_block(u) : skip;
  fn.scores[Q - 1](q, kt, d, skip, shared, scores, ld);
  // A path's gathered keys: whole tiles, from the tile of its first block not read in place (position
  // `tile`) to the tile of its last position.
  long tile = start / TILE * TILE;
  auto width = [&](long u) { return (lens[u] + TILE - 1) / TILE * TILE - tile; };
  auto path_values = [&](long u) { return gathered + u * stride + d * width(u); };  // row i - start: position i
  for (long u = 0; u < T; u++) {
    long len = lens[u], blocks = (len + VL - 1) / VL, in_place = paths ? start / VL : blocks;
    const float* qu = q + u * G * d;
    float* su = scores + u * G * ld;
    fn.scores[G - 1](qu, kt, d, shared > skip ? shared : skip, in_place, su, ld);
    if (paths) {
      float* keys = gathered + u * stride;
      gather_path(kt, v, d, tile, in_place * VL, len, paths[u], start, keys, path_values(u));
      copies.scores[G - 1](qu, keys - tile * d, d, in_place, blocks, su, ld);  // position p at key_at(p - tile)
    }
    long lo = window && len > window ? len - window : 0;
    for (long h = 0; h < G; h++) softmax_row(su + h * ld, lo, len, blocks, scale);
  }
  if (d % VL) {
    for (long u = 0; u < T; u++)
      for (long h = 0; h < G; h++) {
        float* o = out + (u * G + h) * d;
        const float* p = scores + (u * G + h) * ld;
        const float* moved = paths ? path_values(u) : nullptr;
        for (long j = 0; j < d; j++) o[j] = 0;
        for (long i = 0; i < lens[u]; i++)
          for (long j = 0; j < d; j++)
            o[j] += p[i] * (paths && i >= start ? moved[(i - start) * d + j] : (float)v[i * d + j]);
      }
    return;
  }
  if (skip)  // the values then add onto zeros from block `skip` on
    for (long i = 0; i < Q * d; i++) out[i] = 0;
  fn.values[Q - 1](scores, ld, v, skip * VL, common, d, out, true);
  for (long u = 0; u < T; u++) {
    long len = lens[u], direct = paths ? start : len;  // positions whose values are read in place
    const float* su = scores + u * G * ld;
    float* ou = out + u * G * d;
    long from = common > skip * VL ? common : skip * VL;
    fn.values[G - 1](su, ld, v, from, direct, d, ou, true);
    if (paths) copies.values[G - 1](su, ld, path_values(u) - start * d, direct, len, d, ou, false);
  }
}

// One layer's attention for n new tokens at positions start..start+n-1.
// qkv [n, (heads + 2 kv_heads) d]: q and k are rotated in place (x cos + roll(x, d/2) signed_sin,
// cos and sin [n, d]); keys [kv_heads, cap / TILE, d, TILE] (tiled, `key_at`: 16 positions are one
// AVX-512 vector) and values [kv_heads, cap, d] get positions start.. written and 0..start+n-1 read,
// cap a multiple of TILE;
// out [n, heads d]. Query head h reads KV head h / (heads / kv_heads); token t sees positions
// 0..start+t. A job is a run of consecutive tokens' query heads of one KV head (or HEADS of them if
// more), up to QUERIES queries, with at least two jobs a thread where there are enough tokens.
// With `parents` [n] (a tree: token t's parent among the n, -1 for none, parents[t] < t), token t
// sits at position start + its depth (its rotary angle), is written to slot start + t, and sees
// positions 0..start-1 and the slots of its ancestors and itself, as its path scored as a chain would.
// Keys and values are of type KV: float, or _Float16 (rounded to nearest when written, read exactly:
// half the bytes a position streams, as llama.cpp keeps them). Scores are scaled by `scale`; with a
// sliding `window` (not 0) a token sees only the last `window` positions of its own (Gemma 3's local layers).
template <typename KV>
static void attention(float* qkv, long n, long heads, long kv_heads, long d, const float* cos,
                      const float* sin, KV* keys, KV* values, long cap, long start, float* out, long window,
                      float scale, const long* parents = nullptr) {
  long width = (heads + 2 * kv_heads) * d, groups = heads / kv_heads, half = d / 2;
  std::vector<long> depth(parents ? n : 0), slots(parents ? n * n : 0);  // slots [t, depth]: t's path
  for (long t = 0; parents && t < n; t++) {
    depth[t] = parents[t] < 0 ? 0 : depth[parents[t]] + 1;
    for (long u = t, a = depth[t]; a >= 0; u = parents[u], a--) slots[t * n + a] = start + u;
  }
  for (long t = 0; t < n; t++) {
    float* row = qkv + t * width;
    long position = parents ? depth[t] : t;
    const float *c = cos + position * d, *s = sin + position * d;
    for (long h = 0; h < heads + kv_heads; h++) {
      float x[1024], *y = row + h * d;
      memcpy(x, y, d * sizeof(float));
      for (long j = 0; j < half; j++) y[j] = x[j] * c[j] + x[j + half] * s[j];
      for (long j = half; j < d; j++) y[j] = x[j] * c[j] + x[j - half] * s[j];
    }
    for (long g = 0; g < kv_heads; g++) {
      for (long j = 0; j < d; j++) keys[g * d * cap + key_at(start + t, d) + j * TILE] = (KV)row[(heads + g) * d + j];
      for (long j = 0; j < d; j++) values[(g * cap + start + t) * d + j] = (KV)row[(heads + kv_heads + g) * d + j];
    }
  }
  long end = start + n, ld = (end + VL - 1) / VL * VL;
  long parts = (groups + HEADS - 1) / HEADS;  // jobs per token and KV head
  long widest = (groups + parts - 1) / parts;  // query heads of a job's token
  long longest = 0;  // tree: the deepest path, in positions past start
  for (long t = 0; parents && t < n; t++) longest = depth[t] + 1 > longest ? depth[t] + 1 : longest;
  long w = (start + longest + TILE - 1) / TILE * TILE - start / TILE * TILE;  // gathered positions of a path, at most
  long stride = 2 * d * w;  // floats of a token's copies of its path: keys [w / TILE, d, TILE], values [<= w, d]
  bool parallel = n * heads * end * d >= PARALLEL_ATTENTION;
#if defined(_OPENMP)
  long threads = parallel ? omp_get_max_threads() : 1;
#else
  long threads = 1;
#endif
  long most = QUERIES / widest;  // tokens a job may hold
  long enough = n * kv_heads * parts / (2 * threads);  // tokens a job holds for two jobs a thread
  long per_job = most < enough ? most : enough > 1 ? enough : 1;
  long runs = (n + per_job - 1) / per_job;  // runs of tokens, each a job per KV head and part
#pragma omp parallel if (parallel)
  {
    float* scores = new float[QUERIES * ld];
    float* q = new float[2 * QUERIES * d];  // the job's queries, then its outputs
    float* gathered = parents ? new float[per_job * stride] : nullptr;  // paths' copies
    long lens[QUERIES];
    const long* paths[QUERIES];
#pragma omp for schedule(static, 1)  // round robin: a later run of a prefill attends over more positions
    for (long job = 0; job < runs * kv_heads * parts; job++) {
      // a KV head's jobs one after another: a thread's second job of a head finds its keys in L2
      long g = job / (runs * parts), r = job / parts % runs, part = job % parts;
      long t0 = r * n / runs, t1 = (r + 1) * n / runs, T = t1 - t0;
      long h0 = g * groups + part * groups / parts, h1 = g * groups + (part + 1) * groups / parts, G = h1 - h0;
      for (long u = 0; u < T; u++) {
        long t = t0 + u;
        lens[u] = start + (parents ? depth[t] : t) + 1;
        paths[u] = parents ? slots.data() + t * n : nullptr;
        memcpy(q + u * G * d, qkv + t * width + h0 * d, G * d * sizeof(float));
      }
      long common = parents ? start : start + t0 + 1;  // positions every token of the run sees in place
      float* o = q + QUERIES * d;
      attend(q, T, G, keys + g * d * cap, values + g * cap * d, d, lens, common, window, scale, scores, ld, o,
             parents ? paths : nullptr, start, stride, gathered);
      for (long u = 0; u < T; u++) memcpy(out + (t0 + u) * heads * d + h0 * d, o + u * G * d, G * d * sizeof(float));
    }
    delete[] scores;
    delete[] q;
    delete[] gathered;
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

// RMSNorm of x [M, n] with weight w [n] into y, for the final norm after the layers: the layers' own
// arithmetic, and about 1 us where torch.rms_norm, a composite of several ops on CPU, took 15 to 50.
extern "C" void specsample_rms_norm(const float* x, const float* w, long M, long n, float eps, float* y) {
  rms_norm(x, w, M, n, eps, y);
}

// act[m, j] = a(gate[m, j]) * up[m, j] for gu [M, 2 I] (gate, then up): a(g) = g sigmoid(z) with z = g
// (SiLU) or, with `gelu`, z = 2 sqrt(2 / pi) (g + 0.044715 g^3) (GELU's tanh form, Gemma's: 0.5 (1 +
// tanh(z / 2)) is sigmoid(z)); sigmoid(z) from e = exp(-|z|) <= 1, VL lanes at a time (the tail of a row
// zero-padded).
static void gated_mul(const float* gu, long M, long I, float* act, bool gelu) {
  const long chunk = 256, chunks = (I + chunk - 1) / chunk;  // a multiple of VL: lanes never straddle chunks
  // Thousands of exponentials a row: split among the team, where the products' threads would wait.
#pragma omp parallel for schedule(static) if (M * I >= 4096)
  for (long c = 0; c < M * chunks; c++) {
    long m = c / chunks, j0 = c % chunks * chunk, j1 = j0 + chunk < I ? j0 + chunk : I;
    const float *gate = gu + m * 2 * I, *up = gate + I;
    float* a = act + m * I;
    for (long j = j0; j < j1; j += VL) {
      long lanes = j1 - j < VL ? j1 - j : VL;
      float g_buf[VL] = {}, u_buf[VL] = {};
      if (lanes < VL) {  // a partial last vector through buffers (a memcpy of a variable size is a call)
        memcpy(g_buf, gate + j, lanes * sizeof(float));
        memcpy(u_buf, up + j, lanes * sizeof(float));
      }
      vf g = load(lanes < VL ? g_buf : gate + j), u = load(lanes < VL ? u_buf : up + j);
      vf z = gelu ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
      vf e = exp_nonpositive(z < 0 ? z : -z);
      vf sigmoid = (z < 0 ? e : (vf){} + 1.0f) / (1.0f + e);
      vf out = g * sigmoid * u;
      if (lanes < VL)
        memcpy(a + j, &out, lanes * sizeof(float));
      else
        *(vfu*)(a + j) = out;
    }
  }
}

// Weights and cache of one decoder layer; matrices packed as by `pack` (scales null), by
// `pack_int8` (each with its column scales), or, where its GGML type fqkv, fo, fgu or fdown is not
// 0, in GGUF blocks (gguf_blocks.pack_blocks: the blocks, and their fp16 scales as the "scales").
// q_norm and k_norm [d] (Qwen3, Gemma 3; null for none): an RMSNorm of each query and key head before the
// rotation. post_attn_norm and post_mlp_norm [hidden] (Gemma 3; null for none): an RMSNorm of the attention's
// and the MLP's output before each is added to the residual stream. gelu: the MLP's gate through GELU's
// tanh form, not SiLU. window: a sliding attention window (0: none); scale: what scores are scaled by.
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
  void *keys, *values;  // float, or _Float16 where kv_half
  const float *q_norm, *k_norm;
  const float *post_attn_norm, *post_mlp_norm;
  int fqkv, fo, fgu, fdown;
  int kv_half;
  int gelu;
  long window;
  float scale;
};

extern "C" int specsample_gemm_gguf(int type, const float* x, long M, long K, long ldx, const uint8_t* qs,
                                    const uint16_t* scales, long N, float* y, long ldy, const float* bias,
                                    int add);

// y[M, N] (+)= x[M, K] @ w (+ bias), rows contiguous: GGUF blocks of GGML type `type` (kernels_gguf.cpp),
// or packed panels where type is 0.
static void linear(int type, const float* x, long M, long K, const void* w, const float* scale, long N,
                   float* y, const float* bias, int add) {
  if (type) specsample_gemm_gguf(type, x, M, K, K, (const uint8_t*)w, (const uint16_t*)scale, N, y, N, bias, add);
  else specsample_gemm(x, M, K, K, w, scale, N, y, N, bias, add);
}

// Scratch of a layer pass over M rows: h [M, hidden], qkv [M, (heads + 2 kv_heads) d], att [M, heads d],
// gu [M, 2 inter], act [M, inter], out [M, hidden], one after the other.
struct Scratch {
  float *h, *qkv, *att, *gu, *act, *out;
  long qkv_width, att_width;
  Scratch(const Layer* L, long M, float* scratch)
      : qkv_width((L->heads + 2 * L->kv_heads) * L->d), att_width(L->heads * L->d) {
    h = scratch, qkv = h + M * L->hidden, att = qkv + M * qkv_width, gu = att + M * att_width;
    act = gu + M * 2 * L->inter, out = act + M * L->inter;
  }
};

// Before attention: h = norm(x), qkv = h @ wqkv (+ bias), then with q_norm and k_norm each query
// and key head normed in place (a row's norm reads the row before writing it).
static void attention_input(const Layer* L, const float* x, long M, const Scratch& s) {
  rms_norm(x, L->attn_norm, M, L->hidden, L->eps, s.h);
  linear(L->fqkv, s.h, M, L->hidden, L->wqkv, L->sqkv, s.qkv_width, s.qkv, L->bqkv, 0);
  if (!L->q_norm) return;
  for (long m = 0; m < M; m++) {
    float* row = s.qkv + m * s.qkv_width;
    rms_norm(row, L->q_norm, L->heads, L->d, L->eps, row);
    rms_norm(row + L->heads * L->d, L->k_norm, L->kv_heads, L->d, L->eps, row + L->heads * L->d);
  }
}

// x [M, hidden] += y = x_in @ w (+ bias); with `post` (not null), += RMSNorm(y) (y made in `out`).
static void residual(const Layer* L, int type, const float* x_in, long M, long K, const void* w, const float* scale,
                     const float* bias, const float* post, float* out, float* x) {
  long H = L->hidden;
  if (!post) {
    linear(type, x_in, M, K, w, scale, H, x, bias, 1);
    return;
  }
  linear(type, x_in, M, K, w, scale, H, out, bias, 0);
  rms_norm(out, post, M, H, L->eps, out);  // a row's norm reads the row before writing it
  for (long i = 0; i < M * H; i++) x[i] += out[i];
}

// After attention: x += att @ wo (+ bias), then the MLP block, x += down(act(gate) * up) of norm(x)
// (each output normed first where the layer has post-norms).
static void attention_output_and_mlp(const Layer* L, float* x, long M, const Scratch& s) {
  long H = L->hidden, I = L->inter;
  residual(L, L->fo, s.att, M, s.att_width, L->wo, L->so, L->bo, L->post_attn_norm, s.out, x);
  rms_norm(x, L->mlp_norm, M, H, L->eps, s.h);
  linear(L->fgu, s.h, M, H, L->wgu, L->sgu, 2 * I, s.gu, 0, 0);
  gated_mul(s.gu, M, I, s.act, L->gelu);
  residual(L, L->fdown, s.act, M, I, L->wdown, L->sdown, 0, L->post_mlp_norm, s.out, x);
}

// `attention` of layer L over n rows at `start`, on the cache `keys` and `values` of its element type.
static void layer_attention(const Layer* L, float* qkv, long n, long start, void* keys, void* values, float* att,
                            const long* parents) {
  const float *cos = L->cos + start * L->d, *sin = L->sin + start * L->d;
#if SPECSAMPLE_HALF
  if (L->kv_half) {
    attention(qkv, n, L->heads, L->kv_heads, L->d, cos, sin, (_Float16*)keys, (_Float16*)values, L->cap, start, att,
              L->window, L->scale, parents);
    return;
  }
#endif
  attention(qkv, n, L->heads, L->kv_heads, L->d, cos, sin, (float*)keys, (float*)values, L->cap, start, att, L->window,
            L->scale, parents);
}

// One decoder layer over x [M, hidden] (the residual stream, updated in place) at positions
// start..start+M-1. scratch holds M (2 hidden + (heads + 2 kv_heads) d + heads d + 3 inter) floats.
// With `parents` [M] (null for a chain), the M tokens are a tree (`attention`).
static void layer(const Layer* L, float* x, long M, long start, float* scratch, const long* parents) {
  Scratch s(L, M, scratch);
  attention_input(L, x, M, s);
  layer_attention(L, s.qkv, M, start, L->keys, L->values, s.att, parents);
  attention_output_and_mlp(L, x, M, s);
}

// `layer` for Ls[0], ..., Ls[count - 1] in turn: a pass's layers in one call from Python, whose
// ctypes call costs about 5 us a layer (5% of a one-token pass of the bundled model).
extern "C" void specsample_layers(const Layer* const* Ls, long count, float* x, long M, long start, float* scratch,
                                  const long* parents) {
  for (long i = 0; i < count; i++) layer(Ls[i], x, M, start, scratch, parents);
}

// One decoder layer over x [M, hidden] whose rows belong to `segments` requests, each with a cache
// of its own (a slot): segment s is the next rows[s] rows, at positions starts[s].. of its slot,
// whose cache of this layer is keys[s] and values[s] (laid out as L->keys and L->values, which are
// not read). The four products run once over the M stacked rows; each segment's attention is
// `attention` over its own cache, so a row's result is the same whatever the other rows of the pass.
// Segments run in parallel where there are several with enough work between them (PARALLEL_ATTENTION,
// as for one `attention`: 8 one-row segments over 50 cached positions took 0.83x the time they took one
// after another, each alone too small to split; bitwise the same); otherwise one after another, each
// `attention` parallel over its own tokens and heads where it has enough work (inside an inactive outer
// region, libgomp would run that inner region on a fresh team each call: a one-segment prefill through
// slots took 2.3x the target's own layer).
static void layer_slots(const Layer* L, float* x, long M, long segments, const long* rows, const long* starts,
                        void* const* keys, void* const* values, float* scratch) {
  Scratch sc(L, M, scratch);
  long work = 0;
  long* first = new long[segments + 1];  // first row of each segment
  first[0] = 0;
  for (long s = 0; s < segments; s++) {
    first[s + 1] = first[s] + rows[s];
    work += rows[s] * L->heads * (starts[s] + rows[s]) * L->d;
  }
  attention_input(L, x, M, sc);
  auto segment = [&](long s) {
    layer_attention(L, sc.qkv + first[s] * sc.qkv_width, rows[s], starts[s], keys[s], values[s],
                    sc.att + first[s] * sc.att_width, nullptr);
  };
  if (segments > 1 && work >= PARALLEL_ATTENTION) {  // not an `if` clause: a region of one thread would still start a team
#pragma omp parallel for schedule(dynamic)
    for (long s = 0; s < segments; s++) segment(s);
  } else {
    for (long s = 0; s < segments; s++) segment(s);
  }
  delete[] first;
  attention_output_and_mlp(L, x, M, sc);
}

// `layer_slots` for Ls[0], ..., Ls[count - 1] in turn, in one call from Python (as
// specsample_layers): layer i's caches are keys[i * segments + s] and values[i * segments + s].
extern "C" void specsample_layers_slots(const Layer* const* Ls, long count, float* x, long M, long segments,
                                        const long* rows, const long* starts, void* const* keys,
                                        void* const* values, float* scratch) {
  for (long i = 0; i < count; i++)
    layer_slots(Ls[i], x, M, segments, rows, starts, keys + i * segments, values + i * segments, scratch);
}
