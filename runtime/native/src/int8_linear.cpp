// mtp_edge::linear_i8.out(Tensor input, Tensor weight, Tensor weight_scale, Tensor weight_sum,
//                         Tensor? bias, *, Tensor(a!) out) -> Tensor(a!)
// A linear layer with int8 weights (one scale per output channel) and int8 activations
// quantized per row at run time, asymmetrically: the numbers of XNNPACK's 8da8w, computed by a
// kernel of ours (mtp_edge/ops.py defines the op and its eager reference, bit for bit).
//
// Why our own: on a CPU without an int8 dot product (AVX2) XNNPACK's int8 GEMM takes 4 rows at a
// time, so a 5-row verification reads every weight twice (2.0x a decode's linear time instead of
// 1.2x, benchmarks/README.md). Here a tile takes up to 6 rows: the weights are read once for
// a verification of up to 5 drafts. The sums are exact integers, so every version (AVX2, plain
// C++ on any other CPU) and every tile gives a row the same bits, whatever rows share the call.
//
// Layouts. input [..., K] float; out [..., N]. weight: int8, in blocks of 16 output channels
// (N padded to a multiple of 16 with zero rows), each block K2 / 2 pairs of input columns (K
// padded to even, K2) of 32 bytes: channels 0-7 as (k, k + 1) pairs, then channels 8-15.
// weight_scale float [N], weight_sum int32 [N] (each channel's sum of weights), bias float [N].
#include "int8_linear.h"
#include "threadpool.h"

#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>

#include <executorch/runtime/core/event_tracer_hooks.h>
#include <executorch/runtime/core/function_ref.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(MTP_EDGE_BASELINE)
#include <immintrin.h>
#define MTP_INT8_AVX2 1
#endif

// A scaled sum and its bias are two roundings on every CPU: no fused multiply-add (aarch64's
// compilers fuse by default), so a phone computes a laptop's bits.
#pragma GCC optimize("fp-contract=off")

namespace mtp {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::Span;

constexpr int kCols = 16;   // output channels per block
constexpr int kRowsMax = 6; // rows per tile: 12 sums + 2 weight registers + 1 broadcast of 16
constexpr int kPrefetchAhead = 2048;  // bytes of weights between a prefetch and its use

// Row r's activations quantized: `pairs` int32 words, each two int16 (columns 2p, 2p + 1; the
// padding column 0), with its scale and zero point. The rule is ops.py's quantize_rows: the
// range [min(x, 0), max(x, 0)] over 255 steps, scale at least float32's epsilon, values and zero
// point rounded half to even and clamped to int8. `from` is where the plain loop takes over
// (the AVX2 version does the columns before it); every step is one IEEE operation, so both
// give the same values.
float row_scale(float lo, float hi, int32_t* zero) {
  float s = (hi - lo) / 255.f;
  if (!(s >= 1.1920928955078125e-07f)) s = 1.1920928955078125e-07f;
  const float z = std::nearbyint(-128.f - lo / s);
  *zero = int32_t(std::min(127.f, std::max(-128.f, z)));
  return s;
}

void quantize_tail(const float* x, int64_t K, int64_t from, int64_t pairs, float s, int32_t zp,
                   int16_t* q) {
  for (int64_t k = from; k < 2 * pairs; ++k) {
    if (k >= K) {
      q[k] = 0;
      continue;
    }
    const float v = std::nearbyint(x[k] / s) + float(zp);
    q[k] = int16_t(std::min(127.f, std::max(-128.f, v)));
  }
}

void quantize_row(const float* x, int64_t K, int64_t pairs, int32_t* q, float* scale,
                  int32_t* zero) {
  float lo = 0.f, hi = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    lo = std::min(lo, x[k]);
    hi = std::max(hi, x[k]);
  }
  *scale = row_scale(lo, hi, zero);
  quantize_tail(x, K, 0, pairs, *scale, *zero, reinterpret_cast<int16_t*>(q));
}

// What a tile's sums become: out = float(sum - zero x channel's weight sum) x (row scale x
// channel scale), plus the bias. y, ws, wsum and bias start at the block's first channel, y at
// the tile's first row; xs and zp at that row.
struct Finish {
  float* y;
  int64_t N;     // floats between rows of y
  int64_t cols;  // channels of this block (16, fewer in the last)
  const float* xs;
  const int32_t* zp;
  const float* ws;
  const int32_t* wsum;
  const float* bias;  // or nullptr
};

void finish_plain(const int32_t* sums, int rows, const Finish& f) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < f.cols; ++c) {
      // Two roundings, in this order, as ops.py's reference: the scale product, then the
      // scaled sum (no fused multiply-add: see the pragma above); then the bias.
      const float scale = f.xs[r] * f.ws[c];
      float v = float(sums[r * kCols + c] - f.zp[r] * f.wsum[c]) * scale;
      if (f.bias != nullptr) v += f.bias[c];
      f.y[r * f.N + c] = v;
    }
}

