// Small-row matrix multiply over GGUF quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K); loaded by kernels.py,
// compiled there together with kernels.cpp into one library (same flags, same cache key), so that
// kernels.cpp's decoder layer can call it. docs/kernels-gguf.md says why and how it measures.
//
// y[M, N] (+)= x[M, K] @ W^T (+ bias), W [N, K] in blocks of 32 inputs, repacked once at load by
// gguf_blocks.py into panels of 16 output columns, two panels (a pair, 32 columns) block after block
// so that a pass reads one stream:
//   qs     [pairs, K / 32, 2, QBYTES]  the block integers of a panel's 16 columns, 4 inputs per
//                                    32-bit lane: chunk c (64 bytes) holds, for column j at bytes
//                                    4j..4j+3, inputs of group c (Q8_0: inputs 4c..4c+3, int8) or,
//                                    for Q4, inputs 4c..4c+3 in the low nibbles and 16+4c..16+4c+3
//                                    in the high nibbles (unsigned 0..15; GGUF's own nibble order)
//   scales [pairs, K / 32, 2, S, 16]   fp16: d of each column (and, Q4_1, its min m after it)
// Block values: Q4_0 d (u - 8), Q4_1 d u + m, Q8_0 d q; Q5_0 d (u - 16), Q5_1 d u + m, whose fifth
// bits follow the nibbles in one more 64-byte chunk: byte 4j + i holds, for column j, at bit c the
// fifth bit of input 4c + i and at bit 4 + c that of input 16 + 4c + i.
//
// The K types keep 256-input super-blocks of 8 (Q4_K) or 16 (Q6_K) sub-blocks, each with its own
// small integer scale. Their integers are repacked into the same 32-input blocks (Q6_K: the low
// nibbles as Q4's, then two 64-byte chunks of the 2 high bits: byte 4j + i of chunk 4 + half holds,
// at bits 2c, the high bits of input 16 half + 4c + i of column j), and their scales into one record
// per panel and super-block ("meta", uint8 [pairs, K / 256, 2, bytes]):
//   Q4_K  d [16] fp16, dmin [16] fp16, sc [8][16] uint8, m [8][16] uint8   value d sc u - dmin m
//   Q6_K  d [16] fp16, sc [16][16] int8                                    value d sc (u - 32)
// A sub-block's float scale d sc (and dmin m) is exact in float32 (11 by 8 bits at most), so
// Q4_K runs Q4_1's arithmetic with dw = d sc, mw = -(dmin m); Q6_K's 16-input sub-blocks give two
// exact integers per block (ta and tb, inputs 0..15 and 16..31) and two multiply-adds.
//
// The activations are quantized per 32-block to int8 as llama.cpp's q8_0 does (dx = amax / 127,
// q = round(x / dx)) with their sums sx, once per call. A block's dot product with a column is then
// an exact integer t (Q4_0: sum (u - 8) q = sum u q - 8 sx; Q8_0: sum w q; Q4_1: sum u q), and
// each output accumulates, block after block in input order,
//   acc = fma(float(t), dw * dx, acc)          (Q4_1 then: acc = fma(mw, dx * float(sx), acc)).
// Those float operations are the same on every path, and the integers are exact, so a row's output
// does not depend on the other rows of the pass, nor on the instruction set (bitwise).
//
// Each weight block is loaded and unpacked into registers once, then multiplied against every row
// of the pass (up to 16 at a time): the rows' extra cost is their multiply-adds, never another
// read or unpacking of the weights.
//   avx512vnni: 16 columns are one register of 16 int32 lanes; vpdpbusd multiplies 4 unsigned
//               weight bytes by 4 signed activation bytes per lane (Q8_0's signed weights are
//               offset by 128 with one xor, and 128 sx taken off after). Both panels of a pair are
//               in registers at once, so a row's broadcast activations feed two products each: a
//               product waits on its broadcast load, and with one panel the loads bound the rows
//               (8-row pass of a 1,536 x 576 Q4_1 matrix 17% faster, AMD EPYC).
//   avxvnni:    AVX2 with AVX-VNNI (Intel since Alder Lake: AVX2 and VNNI, no AVX-512): two halves
//               of 8 columns, each the avx512vnni path's integers at 8 lanes (vpdpbusd on 256 bits,
//               Q8_0 offset by 128), one half at a time in the 16 registers.
//   avx2:       two halves of 8 columns; vpmaddubsw (unsigned x signed bytes to int16 pairs) and
//               vpmaddwd. Q4: the 8 groups of a block are summed in int16 (at most
//               8 * 2 * 15 * 127 = 30480, no saturation) and widened once; Q8_0 uses llama.cpp's
//               sign trick (|w| times x with w's sign) and widens each group.
//   portable:   scalar C++, the same integers and float operations.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_AVX2 1
#if defined(__AVXVNNI__)
#define GGUF_AVXVNNI 1
#endif
#include <immintrin.h>
#endif
// Whether the block's integer dot products are vpdpbusd's (unsigned weight bytes, Q8_0's offset by 128).
#if defined(GGUF_VNNI) || defined(GGUF_AVXVNNI)
#define GGUF_DPBUSD 1
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <memory>

