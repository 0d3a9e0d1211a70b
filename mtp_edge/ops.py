"""Our own attention op, `mtp_edge::sdpa`: causal SDPA over a static KV cache, computed one
(row, head) at a time so that a row's result does not depend on how many rows share the call.

This module is shared ground: the exporter traces programs that call the op, the runtime runs
them. It holds the op's definition and its eager reference; the compiled kernel that ExecuTorch
runs lives in runtime/native/src/llama_ops.cpp (loaded by runtime/executorch_ops.py).

Why not ExecuTorch's `llama.custom_sdpa`: its rows move by a few ulps with the number of rows in
a call (and with the row's place in it), and in a model with 8-bit dynamically quantized
activations those ulps grow into different tokens. Speculative decoding must give the tokens
plain decoding gives, so with ExecuTorch's op every row of a verification had to be its own
one-row call (reading the whole cache once per row). With this op a (k+1)-token verification is
one call whose rows are bitwise the single steps', and every runtime runs the same kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_library: torch.library.Library | None = None


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int):
    """Eager reference: q [1, T, H, D], caches [1, S, KVH, D]; row i sees slots 0..start + i."""
    t, heads = q.shape[1], q.shape[2]
    n = start + t
    k = k_cache[:, :n].transpose(1, 2)
    v = v_cache[:, :n].transpose(1, 2)
    group = heads // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    visible = torch.arange(n)[None] <= (start + torch.arange(t))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible)
    return out.transpose(1, 2).contiguous()


def define() -> None:
    """Register torch.ops.mtp_edge.sdpa (and .out) with torch; idempotent."""
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("mtp_edge", "DEF")
    lib.define("sdpa(Tensor query, Tensor k_cache, Tensor v_cache, SymInt start_pos) -> Tensor")
    lib.define(
        "sdpa.out(Tensor query, Tensor k_cache, Tensor v_cache, SymInt start_pos, *, "
        "Tensor(a!) out) -> Tensor(a!)"
    )

    def functional(q, k_cache, v_cache, start_pos):
        return attention(q, k_cache, v_cache, int(start_pos))

    def out_variant(q, k_cache, v_cache, start_pos, *, out):
        out.resize_(q.shape).copy_(attention(q, k_cache, v_cache, int(start_pos)))
        return out

    lib.impl("sdpa", functional, "CPU")
    lib.impl("sdpa.out", out_variant, "CPU")
    lib.impl("sdpa", lambda q, k, v, s: torch.empty_like(q), "Meta")
    lib.impl("sdpa.out", lambda q, k, v, s, *, out: out, "Meta")
    _library = lib