// R rows x 16 channels of one block: sum over k of q[r][k] w[c][k], finished into f.y.
template <int R>
void tile_plain(const int8_t* w, const int32_t* q, int64_t qstep, int64_t pairs,
                const Finish& f) {
  int32_t acc[R][kCols] = {};
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* wp = w + 32 * p;
    for (int r = 0; r < R; ++r) {
      const uint32_t word = uint32_t(q[r * qstep + p]);
      const int32_t a = int16_t(word & 0xffff), b = int16_t(word >> 16);
      for (int c = 0; c < kCols; ++c) {
        const int8_t* pair = wp + (c / 8) * 16 + (c % 8) * 2;
        acc[r][c] += a * pair[0] + b * pair[1];
      }
    }
  }
  finish_plain(&acc[0][0], R, f);
}

#ifdef MTP_INT8_AVX2
__attribute__((target("avx2"))) void quantize_row_avx2(const float* x, int64_t K, int64_t pairs,
                                                       int32_t* q, float* scale,
                                                       int32_t* zero) {
  __m256 lo8 = _mm256_setzero_ps(), hi8 = lo8;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    lo8 = _mm256_min_ps(lo8, v);
    hi8 = _mm256_max_ps(hi8, v);
  }
  alignas(32) float los[8], his[8];
  _mm256_store_ps(los, lo8);
  _mm256_store_ps(his, hi8);
  float lo = 0.f, hi = 0.f;
  for (int i = 0; i < 8; ++i) {
    lo = std::min(lo, los[i]);
    hi = std::max(hi, his[i]);
  }
  for (; k < K; ++k) {
    lo = std::min(lo, x[k]);
    hi = std::max(hi, x[k]);
  }
  const float s = row_scale(lo, hi, zero);
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(float(*zero));
  const __m256 low = _mm256_set1_ps(-128.f), high = _mm256_set1_ps(127.f);
  int16_t* out = reinterpret_cast<int16_t*>(q);
  auto eight = [&](int64_t at) {
    const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + at), sv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvttps_epi32(_mm256_min_ps(high, _mm256_max_ps(low, _mm256_add_ps(v, zv))));
  };
  for (k = 0; k + 16 <= K; k += 16) {
    const __m256i packed = _mm256_packs_epi32(eight(k), eight(k + 8));  // lanes 0 2 1 3
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
  quantize_tail(x, K, k, pairs, s, *zero, out);
}

// The same with AVX2: each pair of columns is one vpmaddwd of 16-bit weights (sign-extended once
// for all rows) by the row's broadcast pair, into 8 int32 sums per register; the sums are
// exact, so this is tile_plain's result, and so is the finish (the same IEEE operations, lane by
// lane). Named registers, not an array: GCC spilled the array's sums to the stack at every step
// (2x slower at 5 rows).
template <int R>
__attribute__((target("avx2"))) void tile_avx2(const int8_t* w, const int32_t* q, int64_t qstep,
                                               int64_t pairs, const Finish& f) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
#define MTP_ROW(r, A, B)                                                        \
  if constexpr (R > r) {                                                        \
    const __m256i x = _mm256_set1_epi32(q[r * qstep + p]);                      \
    A = _mm256_add_epi32(A, _mm256_madd_epi16(lo, x));                          \
    B = _mm256_add_epi32(B, _mm256_madd_epi16(hi, x));                          \
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* wp = w + 32 * p;
    // Lines 2 KB ahead of the reads: the tile is compute-bound at 5-6 rows, and the prefetch
    // keeps memory busy meanwhile. 2 KB is 64 steps, ~0.1-0.2 us at 5 rows, about a memory
    // latency (the model's linears at 5 rows: 1.67-1.83 one-row calls without a prefetch,
    // 1.52-1.68 at 512 bytes ahead, 1.25-1.43 at 2-4 KB; benchmarks/README.md).
    if ((p & 1) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchAhead), _MM_HINT_T0);
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
    const __m256i hi =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
    MTP_ROW(0, a0, b0) MTP_ROW(1, a1, b1) MTP_ROW(2, a2, b2)
    MTP_ROW(3, a3, b3) MTP_ROW(4, a4, b4) MTP_ROW(5, a5, b5)
  }
#undef MTP_ROW
  // The sums leave their registers once, here: finishing them from the registers made GCC keep
  // a copy of every sum on the stack at each step of the loop (45 instructions a step, not 27).
  alignas(32) int32_t sums[R * kCols];
