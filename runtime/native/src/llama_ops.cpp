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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
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
// MTP_EDGE_BASELINE builds the baseline alone (the tests check that version too).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MTP_EDGE_BASELINE)
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

// One block of n <= kBlock keys (stride floats apart) for kG query heads sharing one KV head;
// q holds the heads' rows D floats apart. Head g's results go to acc + g * step * D (D floats),
// m[g * step] and l[g * step]. Each key and value row is loaded once for all kG heads (the
// arithmetic waited on those loads); each head keeps its own chains of sums. kD > 0 fixes the
// head size at compile time (64 and 128 cover our models), which keeps the accumulators in
// registers; kD = 0 takes any multiple of 16 up to 256.
template <int kD, int kG>
MTP_VECTOR_CLONES void block_heads(const float* q, int64_t D, const float* k, const float* v,
                                   int64_t stride, int64_t n, float scale, float* acc, float* m,
                                   float* l, int64_t step) {
  if (kD > 0) D = kD;
  constexpr int kVecsMax = kD > 0 ? kD / kLanes : 256 / kLanes;
  const int64_t vecs = D / kLanes;
  alignas(64) float scores[kG][kBlock];
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + j * stride;
    const F16 k0 = load16(kj);
    F16 part[kG];
    for (int g = 0; g < kG; ++g) part[g] = load16(q + g * D) * k0;
    for (int64_t c = 1; c < vecs; ++c) {
      const F16 kc = load16(kj + c * kLanes);
      for (int g = 0; g < kG; ++g) part[g] += load16(q + g * D + c * kLanes) * kc;
    }
    for (int g = 0; g < kG; ++g) scores[g][j] = sum16(part[g]) * scale;
  }
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  float best[kG], total[kG];
  for (int g = 0; g < kG; ++g) {
    float* sg = scores[g];
    for (int64_t j = n; j < padded; ++j) sg[j] = -INFINITY;
    F16 top = splat(-INFINITY);
    for (int64_t j = 0; j < padded; j += kLanes) {
      const F16 x = load16(sg + j);
      top = x > top ? x : top;
    }
    best[g] = max16(top);
    F16 sum = {};
    for (int64_t j = 0; j < padded; j += kLanes) {
      F16 e = exp_nonpositive(load16(sg + j) - best[g]);
      if (j + kLanes > n)  // the padding lanes weigh nothing
        for (int lane = int(n - j); lane < kLanes; ++lane) e[lane] = 0.f;
      store16(sg + j, e);
      sum += e;
    }
    total[g] = sum16(sum);
  }
  F16 out[kG][kVecsMax];
  for (int g = 0; g < kG; ++g)
    for (int64_t c = 0; c < vecs; ++c) out[g][c] = F16{};
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * stride;
    for (int64_t c = 0; c < vecs; ++c) {
      const F16 vc = load16(vj + c * kLanes);
      for (int g = 0; g < kG; ++g) out[g][c] += splat(scores[g][j]) * vc;
    }
  }
  for (int g = 0; g < kG; ++g) {
    for (int64_t c = 0; c < vecs; ++c) store16(acc + g * step * D + c * kLanes, out[g][c]);
    m[g * step] = best[g];
    l[g * step] = total[g];
  }
}

// Any head size, one head, one float at a time (no model of ours needs it; kept for generality).
void block_any(const float* q, int64_t D, const float* k, const float* v, int64_t stride,
               int64_t n, float scale, float* acc, float* m, float* l, int64_t) {
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

// How many query heads of a group block_heads takes at once for head size D (its accumulators
// are kG * D floats: up to 256 of them, 16 AVX-512 registers).
int64_t heads_at_once(int64_t D, int64_t group) {
  const int64_t cap = D == 64 ? 4 : D == 128 ? 2 : 1;
  return std::min(cap, group);
}

using BlockFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t,
                         float, float*, float*, float*, int64_t);

BlockFn block_kernel(int64_t D, int64_t heads) {
  if (D == 64) {
    static const BlockFn by_heads[] = {nullptr, block_heads<64, 1>, block_heads<64, 2>,
                                       block_heads<64, 3>, block_heads<64, 4>};
    return by_heads[heads];
  }
  if (D == 128) return heads == 2 ? block_heads<128, 2> : block_heads<128, 1>;
  return D % kLanes == 0 && D <= 256 ? block_heads<0, 1> : block_any;
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
  // Row i's block b for the heads of (KV head kvh, chunk c) into the partials, and the merge of
  // row i's blocks for those heads into out.
  auto block = [&](int64_t i, int64_t b, int64_t kvh, int64_t c) {
    const int64_t h0 = kvh * group + c * at_once, heads = std::min(at_once, group - c * at_once);
    const int64_t first = b * kBlock, n = std::min(kBlock, start + i + 1 - first);
    const int64_t e = (i * Hq + h0) * blocks + b;
    block_kernel(D, heads)(qp + (i * Hq + h0) * D, D, kp + (first * Hkv + kvh) * D,
                           vp + (first * Hkv + kvh) * D, Hkv * D, n, scale, acc + e * D, top + e,
                           total + e, blocks);
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
  // tasks are (row, KV head, chunk), each doing its row's blocks one after another and the
  // merge: more, evener tasks than one per block. Same blocks, same arithmetic, same rows.
  if (T > 1 && blocks <= 2) {
    pool->run(
        [&](size_t task) {
          const int64_t i = int64_t(task) / (Hkv * chunks), rest = int64_t(task) % (Hkv * chunks);
          const int64_t c = rest % chunks, kvh = rest / chunks;
          for (int64_t b = 0; b < (start + i + kBlock) / kBlock; ++b) block(i, b, kvh, c);
          merge(i, kvh, c);
        },
        size_t(T * Hkv * chunks));
    return true;
  }
  // Otherwise a task is one block of one (KV head, chunk) for every row that sees into it. Each
  // (row, KV head, chunk) counts down the blocks still to do; the task that does its last block
  // merges them (reading what other threads wrote), so the merges run in parallel too. Which
  // thread merges does not change the arithmetic.
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
        for (int64_t i = std::max<int64_t>(0, b * kBlock - start); i < T; ++i) {
          block(i, b, kvh, c);
          if (counts[(i * Hkv + kvh) * chunks + c].fetch_sub(1, std::memory_order_acq_rel) == 1)
            merge(i, kvh, c);
        }
      },
      size_t(Hkv * chunks * blocks));
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
