// Our kernels for ExecuTorch's LLM cache ops, written from their schemas:
//   update_cache.out(Tensor value, Tensor(a!) cache, SymInt start_pos, *, Tensor(b!) out)
//   custom_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask,
//                   float drpout_p, bool is_causal, float? scale, *, Tensor(a!) out)
// Layouts: value/query [1, T, H, D]; caches [1, S, Hkv, D]. A query at absolute position
// start_pos + i sees cache slots 0..start_pos + i (slots beyond hold stale drafts).
#include "llama_ops.h"

#include "int8_linear.h"
#include "threadpool.h"

#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>

#include <executorch/runtime/core/event_tracer_hooks.h>
#include <executorch/runtime/core/function_ref.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <vector>

namespace mtp {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::Span;

bool check(KernelRuntimeContext& ctx, bool ok, const char* what) {
  if (!ok) {
    ET_LOG(Error, "%s", what);
    ctx.fail(Error::InvalidArgument);
  }
  return ok;
}

// The attention is written over vectors of 16 floats: that fixes every lane's sequence of
// operations, whatever the machine. A vector is held as P native registers of W floats
// (W x P = 16): one AVX-512 register, two AVX2 ones, four SSE or NEON ones. (A 16-float vector
// type, which a CPU without AVX-512 has no register for, GCC keeps in memory, and it spells its
// shuffles one float at a time: so compiled, the AVX2 version ran 6-10x slower than the AVX-512
// one, and the aarch64 build spilled alike; an array of native registers stays in registers.)
// Where the CPU fuses multiply-adds (AVX-512, AVX2 with FMA, every aarch64) every version
// computes the same bits, so a row is the same on a phone and on a laptop.
// On x86-64 three versions are compiled, for AVX-512 (W = 16), AVX2+FMA (8) and the baseline
// (4, SSE, no fused multiply-add), and the CPU's best one is taken at the first call; other
// architectures build W = 4 (NEON on aarch64). MTP_EDGE_BASELINE builds the baseline alone (the
// tests check that version too); MTP_EDGE_ATTENTION_ISA=avx512|avx2|baseline names the version
// instead of the CPU (to measure one against another, and for the tests).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MTP_EDGE_BASELINE)
#define MTP_X86_VERSIONS 1
#endif

// (GCC notes that passing such vectors between functions compiled for different ISAs changes
// the ABI: the helpers are inlined into each version, so no such call exists.) They are inlined
// always: a helper left out of line would be compiled for the baseline, with other arithmetic
// (no fused multiply-add), into some kernels and not others, and a row computed by two kernels
// (alone, or with another row of its call) would no longer be bitwise the same.
#define MTP_INLINE __attribute__((always_inline)) inline
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

template <class V>
struct IntOf;
template <>
struct IntOf<F16> {
  using type = I16;
};
template <>
struct IntOf<F8> {
  using type = I8;
};
template <>
struct IntOf<F4> {
  using type = I4;
};

// A 16-float vector as P registers of W = 16 / P floats: lanes 0..W-1 in p[0], and so on.
template <class V, int P>
struct Vec {
  static constexpr int W = int(sizeof(V) / sizeof(float));
  using Reg = V;
  static constexpr int kParts = P;
  static_assert(W * P == kLanes, "16 lanes");
  V p[P];
};

template <class V, int P>
MTP_INLINE Vec<V, P> operator+(Vec<V, P> a, const Vec<V, P>& b) {
  for (int i = 0; i < P; ++i) a.p[i] += b.p[i];
  return a;
}
template <class V, int P>
MTP_INLINE Vec<V, P> operator*(Vec<V, P> a, const Vec<V, P>& b) {
  for (int i = 0; i < P; ++i) a.p[i] *= b.p[i];
  return a;
}
template <class V, int P>
MTP_INLINE Vec<V, P> operator-(Vec<V, P> a, float b) {
  for (int i = 0; i < P; ++i) a.p[i] -= b;
  return a;
}
template <class V, int P>
MTP_INLINE Vec<V, P>& operator+=(Vec<V, P>& a, const Vec<V, P>& b) {
  for (int i = 0; i < P; ++i) a.p[i] += b.p[i];
  return a;
}

// Loads and stores a register at a time: one copy of the whole vector became narrower moves
// through the stack and a wide reload that waited for them.
template <class T>
MTP_INLINE T load16(const float* p) {
  T v;
  for (int i = 0; i < T::kParts; ++i) std::memcpy(&v.p[i], p + i * T::W, sizeof v.p[i]);
  return v;
}

template <class T>
MTP_INLINE void store16(float* p, const T& v) {
  for (int i = 0; i < T::kParts; ++i) std::memcpy(p + i * T::W, &v.p[i], sizeof v.p[i]);
}

template <class T>
MTP_INLINE T splat(float x) {
  T v;
  for (auto& part : v.p) part = typename T::Reg{} + x;
  return v;
}

template <class T>
MTP_INLINE float lane(const T& v, int l) {
  return v.p[l / T::W][l % T::W];
}

template <class T>
MTP_INLINE void set_lane(T& v, int l, float x) {
  v.p[l / T::W][l % T::W] = x;
}

// Lane-wise the larger of a and b (b where a is not larger), as `a > b ? a : b`.
template <class T>
MTP_INLINE T larger(T a, const T& b) {
  for (int i = 0; i < T::kParts; ++i)
    a.p[i] = a.p[i] > b.p[i] ? a.p[i] : b.p[i];
  return a;
}

// Sum of the 16 lanes, halving: lanes l + 8, then + 4, + 2, + 1.
template <class T>
MTP_INLINE float sum16(const T& v) {
  F4 q[4];
  std::memcpy(q, v.p, sizeof q);
  const F4 h4 = (q[0] + q[2]) + (q[1] + q[3]);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// Lane-wise max of a vector, then across lanes (max is exact in any order).
template <class T>
MTP_INLINE float max16(const T& v) {
  float m = lane(v, 0);
  for (int l = 1; l < kLanes; ++l) m = std::max(m, lane(v, l));
  return m;
}

// exp(x) for x <= 0 (scores minus the row's maximum) in plain arithmetic, lane by lane:
// x * log2(e) = n + f with n an integer and |f| <= 1/2; 2^f by Cephes' exp2f polynomial
// (relative error ~1e-7), 2^n by building the exponent bits. Arguments below -87 (weights
// under 1e-38 next to the maximum's 1) are clamped there.
template <class V>
MTP_INLINE V exp_register(V x) {
  using I = typename IntOf<V>::type;
  const V low = V{} + -87.f;
  const V t = (x < low ? low : x) * 1.44269504088896341f;
  const I n = -__builtin_convertvector(0.5f - t, I);  // round to nearest: t <= 0
  const V f = t - __builtin_convertvector(n, V);
  V p = V{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  const I bits = (n + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return (1.f + f * p) * two_n;
}

template <class T>
MTP_INLINE T exp_nonpositive(T x) {
  for (auto& part : x.p) part = exp_register(part);
  return x;
}

// The keys are taken in blocks of kBlock cache slots at fixed places (slots 0..127, 128..255,
// ...). A task takes one block of one KV head (and a chunk of the query heads that share it) for
// every query row of the call that sees into the block: the block comes from memory once and
// stays in the core's cache for the other rows, so a verification reads the cache about once,
// not once per row. For each (row, head, block) the task leaves the block's largest score m, the
// sum l of exp(score - m) and the unnormalized sum of exp(score - m) * value; combine() then
// merges a row's blocks in block order. Which blocks a row has, and every step within them,
// depend only on the row's query, the cache and the row's own position, never on the other rows
// of the call: a (k+1)-row verification gives bitwise the rows of k+1 one-row steps.
constexpr int64_t kBlock = 128;

// Vectors of four 128-bit quarters: quarters 0 and 2 of a, then of b (quarters_even), or 1 and
// 3 (quarters_odd): one lane shuffle with AVX-512 (vshuff32x4), one per register with AVX2
// (vperm2f128), a choice of registers with SSE and NEON.
template <class T>
MTP_INLINE T quarters_even(const T& a, const T& b) {
  T out;
  if constexpr (T::W == 16) {
    out.p[0] = __builtin_shufflevector(a.p[0], b.p[0], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                       24, 25, 26, 27);
  } else if constexpr (T::W == 8) {
    out.p[0] = __builtin_shufflevector(a.p[0], a.p[1], 0, 1, 2, 3, 8, 9, 10, 11);
    out.p[1] = __builtin_shufflevector(b.p[0], b.p[1], 0, 1, 2, 3, 8, 9, 10, 11);
  } else {
    out.p[0] = a.p[0], out.p[1] = a.p[2], out.p[2] = b.p[0], out.p[3] = b.p[2];
  }
  return out;
}
template <class T>
MTP_INLINE T quarters_odd(const T& a, const T& b) {
  T out;
  if constexpr (T::W == 16) {
    out.p[0] = __builtin_shufflevector(a.p[0], b.p[0], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                       23, 28, 29, 30, 31);
  } else if constexpr (T::W == 8) {
    out.p[0] = __builtin_shufflevector(a.p[0], a.p[1], 4, 5, 6, 7, 12, 13, 14, 15);
    out.p[1] = __builtin_shufflevector(b.p[0], b.p[1], 4, 5, 6, 7, 12, 13, 14, 15);
  } else {
    out.p[0] = a.p[1], out.p[1] = a.p[3], out.p[2] = b.p[1], out.p[3] = b.p[3];
  }
  return out;
}

// Within each quarter (lanes 4a .. 4a + 3), every lane gets ((lane 0 + lane 2) + (lane 1 +
// lane 3)) of that quarter.
template <class V>
MTP_INLINE V quarter_sums(V x) {
  if constexpr (sizeof(V) == 64) {
    const V y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12,
                                            13);
    return y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  } else if constexpr (sizeof(V) == 32) {
    const V y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    return y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6);
  } else {
    const V y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1);
    return y + __builtin_shufflevector(y, y, 1, 0, 3, 2);
  }
}

// Quarter i of x in all four quarters.
template <int i, class T>
MTP_INLINE T quarter_everywhere(const T& x) {
  T out;
  if constexpr (T::W == 16) {
    out.p[0] = __builtin_shufflevector(x.p[0], x.p[0], 4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3,
                                       4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i, 4 * i + 1,
                                       4 * i + 2, 4 * i + 3, 4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3);
  } else if constexpr (T::W == 8) {
    constexpr int o = 4 * (i % 2);
    const F8 half = x.p[i / 2];
    out.p[0] = out.p[1] = __builtin_shufflevector(half, half, o, o + 1, o + 2, o + 3, o, o + 1,
                                                  o + 2, o + 3);
  } else {
    for (auto& part : out.p) part = x.p[i];
  }
  return out;
}

// Scores of kR rows (q + r * qstep), kG query heads each (D floats apart), for the keys
// [j0, j0 + 4 kH) of a block (stride floats apart; n of them exist, the rest count as zero), into
// scores[r][g][j0..j0 + 4 kH). Four keys share a vector, a 128-bit quarter each, and a quarter's
// four lanes are the dimensions d = 4m + i (i = 0..3) of its key: lane (key, i) sums
// q[4m + i] k[4m + i] over m in order, multiply-adds from zero, and the key's score is
// ((lane 0 + lane 2) + (lane 1 + lane 3)) x scale. Putting four keys' quarters side by side
// takes 8 quarter shuffles per 16 dimensions of 4 keys, shared by every row and head of the
// call; a key at a time, every score needed a sum across 16 lanes of its own, which cost more
// than its multiply-adds. A row's scores depend on its query and the keys only, not on kR.
template <int kG, int kR, int kH, class T>
MTP_INLINE void score_keys(const T* qq, int64_t D, const float* k, int64_t stride, int64_t j0,
                           int64_t n, float scale, float (*scores)[kG][kBlock]) {
  T acc[kR][kG][kH] = {};
  const int64_t chunks = D / kLanes;
  // The next keys are asked from memory now: these are read a 16-float column at a time,
  // across rows, which the hardware's prefetchers follow less well than row after row.
  for (int64_t j = j0 + 4 * kH; j < std::min(n, j0 + 8 * kH); ++j)
    for (int64_t c = 0; c < chunks; ++c) __builtin_prefetch(k + j * stride + c * kLanes);
  for (int64_t c = 0; c < chunks; ++c) {
    T m[kH][4];  // m[h][i]: keys j0 + 4h .. + 3, dimensions 16c + 4i .. + 3
    for (int h = 0; h < kH; ++h) {
      T row[4];
      for (int a = 0; a < 4; ++a) {
        const int64_t j = j0 + 4 * h + a;
        row[a] = j < n ? load16<T>(k + j * stride + c * kLanes) : T{};
      }
      const T u0 = quarters_even(row[0], row[1]), u1 = quarters_odd(row[0], row[1]);
      const T u2 = quarters_even(row[2], row[3]), u3 = quarters_odd(row[2], row[3]);
      m[h][0] = quarters_even(u0, u2);
      m[h][2] = quarters_odd(u0, u2);
      m[h][1] = quarters_even(u1, u3);
      m[h][3] = quarters_odd(u1, u3);
    }
    for (int i = 0; i < 4; ++i)
      for (int r = 0; r < kR; ++r)
        for (int g = 0; g < kG; ++g) {
          const T& qv = qq[(r * kG + g) * (D / 4) + 4 * c + i];
          for (int h = 0; h < kH; ++h) acc[r][g][h] += qv * m[h][i];
        }
  }
  for (int r = 0; r < kR; ++r)
    for (int g = 0; g < kG; ++g) {
      T s[kH];
      for (int h = 0; h < kH; ++h)
        for (int i = 0; i < T::kParts; ++i) s[h].p[i] = quarter_sums(acc[r][g][h].p[i]);
      if constexpr (T::W == 16) {
        for (int h = 0; h < kH; h += 2) {  // lane 4a of s[h] is key j0 + 4h + a's score
          const F16 eight = __builtin_shufflevector(s[h].p[0], s[h + 1].p[0], 0, 4, 8, 12, 16, 20,
                                                    24, 28, 0, 4, 8, 12, 16, 20, 24, 28) * scale;
          std::memcpy(scores[r][g] + j0 + 4 * h, &eight, 8 * sizeof(float));
        }
      } else {
        for (int h = 0; h < kH; ++h)
          for (int a = 0; a < 4; ++a) scores[r][g][j0 + 4 * h + a] = lane(s[h], 4 * a) * scale;
      }
    }
}

// One block for kR rows of a call that see its first n[r] <= kBlock keys (k and v: keys and
// values stride floats apart); row r's kG query heads (sharing one KV head) at q + r * qstep,
// D floats apart. Row r's head g leaves, at e = r * rstep + g * step, the block's largest score
// m[e], the sum l[e] of exp(score - m) and the unnormalized sum of exp(score - m) x value in
// acc + e * D. The rows share every load and shuffle of keys and values; each value row is
// loaded once for all kR x kG heads, whose sums stay in registers (kR x kG x D / 16 vectors).
// Every row's sums run over its own keys in key order, as they do alone: a row's result does
// not depend on kR or on the other rows. kD > 0 fixes the head size at compile time (64 and
// 128 cover our models), which keeps the sums in registers; kD = 0 takes any multiple of 16 up
// to 256.
template <int kD, int kG, int kR, class T>
MTP_INLINE void block_rows(const float* q, int64_t qstep, int64_t D, const float* k,
                           const float* v, int64_t stride, const int64_t* n, float scale,
                           float* acc, float* m, float* l, int64_t step, int64_t rstep) {
  if (kD > 0) D = kD;
  constexpr int kVecsMax = kD > 0 ? kD / kLanes : 256 / kLanes;
  const int64_t vecs = D / kLanes;
  int64_t common = n[0], most = n[0];
  for (int r = 1; r < kR; ++r) {
    common = std::min(common, n[r]);
    most = std::max(most, n[r]);
  }
  // Each head's query, 4 dimensions repeated in every quarter: (4m .. 4m + 3) x 4.
  T qq[kR * kG * (kVecsMax * 4)];
  for (int r = 0; r < kR; ++r)
    for (int g = 0; g < kG; ++g)
      for (int64_t c = 0; c < vecs; ++c) {
        const T x = load16<T>(q + r * qstep + g * D + c * kLanes);
        T* out = qq + (r * kG + g) * (D / 4) + 4 * c;
        out[0] = quarter_everywhere<0>(x);
        out[1] = quarter_everywhere<1>(x);
        out[2] = quarter_everywhere<2>(x);
        out[3] = quarter_everywhere<3>(x);
      }
  alignas(64) float weights[kR][kG][kBlock];
  // 16 keys at a time where the sums fit in registers (4 kR kG chains of multiply-adds keep
  // both units busy), else 8. With narrower registers 4: there the sums of 8 keys (2 kR kG
  // vectors of 16 lanes) and the 8 keys transposed (8 vectors), each vector 2 AVX2 or 4 SSE or
  // NEON registers, went through the stack; 4 keys at a time took 9-28% less time on AVX2 and
  // 12-17% less on SSE at 1, 2 and 5 rows (benchmarks/README.md). Each sum is unchanged.
  constexpr int kH = T::W == 16 ? (kR * kG <= 3 ? 4 : 2) : 1;
  for (int64_t j0 = 0; j0 < most; j0 += 4 * kH)
    score_keys<kG, kR, kH>(qq, D, k, stride, j0, most, scale, weights);
  float best[kR][kG], total[kR][kG];
  for (int r = 0; r < kR; ++r) {
    const int64_t padded = (n[r] + kLanes - 1) / kLanes * kLanes;
    for (int g = 0; g < kG; ++g) {
      float* sg = weights[r][g];
      for (int64_t j = n[r]; j < padded; ++j) sg[j] = -INFINITY;
      T top = splat<T>(-INFINITY);
      for (int64_t j = 0; j < padded; j += kLanes) top = larger(load16<T>(sg + j), top);
      best[r][g] = max16(top);
      T sum = {};
      for (int64_t j = 0; j < padded; j += kLanes) {
        T e = exp_nonpositive(load16<T>(sg + j) - best[r][g]);
        if (j + kLanes > n[r])  // the padding lanes weigh nothing
          for (int l = int(n[r] - j); l < kLanes; ++l) set_lane(e, l, 0.f);
        store16(sg + j, e);
        sum += e;
      }
      total[r][g] = sum16(sum);
    }
  }
  T out[kR][kG][kVecsMax];
  for (int r = 0; r < kR; ++r)
    for (int g = 0; g < kG; ++g)
      for (int64_t c = 0; c < vecs; ++c) out[r][g][c] = T{};
  for (int64_t j = 0; j < common; ++j) {
    const float* vj = v + j * stride;
    for (int64_t c = 0; c < vecs; ++c) {
      const T vc = load16<T>(vj + c * kLanes);
      for (int r = 0; r < kR; ++r)
        for (int g = 0; g < kG; ++g) out[r][g][c] += splat<T>(weights[r][g][j]) * vc;
    }
  }
  for (int r = 0; r < kR; ++r)  // the keys a row sees past the others'
    for (int64_t j = common; j < n[r]; ++j) {
      const float* vj = v + j * stride;
      for (int64_t c = 0; c < vecs; ++c) {
        const T vc = load16<T>(vj + c * kLanes);
        for (int g = 0; g < kG; ++g) out[r][g][c] += splat<T>(weights[r][g][j]) * vc;
      }
    }
  for (int r = 0; r < kR; ++r)
    for (int g = 0; g < kG; ++g) {
      const int64_t e = r * rstep + g * step;
      for (int64_t c = 0; c < vecs; ++c) store16(acc + e * D + c * kLanes, out[r][g][c]);
      m[e] = best[r][g];
      l[e] = total[r][g];
    }
}

// Any head size, one head, one float at a time (no model of ours needs it; kept for generality).
void block_any(const float* q, int64_t, int64_t D, const float* k, const float* v,
               int64_t stride, const int64_t* rows_n, float scale, float* acc, float* m, float* l,
               int64_t, int64_t) {
  const int64_t n = rows_n[0];
  float scores[kBlock];
  float best = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[j * stride + d];
    scores[j] = s * scale;
    best = std::max(best, scores[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += (scores[j] = std::exp(scores[j] - best));
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) acc[d] += scores[j] * v[j * stride + d];
  *m = best;
  *l = total;
}

// How many query heads of a group a kernel takes at once for head size D (its sums of values
// are kG * D floats: up to 256 of them, 16 AVX-512 registers).
int64_t heads_at_once(int64_t D, int64_t group) {
  const int64_t cap = D == 64 ? 4 : D == 128 ? 2 : 1;
  return std::min(cap, group);
}

using BlockFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, int64_t,
                         const int64_t*, float, float*, float*, float*, int64_t, int64_t);

// The versions: block_rows over T, compiled for the instruction set that T's registers need.
struct Avx512 {};
struct Avx2 {};
struct Baseline {};
template <class Isa, int kD, int kG, int kR>
struct Rows;
#define MTP_BLOCK_ARGS                                                                       \
  const float *q, int64_t qstep, int64_t D, const float *k, const float *v, int64_t stride, \
      const int64_t *n, float scale, float *acc, float *m, float *l, int64_t step, int64_t rstep
#define MTP_BLOCK_NAMES q, qstep, D, k, v, stride, n, scale, acc, m, l, step, rstep
#ifdef MTP_X86_VERSIONS
template <int kD, int kG, int kR>
struct Rows<Avx512, kD, kG, kR> {
  __attribute__((target("avx512f"))) static void run(MTP_BLOCK_ARGS) {
    block_rows<kD, kG, kR, Vec<F16, 1>>(MTP_BLOCK_NAMES);
  }
};
template <int kD, int kG, int kR>
struct Rows<Avx2, kD, kG, kR> {
  __attribute__((target("avx2,fma"))) static void run(MTP_BLOCK_ARGS) {
    block_rows<kD, kG, kR, Vec<F8, 2>>(MTP_BLOCK_NAMES);
  }
};
#endif
template <int kD, int kG, int kR>
struct Rows<Baseline, kD, kG, kR> {
  static void run(MTP_BLOCK_ARGS) { block_rows<kD, kG, kR, Vec<F4, 4>>(MTP_BLOCK_NAMES); }
};
#undef MTP_BLOCK_ARGS
#undef MTP_BLOCK_NAMES

// The kernel of one version for `heads` heads of size D, for one row, or for two rows at once
// where their sums fit in registers (else nullptr).
template <class Isa>
BlockFn version_kernel(int64_t D, int64_t heads, int rows) {
  if (D == 64) {
    static const BlockFn one[] = {nullptr, Rows<Isa, 64, 1, 1>::run, Rows<Isa, 64, 2, 1>::run,
                                  Rows<Isa, 64, 3, 1>::run, Rows<Isa, 64, 4, 1>::run};
    static const BlockFn two[] = {nullptr, Rows<Isa, 64, 1, 2>::run, Rows<Isa, 64, 2, 2>::run,
                                  Rows<Isa, 64, 3, 2>::run, nullptr};
    return rows == 1 ? one[heads] : two[heads];
  }
  if (D == 128) {
    if (rows == 2) return heads == 1 ? Rows<Isa, 128, 1, 2>::run : nullptr;
    return heads == 2 ? Rows<Isa, 128, 2, 1>::run : Rows<Isa, 128, 1, 1>::run;
  }
  if (rows == 2) return nullptr;
  return D % kLanes == 0 && D <= 256 ? Rows<Isa, 0, 1, 1>::run : block_any;
}

// 2: AVX-512, 1: AVX2+FMA, 0: the baseline: the CPU's best, or what MTP_EDGE_ATTENTION_ISA
// names if the CPU has it (else one line on stderr, and the CPU's best).
int attention_version() {
  static const int version = [] {
    int best = 0;
#ifdef MTP_X86_VERSIONS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
      best = 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      best = 1;
#endif
    static const char* const names[] = {"baseline", "avx2", "avx512"};
    const char* asked = std::getenv("MTP_EDGE_ATTENTION_ISA");
    if (asked == nullptr || *asked == '\0') return best;
    for (int i = 0; i <= best; ++i)
      if (std::strcmp(asked, names[i]) == 0) return i;
    std::fprintf(stderr,
                 "mtp-edge: MTP_EDGE_ATTENTION_ISA=%s is not an attention version this build "
                 "and CPU run (%s%s%s); using %s\n",
                 asked, names[0], best >= 1 ? ", avx2" : "", best >= 2 ? ", avx512" : "",
                 names[best]);
    return best;
  }();
  return version;
}

BlockFn block_kernel(int64_t D, int64_t heads, int rows) {
#ifdef MTP_X86_VERSIONS
  switch (attention_version()) {
    case 2:
      return version_kernel<Avx512>(D, heads, rows);
    case 1:
      return version_kernel<Avx2>(D, heads, rows);
  }
#endif
  return version_kernel<Baseline>(D, heads, rows);
}

// A (row, head)'s blocks 0..blocks-1 merged, in block order, into its D outputs: with M the
// largest block maximum, out = sum_b exp(m_b - M) acc_b / sum_b exp(m_b - M) l_b.
void combine(const float* acc, const float* m, const float* l, int64_t blocks, int64_t D,
             float* out) {
  float top = m[0];
  for (int64_t b = 1; b < blocks; ++b) top = std::max(top, m[b]);
  float total = 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float w = std::exp(m[b] - top);
    total += w * l[b];
    for (int64_t d = 0; d < D; ++d) out[d] += w * acc[b * D + d];
  }
  for (int64_t d = 0; d < D; ++d) out[d] /= total;
}