#define MTP_STORE(r, A, B)                                                        \
  if constexpr (R > r) {                                                          \
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + r * kCols), A);          \
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + r * kCols + 8), B);      \
  }
  MTP_STORE(0, a0, b0) MTP_STORE(1, a1, b1) MTP_STORE(2, a2, b2)
  MTP_STORE(3, a3, b3) MTP_STORE(4, a4, b4) MTP_STORE(5, a5, b5)
#undef MTP_STORE
  if (f.cols < kCols) {  // the last block's few channels: the plain finish
    finish_plain(sums, R, f);
    return;
  }
  for (int half = 0; half < 2; ++half) {
    const int c = 8 * half;
    const __m256i sw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f.wsum + c));
    const __m256 ws = _mm256_loadu_ps(f.ws + c);
    const __m256 bias = f.bias ? _mm256_loadu_ps(f.bias + c) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256i sum = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums + r * kCols + c));
      const __m256i z = _mm256_set1_epi32(f.zp[r]);
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(f.xs[r]), ws);
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum, _mm256_mullo_epi32(z, sw))),
                               scale);
      if (f.bias != nullptr) v = _mm256_add_ps(v, bias);
      _mm256_storeu_ps(f.y + r * f.N + c, v);
    }
  }
}
#endif

// ---- mtp_edge::linear_i4: 4-bit weights in groups of kGroup4 input columns ----
//
// mtp_edge::linear_i4.out(Tensor input, Tensor weight, Tensor weight_scale, Tensor weight_sum,
//                         Tensor? bias, *, Tensor(a!) out) -> Tensor(a!)
// Weights in [-8, 7] with a float16 scale per group of 32 input columns of a channel, int8
// activations as linear_i8's. Why our own: XNNPACK's groupwise 4-bit GEMM on AVX2 takes 3 rows
// at a time, so a 5-row verification reads the weights twice and computes 2.1-2.2 decodes'
// time (benchmarks/README.md); this tile takes 6 rows. Layout (ops.py pack_weight4): blocks of
// 16 channels, per group per 4 columns 32 bytes, byte 4 l + i = column 4 j + i of channel l in
// the low nibble and of channel 8 + l in the high one, as value + 8; scales per block per group
// 16 float16; weight_sum float [N] (the zero point's term, ops.py weight4_sum).
//
// Per row and channel: S = a group's sum of value x activation (exact: AVX2 multiplies the
// stored value + 8 with vpmaddubsw and subtracts 8 x the group's activation sum), acc +=
// float(S) x scale group by group, out = (acc - zero x weight_sum) x row scale + bias: the same
// float32 operations in the same order on every CPU and tile, so a row's bits never depend on
// the rows beside it.

constexpr int kGroup4 = 32;

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Row activations as int8 (K a multiple of kGroup4) with each group's sum.
void quantize_row8(const float* x, int64_t K, int8_t* q, int32_t* group_sum, float* scale,
                   int32_t* zero) {
  float lo = 0.f, hi = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    lo = std::min(lo, x[k]);
    hi = std::max(hi, x[k]);
  }
  const float s = row_scale(lo, hi, zero);
  *scale = s;
  for (int64_t g = 0; g < K / kGroup4; ++g) {
    int32_t sum = 0;
    for (int64_t k = g * kGroup4; k < (g + 1) * kGroup4; ++k) {
      const float v = std::nearbyint(x[k] / s) + float(*zero);
      q[k] = int8_t(std::min(127.f, std::max(-128.f, v)));
      sum += q[k];
    }
    group_sum[g] = sum;
  }
}

struct Tile4 {
  const uint8_t* w;        // the block's first group
  const uint16_t* scales;  // the block's first group's 16 scales
  const int8_t* q;         // the tile's first row
  const int32_t* asum;     // its group sums
  int64_t K, groups;       // q's row stride is K, asum's groups
  Finish f;                // ws = nullptr; wsum unused: zterm below
  const float* zterm;      // weight_sum at the block's first channel
};

void finish4(const float* acc, int rows, const Tile4& t) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < t.f.cols; ++c) {
      float v = acc[r * kCols + c] - float(t.f.zp[r]) * t.zterm[c];
      v = v * t.f.xs[r];
      if (t.f.bias != nullptr) v += t.f.bias[c];
      t.f.y[r * t.f.N + c] = v;
    }
}

template <int R>
void tile4_plain(const Tile4& t) {
  float acc[R * kCols] = {};
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* wg = t.w + g * kGroup4 * kCols / 2;
    for (int r = 0; r < R; ++r) {
      const int8_t* q = t.q + r * t.K + g * kGroup4;
      for (int c = 0; c < kCols; ++c) {
        int32_t sum = 0;
        for (int k = 0; k < kGroup4; ++k) {
          const uint8_t byte = wg[(k / 4) * 32 + (c % 8) * 4 + k % 4];
          const int32_t value = int32_t(c < 8 ? byte & 15 : byte >> 4) - 8;
          sum += value * q[k];
        }
        acc[r * kCols + c] += float(sum) * half_to_float(t.scales[g * kCols + c]);
      }
    }
  }
  finish4(acc, R, t);
}

