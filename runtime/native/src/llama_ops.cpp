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

#include <cmath>
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

// One query row against `visible` cache rows (stride `stride` floats apart): softmax(q.k * scale)
// weighted sum of v into `out`. The dot product keeps eight partial sums so that it vectorizes
// (one running sum is a dependency chain the compiler may not reorder). kD > 0 fixes the head
// size at compile time (64 and 128 cover our models), which keeps the output accumulator in
// registers; kD = 0 reads it from D.
template <int kD>
MTP_VECTOR_CLONES void attend_row(const float* q, const float* k, const float* v, int64_t stride,
                                  int64_t visible, int64_t D, float scale, float* scores,
                                  float* out) {
  if (kD > 0) D = kD;
  float best = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    const float* kj = k + j * stride;
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
      for (int l = 0; l < 8; ++l) part[l] += q[d + l] * kj[d + l];
    float rest = 0.f;
    for (; d < D; ++d) rest += q[d] * kj[d];
    scores[j] = (((part[0] + part[1]) + (part[2] + part[3])) +
                 ((part[4] + part[5]) + (part[6] + part[7])) + rest) *
                scale;
    best = std::max(best, scores[j]);
  }
  float acc[kD > 0 ? kD : 256];
  float* a = kD > 0 || D <= 256 ? acc : out;  // a larger head accumulates in place
  for (int64_t d = 0; d < D; ++d) a[d] = 0.f;
  float total = 0.f;
  for (int64_t j = 0; j < visible; ++j) total += (scores[j] = std::exp(scores[j] - best));
  for (int64_t j = 0; j < visible; ++j) {  // no call in this loop: a stays in registers
    const float* vj = v + j * stride;
    for (int64_t d = 0; d < D; ++d) a[d] += scores[j] * vj[d];
  }
  for (int64_t d = 0; d < D; ++d) out[d] = a[d] / total;
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
  // One task per (query, head), spread over ExecuTorch's thread pool (XNNPACK's pool too).
  auto attend = [&](size_t task) {
    const int64_t i = int64_t(task) / Hq, h = int64_t(task) % Hq, kvh = h / group;
    const int64_t visible = start + i + 1;
    thread_local std::vector<float> scores;
    scores.resize(visible);
    auto row = D == 64 ? attend_row<64> : D == 128 ? attend_row<128> : attend_row<0>;
    row(qp + (i * Hq + h) * D, kp + kvh * D, vp + kvh * D, Hkv * D, visible, D, scale,
        scores.data(), op_ + (i * Hq + h) * D);
  };
  executorch::extension::threadpool::get_threadpool()->run(attend, size_t(T * Hq));
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