void update_cache(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  const Tensor& value = stack[0]->toTensor();
  Tensor& cache = stack[1]->toTensor();
  const int64_t start = stack[2]->toInt();
  if (!check(ctx, value.dim() == 4 && cache.dim() == 4, "update_cache: 4-D tensors expected") ||
      !check(ctx,
             value.scalar_type() == ScalarType::Float && cache.scalar_type() == ScalarType::Float,
             "update_cache: float32 only") ||
      !check(ctx, value.size(2) == cache.size(2) && value.size(3) == cache.size(3),
             "update_cache: head shapes differ") ||
      !check(ctx, start >= 0 && start + value.size(1) <= cache.size(1),
             "update_cache: positions beyond the cache"))
    return;
  const size_t row = size_t(value.size(2)) * value.size(3);
  std::memcpy(cache.mutable_data_ptr<float>() + start * row, value.const_data_ptr<float>(),
              sizeof(float) * row * value.size(1));
}

// Causal attention of q [1, T, Hq, D] over the caches [1, S, Hkv, D] into out: row i (absolute
// position start + i) sees slots 0..start + i. Tasks are (KV head, chunk of its query heads, key
// block), spread over ExecuTorch's thread pool (XNNPACK's pool too); each does every row that
// sees into its block. The chunks depend on the head counts only and the blocks on slot numbers
// only, so a row's result does not depend on how many rows share the call.
bool attend_causal(KernelRuntimeContext& ctx, const char* op, const Tensor& q, const Tensor& k,
                   const Tensor& v, int64_t start, double scale_or_nan, Tensor& out) {
  char what[96];
  auto fail = [&](bool ok, const char* problem) {
    if (!ok) std::snprintf(what, sizeof what, "%s: %s", op, problem);
    return check(ctx, ok, what);
  };
  if (!fail(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "4-D tensors expected") ||
      !fail(q.scalar_type() == ScalarType::Float && k.scalar_type() == ScalarType::Float &&
                v.scalar_type() == ScalarType::Float,
            "float32 only"))
    return false;
  const int64_t T = q.size(1), Hq = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  if (!fail(Hkv > 0 && Hq % Hkv == 0 && k.size(3) == D && v.size(3) == D, "head mismatch") ||
      !fail(start >= 0 && start + T <= S, "positions beyond the cache") ||
      !fail(executorch::runtime::resize_tensor(out, q.sizes()) == Error::Ok,
            "cannot resize the output"))
    return false;
  if (T == 0) return true;
  const float scale =
      std::isnan(scale_or_nan) ? float(1.0 / std::sqrt(double(D))) : float(scale_or_nan);
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  float* op_ = out.mutable_data_ptr<float>();
  const int64_t group = Hq / Hkv;
  const int64_t at_once = heads_at_once(D, group);
  const int64_t chunks = (group + at_once - 1) / at_once;
  const int64_t blocks = (start + T + kBlock - 1) / kBlock;  // of the last row
  // Per (row, head, block) entry: D sums, then the maximum and the total; heads `blocks` apart.
  const size_t entries = size_t(T * Hq * blocks);
  thread_local std::vector<float> partials;
  if (partials.size() < entries * (D + 2)) partials.resize(entries * (D + 2));
  float* acc = partials.data();
  float* top = acc + entries * D;
  float* total = top + entries;
  // Block b for the heads of (KV head kvh, chunk c) of `rows` rows from row i (one, or two
  // where block_kernel has a kernel for two) into the partials, and the merge of row i's blocks
  // for those heads into out.
  auto block = [&](int64_t i, int rows, int64_t b, int64_t kvh, int64_t c) {
    const int64_t h0 = kvh * group + c * at_once, heads = std::min(at_once, group - c * at_once);
    const int64_t first = b * kBlock;
    const int64_t n[2] = {std::min(kBlock, start + i + 1 - first),
                          std::min(kBlock, start + i + 2 - first)};
    const int64_t e = (i * Hq + h0) * blocks + b;
    block_kernel(D, heads, rows)(qp + (i * Hq + h0) * D, Hq * D, D, kp + (first * Hkv + kvh) * D,
                                 vp + (first * Hkv + kvh) * D, Hkv * D, n, scale, acc + e * D,
                                 top + e, total + e, blocks, Hq * blocks);
  };
  auto merge = [&](int64_t i, int64_t kvh, int64_t c) {
    const int64_t h0 = kvh * group + c * at_once, heads = std::min(at_once, group - c * at_once);
    const int64_t seen = (start + i + kBlock) / kBlock;  // blocks row i sees into
    for (int64_t h = h0; h < h0 + heads; ++h) {
      const int64_t e = (i * Hq + h) * blocks;
      combine(acc + e * D, top + e, total + e, seen, D, op_ + (i * Hq + h) * D);
    }
  };
  auto* pool = executorch::extension::threadpool::get_threadpool();
  // Up to two blocks (256 slots) the cache stays in the core's cache between rows anyway; there
  // tasks are (two rows, KV head, chunk), each doing its rows' blocks one after another and the
  // merges: more, evener tasks than one per block. Same blocks, same arithmetic, same rows.
  if (T > 1 && blocks <= 2) {
    const int64_t pairs = (T + 1) / 2;
    pool->run(
        [&](size_t task) {
          const int64_t i = 2 * (int64_t(task) / (Hkv * chunks));
          const int64_t rest = int64_t(task) % (Hkv * chunks);
          const int64_t c = rest % chunks, kvh = rest / chunks;
          const int64_t rows = std::min<int64_t>(2, T - i);
          if (rows == 2 && block_kernel(D, std::min(at_once, group - c * at_once), 2)) {
            for (int64_t b = 0; b < (start + i + 1 + kBlock) / kBlock; ++b) {
              if (b * kBlock > start + i)
                block(i + 1, 1, b, kvh, c);  // a block only the second row sees into
              else
                block(i, 2, b, kvh, c);
            }
          } else {
            for (int64_t r = i; r < i + rows; ++r)
              for (int64_t b = 0; b < (start + r + kBlock) / kBlock; ++b) block(r, 1, b, kvh, c);
          }
          for (int64_t r = i; r < i + rows; ++r) merge(r, kvh, c);
        },
        size_t(pairs * Hkv * chunks));
    return true;
  }
  // Otherwise a task is one block of one (KV head, chunk) for every row that sees into it. Each
  // (row, KV head, chunk) counts down the blocks still to do; the task that does its last block
  // merges them (reading what other threads wrote), so the merges run in parallel too. Which
  // thread merges does not change the arithmetic. The rows go two at a time where a kernel
  // takes two: they share the block's loads.
  const size_t groups = size_t(T * Hkv * chunks);
  thread_local std::unique_ptr<std::atomic<int32_t>[]> pending;
  thread_local size_t pending_size = 0;
  if (pending_size < groups) {
    pending.reset(new std::atomic<int32_t>[groups]);
    pending_size = groups;
  }
  std::atomic<int32_t>* counts = pending.get();  // the tasks' threads have their own thread_local
  for (int64_t i = 0; i < T; ++i)
    for (int64_t g = 0; g < Hkv * chunks; ++g)
      counts[i * Hkv * chunks + g].store(int32_t((start + i + kBlock) / kBlock),
                                         std::memory_order_relaxed);
  pool->run(
      [&](size_t task) {
        const int64_t b = int64_t(task) % blocks, rest = int64_t(task) / blocks;
        const int64_t c = rest % chunks, kvh = rest / chunks;
        const int pair = block_kernel(D, std::min(at_once, group - c * at_once), 2) ? 2 : 1;
        for (int64_t i = std::max<int64_t>(0, b * kBlock - start); i < T;) {
          const int rows = i + 1 < T ? pair : 1;
          block(i, rows, b, kvh, c);
          for (int64_t r = i; r < i + rows; ++r)
            if (counts[(r * Hkv + kvh) * chunks + c].fetch_sub(1, std::memory_order_acq_rel) == 1)
              merge(r, kvh, c);
          i += rows;
        }
      },
      size_t(Hkv * chunks * blocks));
  return true;
}