#ifdef MTP_INT8_AVX2
__attribute__((target("avx2"))) void quantize_row8_avx2(const float* x, int64_t K, int8_t* q,
                                                        int32_t* group_sum, float* scale,
                                                        int32_t* zero) {
  __m256 lo8 = _mm256_setzero_ps(), hi8 = lo8;
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    lo8 = _mm256_min_ps(lo8, v);
    hi8 = _mm256_max_ps(hi8, v);
  }
  alignas(32) float los[8], his[8];
  _mm256_store_ps(los, lo8);
  _mm256_store_ps(his, hi8);
  float lo = 0.f, hi = 0.f;
  for (int i = 0; i < 8; ++i) {
    lo = std::min(lo, los[i]);
    hi = std::max(hi, his[i]);
  }
  const float s = row_scale(lo, hi, zero);
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(float(*zero));
  const __m256 low = _mm256_set1_ps(-128.f), high = _mm256_set1_ps(127.f);
  auto eight = [&](int64_t at) {
    const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + at), sv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvttps_epi32(_mm256_min_ps(high, _mm256_max_ps(low, _mm256_add_ps(v, zv))));
  };
  for (int64_t g = 0; g < K / kGroup4; ++g) {
    const int64_t k = g * kGroup4;
    const __m256i a = eight(k), b = eight(k + 8), c = eight(k + 16), d = eight(k + 24);
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    group_sum[g] = _mm_cvtsi128_si32(s4);
    // int32 -> int16 -> int8 with saturation (values are in range): lanes 0 2 1 3 twice over.
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    const __m256i bytes = _mm256_packs_epi16(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 ...
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
}

// R rows x 16 channels. Per group each row's products go into two int16 registers (8 steps of
// vpmaddubsw: |sum| <= 8 x 2 x 15 x 128 = 30720, no saturation), then become int32 (vpmaddwd by
// ones), lose 8 x the group's activation sum, and join the float sums. The float sums live in
// an array (the int16 ones take the registers).
template <int R>
__attribute__((target("avx2,f16c"))) void tile4_avx2(const Tile4& t) {
  alignas(32) float acc[R * kCols] = {};
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* wg = t.w + g * kGroup4 * kCols / 2;
    _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + 192), _MM_HINT_T0);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    const int8_t* qg = t.q + g * kGroup4;
#define MTP_ROW4(r, A, B)                                                                   \
  if constexpr (R > r) {                                                                    \
    int32_t word;                                                                           \
    std::memcpy(&word, qg + r * t.K + 4 * j, 4);                                            \
    const __m256i x = _mm256_set1_epi32(word);                                              \
    A = _mm256_add_epi16(A, _mm256_maddubs_epi16(lo, x));                                   \
    B = _mm256_add_epi16(B, _mm256_maddubs_epi16(hi, x));                                   \
  }
    for (int j = 0; j < kGroup4 / 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * j));
      const __m256i lo = _mm256_and_si256(v, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      MTP_ROW4(0, a0, b0) MTP_ROW4(1, a1, b1) MTP_ROW4(2, a2, b2)
      MTP_ROW4(3, a3, b3) MTP_ROW4(4, a4, b4) MTP_ROW4(5, a5, b5)
    }
#undef MTP_ROW4
    const __m128i* sp = reinterpret_cast<const __m128i*>(t.scales + g * kCols);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(sp));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(sp + 1));
    const __m256i ones = _mm256_set1_epi16(1);
#define MTP_GROUP4(r, A, B)                                                                  \
  if constexpr (R > r) {                                                                     \
    const __m256i eight = _mm256_set1_epi32(8 * t.asum[r * t.groups + g]);                   \
    const __m256 lo_sum =                                                                    \
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(A, ones), eight));              \
    const __m256 hi_sum =                                                                    \
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(B, ones), eight));              \
    float* row = acc + r * kCols;                                                            \
    _mm256_store_ps(row, _mm256_add_ps(_mm256_load_ps(row), _mm256_mul_ps(lo_sum, s0)));     \
    _mm256_store_ps(row + 8, _mm256_add_ps(_mm256_load_ps(row + 8), _mm256_mul_ps(hi_sum, s1))); \
  }
    MTP_GROUP4(0, a0, b0) MTP_GROUP4(1, a1, b1) MTP_GROUP4(2, a2, b2)
    MTP_GROUP4(3, a3, b3) MTP_GROUP4(4, a4, b4) MTP_GROUP4(5, a5, b5)
