// The library the Python runtime loads (mtp_edge/ops.py) so that ExecuTorch programs calling
// mtp_edge::sdpa and mtp_edge::linear_i8 run under executorch.runtime with the same kernels as
// the native runner. It registers only our own ops: ExecuTorch's Python extension brings its
// own llama:: kernels.
#include "llama_ops.h"

namespace {
const bool registered = (mtp::register_mtp_ops(), true);
}  // namespace