// The element-wise glue between the linears (mtp_edge/ops.py): mtp_edge::rms_norm, rope and
// swiglu. A row's arithmetic is fixed by the row alone; rows go over the thread pool only when a
// call has many (prefill), and which thread does a row does not change it.
template <class F>
void over_rows(int64_t rows, int64_t row_size, F&& body) {
  constexpr int64_t kAlone = int64_t(1) << 15;  // floats a call does on the caller's thread
  if (rows < 2 || rows * row_size <= kAlone) {
    for (int64_t r = 0; r < rows; ++r) body(r);
    return;
  }
  executorch::extension::threadpool::get_threadpool()->run(
      [&](size_t r) { body(int64_t(r)); }, size_t(rows));
}

// out = weight x (x / sqrt(mean(x^2) + eps)): the squares summed in 16 lanes, then as sum16.
template <class T>
MTP_INLINE void norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  T acc = splat<T>(0.f);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const T v = load16<T>(x + j);
    acc += v * v;
  }
  float total = sum16(acc);
  for (; j < n; ++j) total += x[j] * x[j];
  const float inv = 1.f / std::sqrt(total / float(n) + eps);
  for (j = 0; j < n; ++j) out[j] = w[j] * (x[j] * inv);
}

// silu(g) x u, with silu(g) = g / (1 + e^-g) from e = exp(-|g|) <= 1: g >= 0 takes 1 / (1 + e),
// g < 0 takes e / (1 + e). A row's tail goes through the same vectors, padded with zeros.
template <class V>
MTP_INLINE V silu_register(V g) {
  const V e = exp_register(g < 0.f ? g : -g);
  const V one = V{} + 1.f;
  return g * ((g < 0.f ? e : one) / (one + e));
}