#undef MTP_GROUP4
  }
  if (t.f.cols < kCols) {
    finish4(acc, R, t);
    return;
  }
  for (int half = 0; half < 2; ++half) {
    const int c = 8 * half;
    const __m256 zterm = _mm256_loadu_ps(t.zterm + c);
    const __m256 bias = t.f.bias ? _mm256_loadu_ps(t.f.bias + c) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256 z = _mm256_set1_ps(float(t.f.zp[r]));
      __m256 v = _mm256_sub_ps(_mm256_load_ps(acc + r * kCols + c), _mm256_mul_ps(z, zterm));
      v = _mm256_mul_ps(v, _mm256_set1_ps(t.f.xs[r]));
      if (t.f.bias != nullptr) v = _mm256_add_ps(v, bias);
      _mm256_storeu_ps(t.f.y + r * t.f.N + c, v);
    }
  }
}
#endif

// ---- mtp_edge::linear_i6: 6-bit weights, linear_i4's groups, scales and arithmetic ----
//
// Values in [-32, 31], stored as value + 32 (ops.py pack_weight6): per block per group 384
// bytes, the low 4 bits as linear_i4's 256, then the top 2 bits, 16 bytes per 4 columns, byte
// 4 l + i holding in bits 0-1, 2-3, 4-5, 6-7 column 4 j + i of channels l, 8 + l, 4 + l, 12 + l
// (so one 16-byte load, seen twice, gives the two halves of the 32 low bytes their top bits).
// A group's sum is exact as linear_i4's (|S| <= 32 x 32 x 128), so the rows are the same bits
// on every CPU and tile. For an LM head: llama.cpp's Q4_K_M keeps its output tensor in 6 bits.

constexpr int kGroup6Bytes = kGroup4 * kCols * 3 / 4;

template <int R>
void tile6_plain(const Tile4& t) {
  float acc[R * kCols] = {};
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* wg = t.w + g * kGroup6Bytes;
    for (int r = 0; r < R; ++r) {
      const int8_t* q = t.q + r * t.K + g * kGroup4;
      for (int c = 0; c < kCols; ++c) {
        const int l = c % 8, half = c / 8;
        int32_t sum = 0;
        for (int k = 0; k < kGroup4; ++k) {
          const int j = k / 4, i = k % 4;
          const uint8_t byte = wg[j * 32 + l * 4 + i];
          const int low = half == 0 ? byte & 15 : byte >> 4;
          const uint8_t tops = wg[256 + j * 16 + (l % 4) * 4 + i];
          const int top = (tops >> (2 * (2 * (l / 4) + half))) & 3;
          sum += (int32_t(low | (top << 4)) - 32) * q[k];
        }
        acc[r * kCols + c] += float(sum) * half_to_float(t.scales[g * kCols + c]);
      }
    }
  }
  finish4(acc, R, t);
}

#ifdef MTP_INT8_AVX2
// R rows x 16 channels, as tile4_avx2 but the int16 products widen to int32 every two steps of
// 4 columns (a step's pair sums reach 2 x 63 x 128 = 16128, two steps 32256 < 32768).
template <int R>
__attribute__((target("avx2,f16c"))) void tile6_avx2(const Tile4& t) {
  alignas(32) float acc[R * kCols] = {};
  const __m256i nibble = _mm256_set1_epi8(15), top_bits = _mm256_set1_epi8(0x30);
  const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* wg = t.w + g * kGroup6Bytes;
    for (int ahead = 0; ahead < kGroup6Bytes; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + ahead), _MM_HINT_T0);
    __m256i lo32[R], hi32[R];
    for (int r = 0; r < R; ++r) lo32[r] = hi32[r] = _mm256_setzero_si256();
    const int8_t* qg = t.q + g * kGroup4;
    for (int j = 0; j < kGroup4 / 4; j += 2) {
      __m256i lo[2], hi[2];
      for (int s = 0; s < 2; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * (j + s)));
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 256 + 16 * (j + s)));
        // Bytes 0-15 take bits 0-3 of h, bytes 16-31 bits 4-7; then each field to bits 4-5.
        const __m256i x = _mm256_srlv_epi32(_mm256_broadcastsi128_si256(h), lanes);
        lo[s] = _mm256_or_si256(_mm256_and_si256(v, nibble),
                                _mm256_and_si256(_mm256_slli_epi16(x, 4), top_bits));
        hi[s] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                                _mm256_and_si256(_mm256_slli_epi16(x, 2), top_bits));
      }
      for (int r = 0; r < R; ++r) {
        int32_t w0, w1;
        std::memcpy(&w0, qg + r * t.K + 4 * j, 4);
        std::memcpy(&w1, qg + r * t.K + 4 * j + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(w0), x1 = _mm256_set1_epi32(w1);
        const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], x0),
                                           _mm256_maddubs_epi16(lo[1], x1));
        const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], x0),
                                           _mm256_maddubs_epi16(hi[1], x1));
        lo32[r] = _mm256_add_epi32(lo32[r], _mm256_madd_epi16(a, ones));
        hi32[r] = _mm256_add_epi32(hi32[r], _mm256_madd_epi16(b, ones));
      }
    }
    const __m128i* sp = reinterpret_cast<const __m128i*>(t.scales + g * kCols);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(sp));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(sp + 1));
    for (int r = 0; r < R; ++r) {
      const __m256i offset = _mm256_set1_epi32(32 * t.asum[r * t.groups + g]);
      const __m256 lo_sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(lo32[r], offset));
      const __m256 hi_sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(hi32[r], offset));
      float* row = acc + r * kCols;
      _mm256_store_ps(row, _mm256_add_ps(_mm256_load_ps(row), _mm256_mul_ps(lo_sum, s0)));
      _mm256_store_ps(row + 8, _mm256_add_ps(_mm256_load_ps(row + 8), _mm256_mul_ps(hi_sum, s1)));
    }
  }
  finish4(acc, R, t);
}
#endif

