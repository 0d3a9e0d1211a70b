// Our kernels for ExecuTorch's LLM cache ops, written from their schemas:
//   update_cache.out(Tensor value, Tensor(a!) cache, SymInt start_pos, *, Tensor(b!) out)
//   custom_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask,
//                   float drpout_p, bool is_causal, float? scale, *, Tensor(a!) out)
// Layouts: value/query [1, T, H, D]; caches [1, S, Hkv, D]. A query at absolute position
// start_pos + i sees cache slots 0..start_pos + i (slots beyond hold stale drafts).
#include "llama_ops.h"

#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>

#include <executorch/runtime/core/function_ref.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

// The wheel ships the thread pool library but not its header; this is the call we make.
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  void run(executorch::runtime::FunctionRef<void(size_t)> fn, size_t range);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

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

// On x86-64 the attention is compiled for AVX-512, AVX2+FMA and the baseline, picked at load
// time (the baseline has only 4-wide SSE); aarch64's baseline already has NEON.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MTP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define MTP_VECTOR_CLONES
#endif

// The attention is written with GCC/Clang vector extensions: 16 floats per vector, which the
// compiler maps to one AVX-512 register, two AVX2 ones, four SSE or NEON ones. Plain C++ loops
// did not vectorize (the compiler may not reorder float reductions), and every per-key
// reduction and exp ran one float at a time.
// (GCC notes that passing such vectors between functions compiled for different ISAs changes
// the ABI: these helpers are inlined into each clone, so no such call exists.)
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

inline F16 load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, F16 v) { std::memcpy(p, &v, sizeof v); }

inline F16 splat(float x) { return F16{} + x; }