template <class T>
MTP_INLINE void swiglu_row(const float* g, const float* u, int64_t n, float* out) {
  auto sixteen = [](const float* g16, const float* u16, float* o16) {
    T a = load16<T>(g16);
    const T b = load16<T>(u16);
    for (int i = 0; i < T::kParts; ++i) a.p[i] = silu_register(a.p[i]) * b.p[i];
    store16(o16, a);
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) sixteen(g + j, u + j, out + j);
  if (j < n) {
    float gt[kLanes] = {}, ut[kLanes] = {}, ot[kLanes];
    std::memcpy(gt, g + j, sizeof(float) * (n - j));
    std::memcpy(ut, u + j, sizeof(float) * (n - j));
    sixteen(gt, ut, ot);
    std::memcpy(out + j, ot, sizeof(float) * (n - j));
  }
}

using NormFn = void (*)(const float*, const float*, int64_t, float, float*);
using SwigluFn = void (*)(const float*, const float*, int64_t, float*);
#ifdef MTP_X86_VERSIONS
__attribute__((target("avx512f"))) void norm_avx512(const float* x, const float* w, int64_t n,
                                                     float eps, float* out) {
  norm_row<Vec<F16, 1>>(x, w, n, eps, out);
}
__attribute__((target("avx2,fma"))) void norm_avx2(const float* x, const float* w, int64_t n,
                                                   float eps, float* out) {
  norm_row<Vec<F8, 2>>(x, w, n, eps, out);
}
__attribute__((target("avx512f"))) void swiglu_avx512(const float* g, const float* u, int64_t n,
                                                       float* out) {
  swiglu_row<Vec<F16, 1>>(g, u, n, out);
}
__attribute__((target("avx2,fma"))) void swiglu_avx2(const float* g, const float* u, int64_t n,
                                                     float* out) {
  swiglu_row<Vec<F8, 2>>(g, u, n, out);
}
#endif
void norm_baseline(const float* x, const float* w, int64_t n, float eps, float* out) {
  norm_row<Vec<F4, 4>>(x, w, n, eps, out);
}
void swiglu_baseline(const float* g, const float* u, int64_t n, float* out) {
  swiglu_row<Vec<F4, 4>>(g, u, n, out);
}