namespace {

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  // GGML type ids
// PREFETCH: how far ahead of a pair's block its integers are prefetched, in bytes (a thread's pairs are
// contiguous). 2,048 (4 Q4_0 blocks of one panel) left a single-token pass of a 1B Q4_0 model waiting on
// memory and its 8-row pass 28% slower than 8,192 does (AMD EPYC, AVX-512; 16,384 measured the same).
// PAIR: panels stored and multiplied together.
enum { QK = 32, COLS = 16, PAIR = 2, MAX_ROWS = 16, PREFETCH = 8192, SUB = 8, EACH = 512 };  // SUB: 32-blocks per super-block

// Bytes of block integers per panel and block.
constexpr bool five_bits(int type) { return type == Q5_0 || type == Q5_1; }
constexpr int qbytes(int type) {
  return type == Q8_0 ? COLS * QK : type == Q6_K ? COLS * QK * 3 / 4 : five_bits(type) ? COLS * QK * 5 / 8 : COLS * QK / 2;
}
constexpr int nscales(int type) { return type == Q4_1 || type == Q5_1 ? 2 : 1; }
// Like Q4_1: unsigned integers, a scale and a min per column and block.
constexpr bool with_min(int type) { return type == Q4_1 || type == Q5_1 || type == Q4_K; }
// What the unsigned integers are offset by (Q4_0: u - 8, Q5_0: u - 16), taken off as that times sx.
constexpr int offset(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0; }
// 32-blocks per scale record, and bytes of a panel's record (fp16 scales, or a K type's meta).
constexpr int per_record(int type) { return type == Q4_K || type == Q6_K ? SUB : 1; }
constexpr int record_bytes(int type) {
  return type == Q4_K ? COLS * (2 + 2 + 2 * SUB) : type == Q6_K ? COLS * (2 + 2 * SUB) : COLS * 2 * nscales(type);
}

// An IEEE half as a float (exact; subnormals included).
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) {  // subnormal: normalise
    int shift = 0;
    while (!(man & 0x400)) man <<= 1, shift++;
    bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ff) << 13);
  } else {
    bits = sign;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Activations of rows m0.. quantized per block: q [rows, K] int8, d and s [rows, K / 32]; for Q6_K
// also the sums of each 16-input half, s16 [rows, K / 16]. Per block too, what the products add to
// each column's integer dot product (os, int32: minus the type's offset times s, `taken_off`) and what
// multiplies the column's min (ds = d float(s), for Q4_1's kind): read by the products from memory,
// a broadcast folded into the instruction that uses it, not an integer multiply, a conversion and a
// broadcast per row and block (an 8-row product 0 to 6% faster, by format and shape, Intel Xeon).
struct Acts {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const int32_t* s16;
  const int32_t* os;
  const float* ds;
  long K;
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One 32-block's d, q and s in two 16-float vectors: the operations of the 8-float version below
// (max_ps's NaN rule, ties to even, the low byte kept), half as many, and no chain of shuffles to
// sum and pack: an 8-row pass of the bundled Q4_1 spent 7% of its time quantizing activations.
inline void quantize_block(const float* v, int8_t* out, float* d, int32_t* s) {
  __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
  __m512 top = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
  float scale = _mm512_reduce_max_ps(top) / 127.0f, inverse = scale != 0 ? 1.0f / scale : 0.0f;
  const __m512 times = _mm512_set1_ps(inverse);
  __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, times)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, times));
  q0 = _mm512_srai_epi32(_mm512_slli_epi32(q0, 24), 24);  // the low byte, sign-extended
  q1 = _mm512_srai_epi32(_mm512_slli_epi32(q1, 24), 24);
  _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtepi32_epi8(q1));
  bool nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
  *d = nan ? NAN : scale;
  *s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}