// Sum of the 16 lanes, halving: lanes l + 8, then + 4, + 2, + 1.
inline float sum16(F16 v) {
  F8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const F8 h8 = lo + hi;
  F4 a, b;
  std::memcpy(&a, &h8, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&h8) + sizeof a, sizeof b);
  const F4 h4 = a + b;
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// Lane-wise max of a vector, then across lanes (max is exact in any order).
inline float max16(F16 v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

// exp(x) for x <= 0 (scores minus the row's maximum) in plain arithmetic, 16 lanes at once:
// x * log2(e) = n + f with n an integer and |f| <= 1/2; 2^f by Cephes' exp2f polynomial
// (relative error ~1e-7), 2^n by building the exponent bits. Arguments below -87 (weights
// under 1e-38 next to the maximum's 1) are clamped there.
inline F16 exp_nonpositive(F16 x) {
  const F16 low = splat(-87.f);
  const F16 t = (x < low ? low : x) * 1.44269504088896341f;
  const I16 n = -__builtin_convertvector(0.5f - t, I16);  // round to nearest: t <= 0
  const F16 f = t - __builtin_convertvector(n, F16);
  F16 p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  const I16 bits = (n + 127) << 23;
  F16 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return (1.f + f * p) * two_n;
}

// q . k over D floats (D a multiple of 16): 16 partial sums, then sum16.
template <int kD>
inline float dot(const float* q, const float* k, int64_t D) {
  if (kD > 0) D = kD;
  F16 part = load16(q) * load16(k);
  for (int64_t d = kLanes; d < D; d += kLanes) part += load16(q + d) * load16(k + d);
  return sum16(part);
}

// One query row against `visible` cache rows (stride `stride` floats apart): softmax(q.k * scale)
// weighted sum of v into `out`. Every step is a fixed function of the row, its keys and
// `visible`, never of the other rows in the call: that is what makes a verification row-exact.
// `scores` has room for `visible` rounded up to 16. Heads whose size is not a multiple of 16 (or
// above 256) take attend_row_any. kD > 0 fixes the head size at compile time (64 and 128 cover our models), which
// keeps the accumulators in registers.
template <int kD>
MTP_VECTOR_CLONES void attend_row(const float* q, const float* k, const float* v, int64_t stride,
                                  int64_t visible, int64_t D, float scale, float* scores,
                                  float* out) {
  if (kD > 0) D = kD;
  int64_t j = 0;
  for (; j + 4 <= visible; j += 4) {  // four independent dot products overlap
    const float* kj = k + j * stride;
    const float s0 = dot<kD>(q, kj, D), s1 = dot<kD>(q, kj + stride, D);
    const float s2 = dot<kD>(q, kj + 2 * stride, D), s3 = dot<kD>(q, kj + 3 * stride, D);
    scores[j] = s0 * scale;
    scores[j + 1] = s1 * scale;
    scores[j + 2] = s2 * scale;
    scores[j + 3] = s3 * scale;
  }
  for (; j < visible; ++j) scores[j] = dot<kD>(q, k + j * stride, D) * scale;
  const int64_t padded = (visible + kLanes - 1) / kLanes * kLanes;
  for (; j < padded; ++j) scores[j] = -INFINITY;
  F16 m = splat(-INFINITY);
  for (j = 0; j < padded; j += kLanes) {
    const F16 x = load16(scores + j);
    m = x > m ? x : m;
  }
  const float best = max16(m);
  F16 totals = {};
  for (j = 0; j < padded; j += kLanes) {
    F16 e = exp_nonpositive(load16(scores + j) - best);
    if (j + kLanes > visible)  // the padding lanes weigh nothing
      for (int l = int(visible - j); l < kLanes; ++l) e[l] = 0.f;
    store16(scores + j, e);
    totals += e;
  }
  const float total = sum16(totals);
  constexpr int kVecs = kD > 0 ? kD / kLanes : 256 / kLanes;  // kD = 0: D up to 256
  F16 even[kVecs], odd[kVecs];
  const int64_t vecs = D / kLanes;
  for (int64_t c = 0; c < vecs; ++c) even[c] = odd[c] = F16{};
  for (j = 0; j + 2 <= visible; j += 2) {  // two independent chains of sums
    const float* vj = v + j * stride;
    const F16 w0 = splat(scores[j]), w1 = splat(scores[j + 1]);
    for (int64_t c = 0; c < vecs; ++c) {
      even[c] += w0 * load16(vj + c * kLanes);
      odd[c] += w1 * load16(vj + stride + c * kLanes);
    }
  }
  if (j < visible) {
    const F16 w = splat(scores[j]);
    for (int64_t c = 0; c < vecs; ++c) even[c] += w * load16(v + j * stride + c * kLanes);
  }
  for (int64_t c = 0; c < vecs; ++c) store16(out + c * kLanes, (even[c] + odd[c]) / total);
}

// kG query heads that share one KV head (grouped-query attention), one query row: as kG calls
// of attend_row, but each key and value row is loaded once for all of them (the cache is read
// from L2 or memory; the arithmetic was waiting on those loads). Each head's scores, softmax and
// weighted sum are computed exactly as attend_row's steps, with its own chains of sums; the
// heads a call groups depend only on the model's head counts, never on the number of rows.
// q and out hold the kG heads' rows one after another (D floats apart), as in [T, H, D].
template <int kD, int kG>
MTP_VECTOR_CLONES void attend_heads(const float* q, const float* k, const float* v, int64_t stride,
                                    int64_t visible, float scale, float* scores, float* out) {
  constexpr int64_t D = kD, kVecs = kD / kLanes;
  const int64_t padded = (visible + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = 0; j < visible; ++j) {
    const float* kj = k + j * stride;
    F16 part[kG];
    for (int g = 0; g < kG; ++g) part[g] = load16(q + g * D) * load16(kj);
    for (int64_t c = 1; c < kVecs; ++c) {
      const F16 kc = load16(kj + c * kLanes);
      for (int g = 0; g < kG; ++g) part[g] += load16(q + g * D + c * kLanes) * kc;
    }
    for (int g = 0; g < kG; ++g) scores[g * padded + j] = sum16(part[g]) * scale;
  }
  float totals[kG];
  for (int g = 0; g < kG; ++g) {
    float* sg = scores + g * padded;
    for (int64_t j = visible; j < padded; ++j) sg[j] = -INFINITY;
    F16 m = splat(-INFINITY);
    for (int64_t j = 0; j < padded; j += kLanes) {
      const F16 x = load16(sg + j);
      m = x > m ? x : m;
    }
    const float best = max16(m);
    F16 sum = {};
    for (int64_t j = 0; j < padded; j += kLanes) {
      F16 e = exp_nonpositive(load16(sg + j) - best);
      if (j + kLanes > visible)  // the padding lanes weigh nothing
        for (int l = int(visible - j); l < kLanes; ++l) e[l] = 0.f;
      store16(sg + j, e);
      sum += e;
    }
    totals[g] = sum16(sum);
  }
  F16 acc[kG][kVecs];
  for (int g = 0; g < kG; ++g)
    for (int64_t c = 0; c < kVecs; ++c) acc[g][c] = F16{};
  for (int64_t j = 0; j < visible; ++j) {
    const float* vj = v + j * stride;
    for (int64_t c = 0; c < kVecs; ++c) {
      const F16 vc = load16(vj + c * kLanes);
      for (int g = 0; g < kG; ++g) acc[g][c] += splat(scores[g * padded + j]) * vc;
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int64_t c = 0; c < kVecs; ++c)
      store16(out + g * D + c * kLanes, acc[g][c] / totals[g]);
}

// How many query heads of a group attend_heads takes at once for head size D (its accumulators
// are kG * D floats: up to 256 of them, 16 AVX-512 registers). 1: attend_row, head by head.
int64_t heads_at_once(int64_t D, int64_t group) {
  const int64_t cap = D == 64 ? 4 : D == 128 ? 2 : 1;
  return std::min(cap, group);
}

using GroupFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, float, float*,
                         float*);

GroupFn group_kernel(int64_t D, int64_t heads) {
  if (D == 64) {
    static const GroupFn by_heads[] = {nullptr, nullptr, attend_heads<64, 2>,
                                       attend_heads<64, 3>, attend_heads<64, 4>};
    return by_heads[heads];
  }
  return heads == 2 && D == 128 ? attend_heads<128, 2> : nullptr;
}

// Any head size, one float at a time (no model of ours needs it; kept for generality).
void attend_row_any(const float* q, const float* k, const float* v, int64_t stride,
                    int64_t visible, int64_t D, float scale, float* scores, float* out) {
  float best = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[j * stride + d];
    scores[j] = s * scale;
    best = std::max(best, scores[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < visible; ++j) total += (scores[j] = std::exp(scores[j] - best));
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < visible; ++j)
    for (int64_t d = 0; d < D; ++d) out[d] += scores[j] * v[j * stride + d];
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
// position start + i) sees slots 0..start + i. Each (row, head) is computed alone by attend_row,
// so a row's result does not depend on how many rows share the call: a (k+1)-row verification
// gives bitwise the rows of k+1 one-row steps.
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
  const float scale =
      std::isnan(scale_or_nan) ? float(1.0 / std::sqrt(double(D))) : float(scale_or_nan);
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  float* op_ = out.mutable_data_ptr<float>();
  const int64_t group = Hq / Hkv;
  // Tasks: (query row, KV head, chunk of the heads that share it), spread over ExecuTorch's
  // thread pool (XNNPACK's pool too). The chunks depend on the head counts only.
  const int64_t at_once = heads_at_once(D, group);
  const int64_t chunks = (group + at_once - 1) / at_once;
  auto attend = [&](size_t task) {
    const int64_t i = int64_t(task) / (Hkv * chunks);
    const int64_t kvh = int64_t(task) / chunks % Hkv, c = int64_t(task) % chunks;
    const int64_t h0 = kvh * group + c * at_once, heads = std::min(at_once, group - c * at_once);
    const int64_t visible = start + i + 1;
    thread_local std::vector<float> scores;
    scores.resize(heads * (visible + kLanes));
    const float* qi = qp + (i * Hq + h0) * D;
    float* oi = op_ + (i * Hq + h0) * D;
    if (GroupFn many = heads > 1 ? group_kernel(D, heads) : nullptr) {
      many(qi, kp + kvh * D, vp + kvh * D, Hkv * D, visible, scale, scores.data(), oi);
      return;
    }
    auto row = D == 64    ? attend_row<64>
               : D == 128 ? attend_row<128>
               : D % kLanes == 0 && D <= 256 ? attend_row<0>
                                 : attend_row_any;
    for (int64_t g = 0; g < heads; ++g)
      row(qi + g * D, kp + kvh * D, vp + kvh * D, Hkv * D, visible, D, scale, scores.data(),
          oi + g * D);
  };
  executorch::extension::threadpool::get_threadpool()->run(attend, size_t(T * Hkv * chunks));
  return true;
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
  };
  register_missing(kernels, 1);
}

}  // namespace mtp