// The version attention runs (attention_version: the CPU's best, or MTP_EDGE_ATTENTION_ISA).
template <class Fn>
Fn by_version(Fn avx512, Fn avx2, Fn baseline) {
  switch (attention_version()) {
    case 2:
      return avx512;
    case 1:
      return avx2;
  }
  return baseline;
}

bool float_tensors(KernelRuntimeContext& ctx, const char* op,
                   std::initializer_list<const Tensor*> tensors) {
  bool ok = true;
  for (const Tensor* t : tensors) ok = ok && t->scalar_type() == ScalarType::Float;
  char what[64];
  std::snprintf(what, sizeof what, "%s: float32 only", op);
  return check(ctx, ok, what);
}

// mtp_edge::rms_norm.out(Tensor input, Tensor weight, float eps, *, Tensor(a!) out): over the
// last dimension.
void mtp_rms_norm(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 "mtp_edge::rms_norm.out");
  const Tensor& x = stack[0]->toTensor();
  const Tensor& w = stack[1]->toTensor();
  const float eps = float(stack[2]->toDouble());
  Tensor& out = stack[3]->toTensor();
  if (!float_tensors(ctx, "mtp_edge::rms_norm", {&x, &w, &out}) ||
      !check(ctx, x.dim() >= 1 && w.numel() == x.size(x.dim() - 1),
             "mtp_edge::rms_norm: the weight is not the size of the last dimension") ||
      !check(ctx, executorch::runtime::resize_tensor(out, x.sizes()) == Error::Ok,
             "mtp_edge::rms_norm: cannot resize the output"))
    return;
  const int64_t n = w.numel(), rows = n ? x.numel() / n : 0;