using Tile4Fn = void (*)(const Tile4&);

bool use_avx2();

Tile4Fn tile4(int rows) {
#ifdef MTP_INT8_AVX2
  static const Tile4Fn avx2[] = {nullptr,       tile4_avx2<1>, tile4_avx2<2>, tile4_avx2<3>,
                                 tile4_avx2<4>, tile4_avx2<5>, tile4_avx2<6>};
  static const bool f16c = bool(__builtin_cpu_supports("f16c"));
  if (use_avx2() && f16c) return avx2[rows];
#endif
  static const Tile4Fn plain[] = {nullptr,        tile4_plain<1>, tile4_plain<2>, tile4_plain<3>,
                                  tile4_plain<4>, tile4_plain<5>, tile4_plain<6>};
  return plain[rows];
}

Tile4Fn tile6(int rows) {
#ifdef MTP_INT8_AVX2
  static const Tile4Fn avx2[] = {nullptr,       tile6_avx2<1>, tile6_avx2<2>, tile6_avx2<3>,
                                 tile6_avx2<4>, tile6_avx2<5>, tile6_avx2<6>};
  static const bool f16c = bool(__builtin_cpu_supports("f16c"));
  if (use_avx2() && f16c) return avx2[rows];
#endif
  static const Tile4Fn plain[] = {nullptr,        tile6_plain<1>, tile6_plain<2>, tile6_plain<3>,
                                  tile6_plain<4>, tile6_plain<5>, tile6_plain<6>};
  return plain[rows];
}

using TileFn = void (*)(const int8_t*, const int32_t*, int64_t, int64_t, const Finish&);

// 1: AVX2, 0: plain; MTP_EDGE_INT8_LINEAR=plain takes the plain version on any CPU (the tests
// compare the two).
bool use_avx2() {
  static const bool avx2 = [] {
#ifdef MTP_INT8_AVX2
    __builtin_cpu_init();
    const char* asked = std::getenv("MTP_EDGE_INT8_LINEAR");
    if (asked != nullptr && std::strcmp(asked, "plain") == 0) return false;
    return bool(__builtin_cpu_supports("avx2"));
#else
    return false;
#endif
  }();
  return avx2;
}

TileFn tile(int rows) {
#ifdef MTP_INT8_AVX2
  static const TileFn avx2[] = {nullptr,      tile_avx2<1>, tile_avx2<2>, tile_avx2<3>,
                                tile_avx2<4>, tile_avx2<5>, tile_avx2<6>};
  if (use_avx2()) return avx2[rows];
#endif
  static const TileFn plain[] = {nullptr,       tile_plain<1>, tile_plain<2>, tile_plain<3>,
                                 tile_plain<4>, tile_plain<5>, tile_plain<6>};
  return plain[rows];
}

bool check(KernelRuntimeContext& ctx, bool ok, const char* what) {
  if (!ok) {
    ET_LOG(Error, "mtp_edge::linear_i8: %s", what);
    ctx.fail(Error::InvalidArgument);
  }
  return ok;
}

