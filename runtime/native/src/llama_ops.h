#pragma once

namespace mtp {

// Registers kernels for the two custom ops our target programs use, llama::update_cache.out and
// llama::custom_sdpa.out, unless a linked library registered them already (ExecuTorch's Android
// AAR does; the pip wheel ships them only inside its Python extension, which a standalone program
// cannot link). Idempotent; call before loading a program.
void register_llama_ops();

// Registers our own kernels, unless already registered: the attention mtp_edge::sdpa.out
// (row-exact causal SDPA; the programs mtp-export writes call it) and the int8 linear
// (int8_linear.h). register_llama_ops calls it too; the Python runtime loads it through
// python_ops.cpp.
void register_mtp_ops();

}  // namespace mtp