#ifdef MTP_X86_VERSIONS
  const NormFn row = by_version<NormFn>(norm_avx512, norm_avx2, norm_baseline);
#else
  const NormFn row = norm_baseline;
#endif
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op_ = out.mutable_data_ptr<float>();
  over_rows(rows, n, [&](int64_t r) { row(xp + r * n, wp, n, eps, op_ + r * n); });
}

// mtp_edge::rope.out(Tensor input, Tensor cos, Tensor sin, *, Tensor(a!) out): input
// [1, T, H, D], cos and sin [T, D] (row i for token i): x cos + rotate_half(x) sin.
void mtp_rope(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 "mtp_edge::rope.out");
  const Tensor& x = stack[0]->toTensor();
  const Tensor& c = stack[1]->toTensor();
  const Tensor& s = stack[2]->toTensor();
  Tensor& out = stack[3]->toTensor();
  if (!float_tensors(ctx, "mtp_edge::rope", {&x, &c, &s, &out}) ||
      !check(ctx, x.dim() == 4 && x.size(3) % 2 == 0, "mtp_edge::rope: input [1, T, H, D] expected") ||
      !check(ctx, c.numel() == x.size(1) * x.size(3) && s.numel() == c.numel(),
             "mtp_edge::rope: cos and sin are not [T, D]") ||
      !check(ctx, executorch::runtime::resize_tensor(out, x.sizes()) == Error::Ok,
             "mtp_edge::rope: cannot resize the output"))
    return;
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const float* xp = x.const_data_ptr<float>();
  const float* cp = c.const_data_ptr<float>();
  const float* sp = s.const_data_ptr<float>();
  float* op_ = out.mutable_data_ptr<float>();
  over_rows(T, H * D, [&](int64_t t) {
    const float* cr = cp + t * D;
    const float* sr = sp + t * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* xh = xp + (t * H + h) * D;
      float* oh = op_ + (t * H + h) * D;
      for (int64_t j = 0; j < half; ++j) oh[j] = xh[j] * cr[j] - xh[j + half] * sr[j];
      for (int64_t j = half; j < D; ++j) oh[j] = xh[j] * cr[j] + xh[j - half] * sr[j];
    }
  });
}