void linear_i8(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  // An event of its own in a profiled run (benchmarks/op_profile.py), as ExecuTorch's kernels.
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 "mtp_edge::linear_i8.out");
  const Tensor& input = stack[0]->toTensor();
  const Tensor& weight = stack[1]->toTensor();
  const Tensor& wscale = stack[2]->toTensor();
  const Tensor& wsum = stack[3]->toTensor();
  const bool has_bias = !stack[4]->isNone();
  Tensor& out = stack[5]->toTensor();
  if (!check(ctx, input.dim() >= 1 && input.scalar_type() == ScalarType::Float,
             "float input expected") ||
      !check(ctx, weight.scalar_type() == ScalarType::Char && wscale.dim() == 1 &&
                      wscale.scalar_type() == ScalarType::Float &&
                      wsum.scalar_type() == ScalarType::Int && wsum.numel() == wscale.numel(),
             "int8 weight, float scales and int32 sums expected"))
    return;
  const int64_t K = input.size(input.dim() - 1), N = wscale.numel();
  const int64_t pairs = (K + 1) / 2, blocks = (N + kCols - 1) / kCols;
  if (!check(ctx, weight.numel() == blocks * kCols * pairs * 2,
             "weight size does not match the input width and the channels") ||
      !check(ctx, !has_bias || (stack[4]->toTensor().numel() == N &&
                                stack[4]->toTensor().scalar_type() == ScalarType::Float),
             "bias must be float [N]"))
    return;
  SizesType sizes[16];
  if (!check(ctx, input.dim() <= 16, "too many dimensions")) return;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) sizes[d] = input.size(d);
  sizes[input.dim() - 1] = SizesType(N);
  if (!check(ctx,
             executorch::runtime::resize_tensor(out, {sizes, size_t(input.dim())}) == Error::Ok,
             "cannot resize the output"))
    return;
  const int64_t T = K > 0 ? input.numel() / K : 0;
  if (T == 0) return;

  const float* x = input.const_data_ptr<float>();
  thread_local std::vector<int32_t> quantized;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> zeros;
  quantized.resize(size_t(T * pairs));
  scales.resize(size_t(T));
  zeros.resize(size_t(T));
#ifdef MTP_INT8_AVX2
  const auto quantize = use_avx2() ? quantize_row_avx2 : quantize_row;
#else
  const auto quantize = quantize_row;
#endif
  for (int64_t t = 0; t < T; ++t)
    quantize(x + t * K, K, pairs, quantized.data() + t * pairs, &scales[t], &zeros[t]);

  const int8_t* w = weight.const_data_ptr<int8_t>();
  const float* ws = wscale.const_data_ptr<float>();
  const int32_t* sum_w = wsum.const_data_ptr<int32_t>();
  const float* bias = has_bias ? stack[4]->toTensor().const_data_ptr<float>() : nullptr;
  float* y = out.mutable_data_ptr<float>();
  const int32_t* q = quantized.data();
  const float* xs = scales.data();
  const int32_t* zp = zeros.data();
  // A task is a few blocks of channels for every row: a block's weights are read from memory
  // once and stay in the core's cache for the next group of rows.
  constexpr int64_t kBlocksPerTask = 4;
  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  auto task = [&](size_t index) {
    const int64_t first = int64_t(index) * kBlocksPerTask;
    const int64_t last = std::min(blocks, first + kBlocksPerTask);
    for (int64_t b = first; b < last; ++b) {
      const int8_t* wb = w + b * kCols * pairs * 2;
      const int64_t c0 = b * kCols;
      for (int64_t t0 = 0; t0 < T; t0 += kRowsMax) {
        const int rows = int(std::min<int64_t>(kRowsMax, T - t0));
        const Finish f{y + t0 * N + c0, N, std::min<int64_t>(kCols, N - c0), xs + t0, zp + t0,
                       ws + c0, sum_w + c0, bias != nullptr ? bias + c0 : nullptr};
        tile(rows)(wb, q + t0 * pairs, pairs, pairs, f);
      }
    }
  };
  if (tasks == 1) {
    task(0);
    return;
  }
  executorch::extension::threadpool::get_threadpool()->run(task, size_t(tasks));
}