#elif (defined(GGUF_VNNI) || defined(GGUF_AVX2)) && defined(__AVX2__)
// One 32-block's d, q and s in 8-float vectors, the same operations as the scalar loop below: max_ps
// returns its second operand (top) for a NaN, as the comparison does; max is exact in any order; and
// cvtps_epi32 rounds to nearest, ties to even (the default rounding, nearbyintf's), keeping the low
// byte as the int8 conversion does. A pass over 8 rows spent 6 to 9% of its time in the scalar loop.
inline void quantize_block(const float* v, int8_t* out, float* d, int32_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    top = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), top);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  float scale = _mm_cvtss_f32(m) / 127.0f, inverse = scale != 0 ? 1.0f / scale : 0.0f;
  const __m256 times = _mm256_set1_ps(inverse);
  __m256i q[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; i++) {
    __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], times));
    q[i] = _mm256_srai_epi32(_mm256_slli_epi32(rounded, 24), 24);  // the low byte, sign-extended
    sum = _mm256_add_epi32(sum, q[i]);
  }
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256 unordered = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x[i], x[i], _CMP_UNORD_Q));
  __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4e));
  total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xb1));
  *d = _mm256_movemask_ps(unordered) ? NAN : scale;
  *s = _mm_cvtsi128_si32(total);
}
#else
typedef float f8 __attribute__((vector_size(32)));

// max |v[i]| of a 32-block (NaNs skipped). Comparisons, not fmaxf (a call per input without
// -ffast-math), in 8 lanes: a scalar maximum is a chain of 32 compare-and-selects, which the compiler
// will not reorder (3% of a single-token pass, AMD EPYC).
inline float block_amax(const float* v) {
  f8 top = {};
  for (int i = 0; i < QK; i += 8) {
    f8 x;
    memcpy(&x, v + i, sizeof x);
    f8 a = x < 0 ? -x : x;
    top = a > top ? a : top;
  }
  float amax = 0;
  for (int l = 0; l < 8; l++) amax = top[l] > amax ? top[l] : amax;
  return amax;
}

// One 32-block: d = amax / 127, q = round(v / d) (half to even, as v * (1 / d)), s = sum q. A block holding a
// NaN gets d = NaN, so that its row's outputs are NaN as a float product's would be (amax skips NaNs, and
// they had quantized to 0: a NaN hidden state gave all-zero logits, a uniform distribution, silently).
inline void quantize_block(const float* v, int8_t* out, float* d, int32_t* s) {
  float amax = block_amax(v);
  float scale = amax / 127.0f, inverse = scale != 0 ? 1.0f / scale : 0.0f;
  int sum = 0;
  bool nan = false;
  for (int i = 0; i < QK; i++) {
    float r = v[i] * inverse;
    out[i] = r == r ? (int8_t)nearbyintf(r) : 0;  // NaN (v NaN, or infinite with a zero inverse): 0, as cvtps gives
    sum += out[i];
    nan |= v[i] != v[i];
  }
  *d = nan ? NAN : scale;
  *s = sum;
}
#endif

// x [M, K] (row stride ldx) per 32-block: q [M, K], d and s [M, K / 32] (`quantize_block`). The same
// float operations as gguf_blocks.quantize_activations.
void quantize_rows(const float* x, long M, long K, long ldx, int8_t* q, float* d, int32_t* s) {
  long blocks = K / QK;
  for (long m = 0; m < M; m++)
    for (long b = 0; b < blocks; b++) quantize_block(x + m * ldx + b * QK, q + m * K + b * QK, d + m * blocks + b, s + m * blocks + b);
}

// What the vector products take off a block's unsigned dot product, per unit of s: the type's offset
// (`offset`), and with vpdpbusd Q8_0's 128 (its weights offset by 128 there; AVX2 multiplies their signs).
constexpr int taken_off(int type) {
#if defined(GGUF_DPBUSD)
  return type == Q8_0 ? 128 : offset(type);
#else
  return type == Q8_0 ? 0 : offset(type);
#endif
}

// The per-block terms of `Acts` for blocks 0..count-1 of d and s: os = -taken_off(T) s, ds = d float(s).
template <int T>
void block_terms(const float* d, const int32_t* s, long count, int32_t* os, float* ds) {
  for (long i = 0; i < count; i++) {
    os[i] = -taken_off(T) * s[i];
    ds[i] = d[i] * (float)s[i];
  }
}

// Rows' accumulators acc [rows, 32] of a pair written out, ncols of them: y = acc (+ bias), or y += that.
void store(const float (*acc)[PAIR * COLS], int rows, float* y, long ldy, const float* bias, int ncols, int add) {
  for (int m = 0; m < rows; m++) {
    float* row = y + m * ldy;
    for (int j = 0; j < ncols; j++) {
      float out = bias ? acc[m][j] + bias[j] : acc[m][j];
      row[j] = add ? row[j] + out : out;
    }
  }
}