// mtp_edge::swiglu.out(Tensor gate, Tensor up, *, Tensor(a!) out): silu(gate) x up.
void mtp_swiglu(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 "mtp_edge::swiglu.out");
  const Tensor& g = stack[0]->toTensor();
  const Tensor& u = stack[1]->toTensor();
  Tensor& out = stack[2]->toTensor();
  if (!float_tensors(ctx, "mtp_edge::swiglu", {&g, &u, &out}) ||
      !check(ctx, g.dim() >= 1 && g.numel() == u.numel() && g.dim() == u.dim(),
             "mtp_edge::swiglu: gate and up differ in shape") ||
      !check(ctx, executorch::runtime::resize_tensor(out, g.sizes()) == Error::Ok,
             "mtp_edge::swiglu: cannot resize the output"))
    return;
  const int64_t n = g.size(g.dim() - 1), rows = n ? g.numel() / n : 0;
#ifdef MTP_X86_VERSIONS
  const SwigluFn row = by_version<SwigluFn>(swiglu_avx512, swiglu_avx2, swiglu_baseline);
#else
  const SwigluFn row = swiglu_baseline;
#endif
  const float* gp = g.const_data_ptr<float>();
  const float* up = u.const_data_ptr<float>();
  float* op_ = out.mutable_data_ptr<float>();
  over_rows(rows, n, [&](int64_t r) { row(gp + r * n, up + r * n, n, op_ + r * n); });
}