// linear_i4 and linear_i6: `bits` 4 or 6, the same checks, rows and tasks.
void grouped_linear(KernelRuntimeContext& ctx, Span<EValue*> stack, int bits) {
  const Tensor& input = stack[0]->toTensor();
  const Tensor& weight = stack[1]->toTensor();
  const Tensor& wscale = stack[2]->toTensor();
  const Tensor& wsum = stack[3]->toTensor();
  const bool has_bias = !stack[4]->isNone();
  Tensor& out = stack[5]->toTensor();
  const char* name = bits == 4 ? "mtp_edge::linear_i4" : "mtp_edge::linear_i6";
  auto ok = [&](bool good, const char* what) {
    if (!good) {
      ET_LOG(Error, "%s: %s", name, what);
      ctx.fail(Error::InvalidArgument);
    }
    return good;
  };
  if (!ok(input.dim() >= 1 && input.scalar_type() == ScalarType::Float, "float input expected") ||
      !ok(weight.scalar_type() == ScalarType::Byte && wscale.scalar_type() == ScalarType::Half &&
              wsum.dim() == 1 && wsum.scalar_type() == ScalarType::Float,
          "uint8 weight, float16 scales and float sums expected"))
    return;
  const int64_t K = input.size(input.dim() - 1), N = wsum.numel();
  const int64_t blocks = (N + kCols - 1) / kCols, groups = K / kGroup4;
  if (!ok(K % kGroup4 == 0, "input width must be a multiple of 32") ||
      !ok(weight.numel() == blocks * kCols * K * bits / 8 &&
              wscale.numel() == blocks * kCols * groups,
          "weight size does not match the input width and the channels") ||
      !ok(!has_bias || (stack[4]->toTensor().numel() == N &&
                        stack[4]->toTensor().scalar_type() == ScalarType::Float),
          "bias must be float [N]") ||
      !ok(input.dim() <= 16, "too many dimensions"))
    return;
  SizesType sizes[16];
  for (int64_t d = 0; d + 1 < input.dim(); ++d) sizes[d] = input.size(d);
  sizes[input.dim() - 1] = SizesType(N);
  if (!ok(executorch::runtime::resize_tensor(out, {sizes, size_t(input.dim())}) == Error::Ok,
          "cannot resize the output"))
    return;
  const int64_t T = K > 0 ? input.numel() / K : 0;
  if (T == 0) return;

  const float* x = input.const_data_ptr<float>();
  thread_local std::vector<int8_t> quantized;
  thread_local std::vector<int32_t> sums;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> zeros;
  quantized.resize(size_t(T * K));
  sums.resize(size_t(T * groups));
  scales.resize(size_t(T));
  zeros.resize(size_t(T));
#ifdef MTP_INT8_AVX2
  const auto quantize = use_avx2() ? quantize_row8_avx2 : quantize_row8;
#else
  const auto quantize = quantize_row8;
#endif
  for (int64_t t = 0; t < T; ++t)
    quantize(x + t * K, K, quantized.data() + t * K, sums.data() + t * groups, &scales[t],
             &zeros[t]);

  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.const_data_ptr<void>());
  const float* zterm = wsum.const_data_ptr<float>();
  const float* bias = has_bias ? stack[4]->toTensor().const_data_ptr<float>() : nullptr;
  float* y = out.mutable_data_ptr<float>();
  // Pointers, not the thread_local vectors, go to the tasks: a pool thread has its own (empty).
  const int8_t* q = quantized.data();
  const int32_t* asum = sums.data();
  const float* xs = scales.data();
  const int32_t* zp = zeros.data();
  constexpr int64_t kBlocksPerTask = 4;
  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  auto task = [&](size_t index) {
    const int64_t first = int64_t(index) * kBlocksPerTask;
    const int64_t last = std::min(blocks, first + kBlocksPerTask);
    for (int64_t b = first; b < last; ++b) {
      const int64_t c0 = b * kCols;
      for (int64_t t0 = 0; t0 < T; t0 += kRowsMax) {
        const int rows = int(std::min<int64_t>(kRowsMax, T - t0));
        const Finish f{y + t0 * N + c0, N, std::min<int64_t>(kCols, N - c0), xs + t0, zp + t0,
                       nullptr, nullptr, bias != nullptr ? bias + c0 : nullptr};
        const Tile4 tile{w + b * kCols * K * bits / 8, ws + b * groups * kCols, q + t0 * K,
                         asum + t0 * groups, K, groups, f, zterm + c0};
        (bits == 4 ? tile4 : tile6)(rows)(tile);
      }
    }
  };
  if (tasks == 1) {
    task(0);
    return;
  }
  executorch::extension::threadpool::get_threadpool()->run(task, size_t(tasks));
}

void linear_i4(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 "mtp_edge::linear_i4.out");
  grouped_linear(ctx, stack, 4);
}

void linear_i6(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 "mtp_edge::linear_i6.out");
  grouped_linear(ctx, stack, 6);
}

}  // namespace

void register_int8_linear() {
  static const executorch::runtime::Kernel kernels[] = {
      executorch::runtime::Kernel("mtp_edge::linear_i8.out", linear_i8),
      executorch::runtime::Kernel("mtp_edge::linear_i4.out", linear_i4),
      executorch::runtime::Kernel("mtp_edge::linear_i6.out", linear_i6)};
  const auto registered = executorch::runtime::get_registered_kernels();
  for (const auto& other : registered)
    if (std::strcmp(other.name_, kernels[0].name_) == 0) return;
  (void)executorch::runtime::register_kernels({kernels, 3});
}

}  // namespace mtp
