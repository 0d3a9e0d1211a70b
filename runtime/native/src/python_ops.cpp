// The library the Python runtime loads (mtp_edge/ops.py) so that ExecuTorch programs calling
// mtp_edge::sdpa run under executorch.runtime with the same kernel as the native runner. It
// registers only our own op: ExecuTorch's Python extension brings its own llama:: kernels.
#include "llama_ops.h"

namespace {
const bool registered = (mtp::register_mtp_ops(), true);
}  // namespace