// llama.custom_sdpa.out: see the schema at the top.
void custom_sdpa(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  if (!check(ctx, stack[4]->isNone(), "custom_sdpa: attn_mask is not supported") ||
      !check(ctx, stack[6]->toBool(), "custom_sdpa: only is_causal=True is supported"))
    return;
  attend_causal(ctx, "custom_sdpa", stack[0]->toTensor(), stack[1]->toTensor(),
                stack[2]->toTensor(), stack[3]->toInt(),
                stack[7]->isNone() ? NAN : stack[7]->toDouble(), stack[8]->toTensor());
}

// mtp_edge::sdpa.out(Tensor query, Tensor k_cache, Tensor v_cache, SymInt start_pos, *,
//                    Tensor(a!) out) -> Tensor(a!)
// Our own op (exporter/executorch_ops.py defines it for export), causal, scale 1/sqrt(D): the
// programs mtp-export writes call it so that every runtime (Python, the native runner, the
// phone) computes attention with this one kernel, row by row.
void mtp_sdpa(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  attend_causal(ctx, "mtp_edge::sdpa", stack[0]->toTensor(), stack[1]->toTensor(),
                stack[2]->toTensor(), stack[3]->toInt(), NAN, stack[4]->toTensor());
}

void register_missing(const executorch::runtime::Kernel* kernels, size_t n) {
  // Looked up in the list rather than with registry_has_op_function, which logs every miss.
  const auto registered = executorch::runtime::get_registered_kernels();
  for (size_t i = 0; i < n; ++i) {
    bool present = false;
    for (const auto& other : registered)
      present = present || std::strcmp(other.name_, kernels[i].name_) == 0;
    if (!present) (void)executorch::runtime::register_kernel(kernels[i]);
  }
}

}  // namespace

void register_llama_ops() {
  using executorch::runtime::Kernel;
  static const Kernel kernels[] = {
      Kernel("llama::update_cache.out", update_cache),
      Kernel("llama::custom_sdpa.out", custom_sdpa),
  };
  register_missing(kernels, sizeof kernels / sizeof kernels[0]);
  register_mtp_ops();
}

void register_mtp_ops() {
  static const executorch::runtime::Kernel kernels[] = {
      executorch::runtime::Kernel("mtp_edge::sdpa.out", mtp_sdpa),
      executorch::runtime::Kernel("mtp_edge::rms_norm.out", mtp_rms_norm),
      executorch::runtime::Kernel("mtp_edge::rope.out", mtp_rope),
      executorch::runtime::Kernel("mtp_edge::swiglu.out", mtp_swiglu),
  };
  register_missing(kernels, sizeof kernels / sizeof kernels[0]);
  register_int8_linear();
}

}  // namespace mtp