// Half sums of the activations, for Q6_K: s16 [M, K / 16] over q [M, K].
void half_sums(const int8_t* q, long M, long K, int32_t* s16) {
  for (long i = 0; i < M * K / 16; i++) {
    int sum = 0;
    for (int k = 0; k < 16; k++) sum += q[i * 16 + k];
    s16[i] = sum;
  }
}

#if defined(GGUF_VNNI) || defined(GGUF_AVX2)

#if defined(GGUF_VNNI)
#define GGUF_ISA "avx512vnni"
typedef __m512i VI;
typedef __m512 VF;
enum { LANES = 16 };
inline VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI splat(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline VI splat_byte(int v) { return _mm512_set1_epi8((char)v); }
inline VI nibbles(VI v, int high) { return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, splat_byte(0x0f)); }
// Bits 2c, 2c + 1 of each byte moved to bits 4, 5 (the rest zero).
inline VI high_bits(VI v, int c) {
  VI moved = c == 0 ? _mm512_slli_epi16(v, 4) : c == 1 ? _mm512_slli_epi16(v, 2) : c == 2 ? v : _mm512_srli_epi16(v, 2);
  return _mm512_and_si512(moved, splat_byte(0x30));
}
// Bit b of each byte moved to bit 4 (the rest zero).
inline VI bit_to_4(VI v, int b) {
  VI moved = b < 4 ? _mm512_slli_epi16(v, 4 - b) : b == 4 ? v : _mm512_srli_epi16(v, b - 4);
  return _mm512_and_si512(moved, splat_byte(0x10));
}
inline VI bor(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI minus(VI a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline VI izero() { return _mm512_setzero_si512(); }
inline VI isplat(int32_t v) { return _mm512_set1_epi32(v); }
inline VI iadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI flip(VI v) { return _mm512_xor_si512(v, splat_byte(0x80)); }
inline VI dpbusd(VI acc, VI w, VI x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline VF halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline VF ubytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline VF sbytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF mul(VF a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
inline VF neg(VF a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }
inline VF floats(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF fsplat(float v) { return _mm512_set1_ps(v); }
inline VF fzero() { return _mm512_setzero_ps(); }
inline void fstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
#else
#if defined(GGUF_AVXVNNI)
#define GGUF_ISA "avxvnni"
#else
#define GGUF_ISA "avx2"
#endif
typedef __m256i VI;
typedef __m256 VF;
enum { LANES = 8 };
inline VI load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline VI splat(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline VI splat_byte(int v) { return _mm256_set1_epi8((char)v); }
inline VI nibbles(VI v, int high) { return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, splat_byte(0x0f)); }
inline VI high_bits(VI v, int c) {
  VI moved = c == 0 ? _mm256_slli_epi16(v, 4) : c == 1 ? _mm256_slli_epi16(v, 2) : c == 2 ? v : _mm256_srli_epi16(v, 2);
  return _mm256_and_si256(moved, splat_byte(0x30));
}
inline VI bit_to_4(VI v, int b) {
  VI moved = b < 4 ? _mm256_slli_epi16(v, 4 - b) : b == 4 ? v : _mm256_srli_epi16(v, b - 4);
  return _mm256_and_si256(moved, splat_byte(0x10));
}
inline VI bor(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI minus(VI a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline VI izero() { return _mm256_setzero_si256(); }
inline VI isplat(int32_t v) { return _mm256_set1_epi32(v); }
#if defined(GGUF_AVXVNNI)
inline VI iadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI flip(VI v) { return _mm256_xor_si256(v, splat_byte(0x80)); }
inline VI dpbusd(VI acc, VI w, VI x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#endif
inline VF halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline VF ubytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline VF sbytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF mul(VF a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
inline VF neg(VF a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }
inline VF floats(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF fsplat(float v) { return _mm256_set1_ps(v); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline void fstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
#endif

constexpr int HALVES = COLS / LANES;  // vectors per 16 columns: 1 (AVX-512) or 2 (AVX2)

// The 8 groups of 4 inputs of one block for LANES columns (half h of the panel), as the integer
// operand of the dot product: Q4 nibbles (unsigned), Q6_K's nibbles with their high bits (0..63),
// Q8_0 weights offset by 128 (vpdpbusd) or their absolute values (AVX2, whose signs `dot` reads from memory).
template <int T>
inline void unpack(const uint8_t* q, int h, VI w[8]) {
  const uint8_t* base = q + h * LANES * 4;
  for (int c = 0; c < (T == Q8_0 ? 8 : 4); c++) {
    VI v = load(base + c * 64);
    if (T == Q8_0) {
#if defined(GGUF_DPBUSD)
      w[c] = flip(v);
#else
      w[c] = _mm256_abs_epi8(v);
#endif
    } else {
      w[c] = nibbles(v, 0);
      w[4 + c] = nibbles(v, 1);
    }
  }
  if (T == Q6_K) {
    VI low = load(base + 4 * 64), high = load(base + 5 * 64);
    for (int c = 0; c < 4; c++) {
      w[c] = bor(w[c], high_bits(low, c));
      w[4 + c] = bor(w[4 + c], high_bits(high, c));
    }
  }
  if (five_bits(T)) {
    VI fifth = load(base + 4 * 64);
    for (int c = 0; c < 4; c++) {
      w[c] = bor(w[c], bit_to_4(fifth, c));
      w[4 + c] = bor(w[4 + c], bit_to_4(fifth, 4 + c));
    }
  }
}

// The row's 8 groups of 4 activation bytes of one block, each broadcast to every lane (loaded once per
// row and block, shared by the panels of one call).
inline void splats(const int8_t* xm, VI xs[8]) {
  for (int g = 0; g < 8; g++) xs[g] = splat(xm + 4 * g);
}

// The unsigned dot product of groups g0..g1-1 of one block with a row's broadcast groups xs, per
// column (exact int32).
template <int T>
inline VI udot(const VI w[8], const VI xs[8], int g0, int g1, VI init) {
#if defined(GGUF_DPBUSD)
  // Two chains (g1 - g0 is 4 or 8): vpdpbusd's latency is 4 cycles, and a row's 8 products in one
  // chain leave the scheduler full of waiting products. One starts from `init`.
  VI even = init, odd = izero();
  for (int g = g0; g < g1; g += 2) {
    even = dpbusd(even, w[g], xs[g]);
    odd = dpbusd(odd, w[g + 1], xs[g + 1]);
  }
  return iadd(even, odd);
#else
  // int16 pair sums: Q4 at most 2 * 15 * 127 per group, all 8 summed; Q5 2 * 31 * 127, four summed;
  // Q6_K 2 * 63 * 127, two summed.
  const VI ones = _mm256_set1_epi16(1);
  const int run = T == Q6_K ? 2 : five_bits(T) ? 4 : 8;
  VI acc = init;
  for (int g = g0; g < g1; g += run) {
    VI pairs = _mm256_maddubs_epi16(w[g], xs[g]);
    for (int r = 1; r < run && g + r < g1; r++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[g + r], xs[g + r]));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
  }
  return acc;
#endif
}

// The exact integer dot products t of one block with a row (broadcast groups xs; os its `Acts` term),
// per column.
template <int T>
inline VI dot(const VI w[8], const uint8_t* q, int h, const VI xs[8], const int32_t* os) {
#if defined(GGUF_DPBUSD)
  (void)q, (void)h;
  return udot<T>(w, xs, 0, 8, taken_off(T) ? isplat(*os) : izero());
#else
  if (T == Q8_0) {
    const VI ones = _mm256_set1_epi16(1);
    const uint8_t* base = q + h * LANES * 4;
    VI acc = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
      VI signs = load(base + g * 64);
      VI pairs = _mm256_maddubs_epi16(w[g], _mm256_sign_epi8(xs[g], signs));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
    }
    return acc;
  }
  return udot<T>(w, xs, 0, 8, taken_off(T) ? isplat(*os) : izero());
#endif
}

// A block's float scales for LANES columns (half h): dw (Q6_K: of inputs 0..15, dw2 of 16..31), and
// mw, the min, for Q4_1 and Q4_K. rec is the panel's record of the block (b its index).
template <int T>
inline void block_scales(const uint8_t* rec, long b, int h, VF& dw, VF& dw2, VF& mw) {
  const uint16_t* d = (const uint16_t*)rec + h * LANES;
  int j = (int)(b % SUB);
  if (T == Q4_K) {
    dw = vmul(halves(d), ubytes(rec + 4 * COLS + j * COLS + h * LANES));
    mw = neg(vmul(halves(d + COLS), ubytes(rec + (4 + SUB) * COLS + j * COLS + h * LANES)));
  } else if (T == Q6_K) {
    dw = vmul(halves(d), sbytes(rec + 2 * COLS + 2 * j * COLS + h * LANES));
    dw2 = vmul(halves(d), sbytes(rec + 2 * COLS + (2 * j + 1) * COLS + h * LANES));
  } else {
    dw = halves(d);
    if (with_min(T)) mw = halves(d + COLS);
  }
}

// A pair's vectors per block (16 columns a vector on AVX-512, 8 on AVX2), and how many of them one
// pass over the rows multiplies: AVX-512 both panels (16 weight registers of 32), so each broadcast
// of a row's activations feeds two products; AVX2's 16 registers hold one vector's 8 groups.
enum { UNITS = PAIR * HALVES, TOGETHER = HALVES == 1 ? PAIR : 1 };

// y[0:rows, pair] (+)= x[0:rows] @ pair^T (+ bias) for one pair of panels (32 columns, ncols of them
// real) over all blocks.
template <int T>
void pair(const Acts& a, int rows, const uint8_t* q, const uint8_t* sc, float* y, long ldy, const float* bias,
          int ncols, int add) {
  const long blocks = a.K / QK;
  VF acc[MAX_ROWS][UNITS];
  for (int m = 0; m < rows; m++)
    for (int u = 0; u < UNITS; u++) acc[m][u] = fzero();
  for (long b = 0; b < blocks; b++) {
    const uint8_t* qb = q + b * PAIR * qbytes(T);
    const uint8_t* rec = sc + b / per_record(T) * PAIR * record_bytes(T);
    for (int l = 0; l < PAIR * qbytes(T); l += 64) __builtin_prefetch(qb + PREFETCH + l);
    for (int u0 = 0; u0 < UNITS; u0 += TOGETHER) {
      VI w[TOGETHER][8];
      VF dw[TOGETHER], dw2[TOGETHER], mw[TOGETHER];
      for (int k = 0; k < TOGETHER; k++) {
        int p = (u0 + k) / HALVES, h = (u0 + k) % HALVES;
        dw[k] = dw2[k] = mw[k] = fzero();
        unpack<T>(qb + p * qbytes(T), h, w[k]);
        block_scales<T>(rec + p * record_bytes(T), b, h, dw[k], dw2[k], mw[k]);
      }
      for (int m = 0; m < rows; m++) {
        long i = m * blocks + b;
        VI xs[8];
        splats(a.q + m * a.K + b * QK, xs);
        const float dx = a.d[i];
        for (int k = 0; k < TOGETHER; k++) {
          VF& out = acc[m][u0 + k];
          if (T == Q6_K) {
            VI ta = minus(udot<T>(w[k], xs, 0, 4, izero()), 32 * a.s16[2 * i]);
            VI tb = minus(udot<T>(w[k], xs, 4, 8, izero()), 32 * a.s16[2 * i + 1]);
            out = fma(floats(ta), mul(dw[k], dx), out);
            out = fma(floats(tb), mul(dw2[k], dx), out);
            continue;
          }
          VI t = dot<T>(w[k], qb + (u0 + k) / HALVES * qbytes(T), (u0 + k) % HALVES, xs, a.os + i);
          out = fma(floats(t), mul(dw[k], dx), out);
          if (with_min(T)) out = fma(mw[k], fsplat(a.ds[i]), out);
        }
      }
    }
  }
  float out[MAX_ROWS][PAIR * COLS];
  for (int m = 0; m < rows; m++)
    for (int u = 0; u < UNITS; u++) fstore(out[m] + u * LANES, acc[m][u]);
  store(out, rows, y, ldy, bias, ncols, add);
}

#else
#define GGUF_ISA "portable"

// The block integer of column j, input k (Q4_0: u - 8, Q5_0: u - 16, Q4_1, Q5_1 and Q4_K: u, Q6_K: u - 32,
// Q8_0: q) of one packed block.
template <int T>
inline int weight(const uint8_t* q, int j, int k) {
  if (T == Q8_0) return (int8_t)q[(k / 4) * 64 + j * 4 + k % 4];
  uint8_t byte = q[((k % 16) / 4) * 64 + j * 4 + k % 4];
  int u = k < 16 ? byte & 0x0f : byte >> 4;
  if (T == Q6_K) {
    uint8_t high = q[(4 + k / 16) * 64 + j * 4 + k % 4];
    return (u | ((high >> (2 * ((k % 16) / 4))) & 3) << 4) - 32;
  }
  if (five_bits(T)) u |= (q[4 * 64 + j * 4 + k % 4] >> ((k % 16) / 4 + (k < 16 ? 0 : 4)) & 1) << 4;
  return u - offset(T);
}

// Column j's float scales of block b (record rec): as block_scales in the vector paths.
template <int T>
inline void column_scales(const uint8_t* rec, long b, int j, float& dw, float& dw2, float& mw) {
  const uint16_t* d = (const uint16_t*)rec;
  int s = (int)(b % SUB);
  if (T == Q4_K) {
    dw = half_to_float(d[j]) * (float)rec[4 * COLS + s * COLS + j];
    mw = -(half_to_float(d[COLS + j]) * (float)rec[(4 + SUB) * COLS + s * COLS + j]);
  } else if (T == Q6_K) {
    dw = half_to_float(d[j]) * (float)(int8_t)rec[2 * COLS + 2 * s * COLS + j];
    dw2 = half_to_float(d[j]) * (float)(int8_t)rec[2 * COLS + (2 * s + 1) * COLS + j];
  } else {
    dw = half_to_float(d[j]);
    if (with_min(T)) mw = half_to_float(d[COLS + j]);
  }
}

template <int T>
void pair(const Acts& a, int rows, const uint8_t* q, const uint8_t* sc, float* y, long ldy, const float* bias,
          int ncols, int add) {
  const long blocks = a.K / QK;
  float acc[MAX_ROWS][PAIR * COLS] = {};
  for (long b = 0; b < blocks; b++)
    for (int p = 0; p < PAIR; p++) {
      const uint8_t* qb = q + (b * PAIR + p) * qbytes(T);
      const uint8_t* rec = sc + (b / per_record(T) * PAIR + p) * record_bytes(T);
      int8_t wb[COLS][QK];
      for (int j = 0; j < COLS; j++)
        for (int k = 0; k < QK; k++) wb[j][k] = (int8_t)weight<T>(qb, j, k);  // Q4_1's u fits too
      for (int m = 0; m < rows; m++) {
        long i = m * blocks + b;
        const int8_t* xm = a.q + m * a.K + b * QK;
        for (int j = 0; j < COLS; j++) {
          float dw = 0, dw2 = 0, mw = 0;
          column_scales<T>(rec, b, j, dw, dw2, mw);
          int t = 0, t2 = 0;
          for (int k = 0; k < QK; k++) (T == Q6_K && k >= 16 ? t2 : t) += wb[j][k] * xm[k];
          float& out = acc[m][p * COLS + j];
          out = fmaf((float)t, dw * a.d[i], out);
          if (T == Q6_K) out = fmaf((float)t2, dw2 * a.d[i], out);
          if (with_min(T)) out = fmaf(mw, a.ds[i], out);
        }
      }
    }
  store(acc, rows, y, ldy, bias, ncols, add);
}
#endif

// The activations of one product quantized per block: q [M, K] int8, d, s, os and ds [M, K / 32]
// (`Acts`), and for Q6_K the half sums s16 [M, K / 16].
struct Quantized {
  long K;
  bool halves;
  std::unique_ptr<int8_t[]> q;  // uninitialised: every byte is written by whoever quantizes
  std::unique_ptr<float[]> d, ds;
  std::unique_ptr<int32_t[]> s, s16, os;
  Quantized(long M, long K, bool halves)
      : K(K), halves(halves), q(new int8_t[M * K]), d(new float[M * K / QK]), ds(new float[M * K / QK]),
        s(new int32_t[M * K / QK]), s16(halves ? new int32_t[M * K / 16] : nullptr), os(new int32_t[M * K / QK]) {}
  // Rows m0.. as the products read them.
  Acts rows(long m0) const {
    long b = m0 * K / QK;
    return {q.get() + m0 * K, d.get() + b, s.get() + b, halves ? s16.get() + m0 * K / 16 : nullptr, os.get() + b, ds.get() + b, K};
  }
};

template <int T>
void gemm(const float* x, long M, long K, long ldx, const uint8_t* qs, const uint8_t* scales, long N,
          float* y, long ldy, const float* bias, int add) {
  const long blocks = K / QK, pairs = (N + PAIR * COLS - 1) / (PAIR * COLS);
  const long records = (blocks + per_record(T) - 1) / per_record(T);
  // Up to EACH blocks of activations, every thread quantizes all of them for itself and starts on its
  // pairs at once; more, the team splits them and waits for each other (a barrier per product: 1 to 2 us
  // of a thread spinning, against 20 ns a block quantized).
  const bool each = M * blocks <= EACH;
  std::unique_ptr<Quantized> shared(each ? nullptr : new Quantized(M, K, T == Q6_K));
  // Threads pay off only once the weights outgrow the cache of one core. The activations are
  // quantized by the same team: outside the region that serial work would leave the other threads waiting.
#pragma omp parallel if (N * K >= 65536)
  {
    std::unique_ptr<Quantized> own(each ? new Quantized(M, K, T == Q6_K) : nullptr);
    const Quantized& a = each ? *own : *shared;
    if (each) {
      quantize_rows(x, M, K, ldx, a.q.get(), a.d.get(), a.s.get());
      block_terms<T>(a.d.get(), a.s.get(), M * blocks, a.os.get(), a.ds.get());
      if (T == Q6_K) half_sums(a.q.get(), M, K, a.s16.get());
    } else {
#pragma omp for schedule(static)
      for (long i = 0; i < M * blocks; i++) {  // block i % blocks of row i / blocks
        quantize_rows(x + i / blocks * ldx + i % blocks * QK, 1, QK, ldx, a.q.get() + i * QK, a.d.get() + i, a.s.get() + i);
        block_terms<T>(a.d.get() + i, a.s.get() + i, 1, a.os.get() + i, a.ds.get() + i);
      }
      if (T == Q6_K) {
#pragma omp single
        half_sums(a.q.get(), M, K, a.s16.get());
      }
    }
#pragma omp for schedule(static)
    for (long p = 0; p < pairs; p++) {
      int ncols = (int)(N - p * PAIR * COLS < PAIR * COLS ? N - p * PAIR * COLS : PAIR * COLS);
      const uint8_t* qp = qs + p * blocks * PAIR * qbytes(T);
      const uint8_t* sp = scales + p * records * PAIR * record_bytes(T);
      for (long m0 = 0; m0 < M; m0 += MAX_ROWS) {
        int rows = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
        pair<T>(a.rows(m0), rows, qp, sp, y + m0 * ldy + p * PAIR * COLS, ldy, bias ? bias + p * PAIR * COLS : 0, ncols, add);
      }
    }
  }
}

}  // namespace

extern "C" const char* specsample_gguf_isa() { return GGUF_ISA; }

// The activation quantization the products use, for tests: q [M, K] int8, d and s [M, K / 32].
extern "C" void specsample_gguf_quantize(const float* x, long M, long K, long ldx, int8_t* q, float* d,
                                         int32_t* s) {
  quantize_rows(x, M, K, ldx, q, d, s);
}

// A matrix stacked from parts of different GGML types along its output rows (a fused QKV whose V is
// of another type than Q and K, as Q4_K_M files have): not a GGML type id.
enum { STACKED = 1000 };

// y[M, N] (+)= x[M, K] @ W^T (+ bias) for W of GGML type `type` (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0,
// 12 Q4_K, 14 Q6_K) packed as qs and scales (above: fp16 scales, or a K type's records); K a multiple of 32
// (of 256 for K types); row strides ldx, ldy. Or, for type STACKED (1000), qs is an int64 table
// [count, then per part: type, rows, qs, scales] whose parts, each one of those types, give the
// rows of W in order (their rows summing to N; scales unused), each part computed as alone.
// Returns 0, or -1 for a type it does not know or a table that does not add up (y then undefined).
extern "C" int specsample_gemm_gguf(int type, const float* x, long M, long K, long ldx, const uint8_t* qs,
                                    const uint16_t* scales, long N, float* y, long ldy, const float* bias,
                                    int add) {
  const uint8_t* sc = (const uint8_t*)scales;
  switch (type) {
    case Q4_0: gemm<Q4_0>(x, M, K, ldx, qs, sc, N, y, ldy, bias, add); return 0;
    case Q4_1: gemm<Q4_1>(x, M, K, ldx, qs, sc, N, y, ldy, bias, add); return 0;
    case Q5_0: gemm<Q5_0>(x, M, K, ldx, qs, sc, N, y, ldy, bias, add); return 0;
    case Q5_1: gemm<Q5_1>(x, M, K, ldx, qs, sc, N, y, ldy, bias, add); return 0;
    case Q8_0: gemm<Q8_0>(x, M, K, ldx, qs, sc, N, y, ldy, bias, add); return 0;
    case Q4_K: gemm<Q4_K>(x, M, K, ldx, qs, sc, N, y, ldy, bias, add); return 0;
    case Q6_K: gemm<Q6_K>(x, M, K, ldx, qs, sc, N, y, ldy, bias, add); return 0;
    case STACKED: {
      const int64_t* table = (const int64_t*)qs;
      long row = 0;
      for (int64_t i = 0; i < table[0]; i++) {
        const int64_t* part = table + 1 + 4 * i;
        if (part[0] == STACKED || row + part[1] > N) return -1;
        if (specsample_gemm_gguf((int)part[0], x, M, K, ldx, (const uint8_t*)part[2], (const uint16_t*)part[3], part[1],
                                 y + row, ldy, bias ? bias + row : 0, add))
          return -1;
        row += part[1];
      }
      return row == N ? 0 : -1;
    }
    default: return -1;
  }
}
