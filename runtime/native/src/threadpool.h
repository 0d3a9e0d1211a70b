#pragma once
// ExecuTorch's thread pool (the one XNNPACK runs on), for our kernels: the wheel ships the
// library (libexecutorch_threadpool.so) but not its header; this is the call we make.
#include <executorch/runtime/core/function_ref.h>

#include <cstddef>

namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  void run(executorch::runtime::FunctionRef<void(size_t)> fn, size_t range);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool
