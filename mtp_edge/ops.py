"""Our own ops: the attention `mtp_edge::sdpa`, the linears `linear_i8`, `linear_i4`, `linear_i6`.

`mtp_edge::sdpa` is causal SDPA over a static KV cache, computed one (row, head) at a time so
that a row's result does not depend on how many rows share the call.

This module is shared ground: the exporter traces programs that call the ops, the runtime runs
them. It holds the ops' definitions and their eager references; the compiled kernels that
ExecuTorch runs live in runtime/native/src/llama_ops.cpp and int8_linear.cpp (loaded by
runtime/executorch_ops.py).

Why not ExecuTorch's `llama.custom_sdpa`: its rows move by a few ulps with the number of rows in
a call (and with the row's place in it), and in a model with 8-bit dynamically quantized
activations those ulps grow into different tokens. Speculative decoding must give the tokens
plain decoding gives, so with ExecuTorch's op every row of a verification had to be its own
one-row call (reading the whole cache once per row). With this op a (k+1)-token verification is
one call whose rows are bitwise the single steps', and every runtime runs the same kernel.

`mtp_edge::linear_i8` is a linear layer with 8da8w's numbers (int8 weights with a scale per
output channel, activations quantized to int8 per row at run time) for the `8da8w-avx2` scheme:
its kernel takes up to 6 rows per pass over the weights where XNNPACK's int8 GEMM on a CPU without
an int8 dot product takes 4, so a verification of up to 5 drafts reads the weights once. Its
sums are exact integers: every CPU and every tile computes the same bits, and the eager
reference here computes them too.

`mtp_edge::linear_i4` is the same for 4-bit weights in groups of 32 (float16 scales), the
4-bit layers of `8da4w-mix-avx2`: XNNPACK's groupwise 4-bit GEMM takes 3 rows a pass on AVX2,
this kernel 6. A group's sum is an exact integer and the groups join in a fixed order, so its
rows too are the same bits on every CPU and in every tile. `mtp_edge::linear_i6` is the same with
6-bit values, for an LM head (as llama.cpp's Q4_K_M keeps its output tensor in Q6_K).

`mtp_edge::rms_norm`, `rope` and `swiglu` are the element-wise work between those linears (the
norm, the rotary embedding, silu(gate) x up), one op each: in XNNPACK they were ~5 delegate calls
a layer, whose fixed cost (~9 us each on an x86 core) came to 4-9% of a forward. Programs whose
linears all run in our kernels call these instead and need no XNNPACK at all. Each row is computed
alone, so a row's bits do not depend on the other rows of the call.
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


# Int8 linear layers. A float32 epsilon bounds the activation scale from below, as torchao's.
_EPS = torch.finfo(torch.float32).eps
BLOCK = 16  # output channels per block of the packed weight
LINEAR_I8_ROWS = 6  # rows the kernel takes per pass over the weights (int8_linear.cpp kRowsMax)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x [R, K] as int8 values (in a float tensor), with its scale and zero point
    ([R, 1] each): the range [min(x, 0), max(x, 0)] in 255 steps, rounded half to even. The
    kernel (int8_linear.cpp quantize_row) computes the same float32 operations."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=_EPS)
    zero = torch.round(-128 - lo / scale).clamp(-128, 127)
    return (torch.round(x / scale) + zero).clamp(-128, 127), scale, zero


def quantize_weight(weight: torch.Tensor, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as int8 with one symmetric scale per output channel, `rows`
    channels at a time (a vocabulary-sized head's float temporaries stay a block's size)."""
    values, scales = [], []
    for start in range(0, weight.shape[0], rows):
        block = weight[start : start + rows].detach().float()
        scale = (block.abs().amax(1) / 127).clamp(min=_EPS)
        values.append(torch.round(block / scale[:, None]).clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    return torch.cat(values), torch.cat(scales)


def pack_weight(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in the kernel's layout (int8_linear.cpp): blocks of 16 channels (N padded with
    zero rows), in each a 32-byte group per pair of columns (K padded to even): channels 0-7 as
    (k, k + 1) pairs, then 8-15. One dimension: the layout is the kernel's business."""
    n, k = q.shape
    rows, cols = -(-n // BLOCK) * BLOCK, k + k % 2
    padded = torch.zeros(rows, cols, dtype=torch.int8)
    padded[:n, :k] = q
    blocks = padded.view(rows // BLOCK, 2, 8, cols // 2, 2).permute(0, 3, 1, 2, 4)
    return blocks.contiguous().view(-1)


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_weight's inverse: int8 [n, k]."""
    rows, cols = -(-n // BLOCK) * BLOCK, k + k % 2
    blocks = packed.view(rows // BLOCK, cols // 2, 2, 8, 2).permute(0, 2, 3, 1, 4)
    return blocks.reshape(rows, cols)[:n, :k]


def linear_i8(x, weight, weight_scale, weight_sum, bias=None, channels: int = 8192):
    """Eager reference of mtp_edge::linear_i8: x [..., K] float32 -> [..., N], the kernel's bits.
    The integer sums are exact in float64 (|sum| < 2^53); the rest is the kernel's float32
    operations in its order. `channels` (a multiple of 16: whole blocks of the packed weight)
    output channels at a time, so a vocabulary-sized head never has a float64 copy."""
    k, n = x.shape[-1], weight_scale.numel()
    q, scale, zero = quantize_rows(x.reshape(-1, k).float())
    q = q.double()
    pairs = (k + k % 2) // 2
    pieces = []
    for c0 in range(0, n, channels):
        c1 = min(n, c0 + channels)
        block = weight[c0 * 2 * pairs : -(-c1 // BLOCK) * BLOCK * 2 * pairs]
        w = unpack_weight(block, c1 - c0, k).double()
        sums = q @ w.T - zero.double() * weight_sum[c0:c1].double()
        pieces.append(sums.float() * (scale * weight_scale[c0:c1]))
    out = torch.cat(pieces, 1)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


# 4-bit linear layers (mtp_edge::linear_i4): weights in [-8, 7] with a float16 scale per group
# of GROUP4 input columns of an output channel, activations as linear_i8's.
GROUP4 = 32  # input columns per scale (int8_linear.cpp kGroup4)


def quantize_weight4(weight: torch.Tensor, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] (K a multiple of GROUP4) as int8 values in [-8, 7] and float16
    scales [N, K / GROUP4]: each group's largest magnitude maps to 7.5 (torchao's symmetric
    4-bit rule), the scale rounded to float16 before the values are rounded with it. `rows`
    channels at a time."""
    return _quantize_grouped(weight, 7.5, -8, 7, rows)


def pack_weight4(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values in [-8, 7] [N, K] and float16 scales [N, K / GROUP4] in the kernel's layout
    (int8_linear.cpp): blocks of 16 channels (N padded with zero channels), in each block per
    group per 4 columns 32 bytes, byte 4 l + i holding column 4 j + i of channel l (low nibble)
    and of channel 8 + l (high nibble), as value + 8; the scales per block per group as 16
    float16. Returns (uint8 weights, float16 scales), both one dimension."""
    n, k = q.shape
    rows, groups = -(-n // BLOCK) * BLOCK, k // GROUP4
    u = torch.full((rows, k), 8, dtype=torch.uint8)
    u[:n] = (q.to(torch.int16) + 8).to(torch.uint8)
    # [block, half, l, group, quad, i] -> [block, group, quad, l, i, half]
    u = u.view(rows // BLOCK, 2, 8, groups, GROUP4 // 4, 4).permute(0, 3, 4, 2, 5, 1)
    packed = u[..., 0] | (u[..., 1] << 4)
    s = torch.zeros(rows, groups, dtype=torch.float16)
    s[:n] = scale
    s = s.view(rows // BLOCK, BLOCK, groups).transpose(1, 2)
    return packed.contiguous().view(-1), s.contiguous().view(-1)


def unpack_weight4(packed: torch.Tensor, scales: torch.Tensor, n: int, k: int):
    """pack_weight4's inverse: (values int8 [n, k] in [-8, 7], float16 scales [n, k / GROUP4])."""
    rows, groups = -(-n // BLOCK) * BLOCK, k // GROUP4
    both = packed.view(rows // BLOCK, groups, GROUP4 // 4, 8, 4, 1)
    u = torch.cat([both & 15, both >> 4], -1)  # [block, group, quad, l, i, half]
    q = u.permute(0, 5, 3, 1, 2, 4).reshape(rows, k)[:n].to(torch.int8) - 8
    s = scales.view(rows // BLOCK, groups, BLOCK).transpose(1, 2).reshape(rows, groups)[:n]
    return q, s


def weight4_sum(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The zero point's term of each channel, float32 [N]: the sum over groups, in order, of
    the group's scale times the sum of its values, each product and each sum rounded to float32
    (the kernel subtracts a row's zero point times this)."""
    w = q.view(q.shape[0], -1, GROUP4).sum(-1, dtype=torch.int32).float()
    s = scale.float()
    total = torch.zeros(q.shape[0])
    for g in range(w.shape[1]):
        total = total + w[:, g] * s[:, g]
    return total


def linear_i4(x, weight, weight_scale, weight_sum, bias=None, cells: int = 1 << 25):
    """Eager reference of mtp_edge::linear_i4: x [..., K] float32 -> [..., N], the kernel's
    bits. Per row and channel: a group's sum S of value x activation is exact (float64 here),
    acc += float(S) x the group's scale in group order (two float32 roundings a group), then
    out = (acc - zero x weight_sum) x row scale + bias, one rounding a step. `cells` bounds
    rows x channels x groups of float64 held at once."""
    k, n = x.shape[-1], weight_sum.numel()
    values, scales = unpack_weight4(weight, weight_scale, n, k)
    return _grouped_linear(x, values, scales, weight_sum, bias, cells)


def _grouped_linear(x, values, scales, weight_sum, bias, cells: int):
    """linear_i4's and linear_i6's arithmetic on unpacked values [N, K] and scales [N, K / 32]."""
    k, n = x.shape[-1], weight_sum.numel()
    groups = k // GROUP4
    q, scale, zero = quantize_rows(x.reshape(-1, k).float())
    rows = q.shape[0]
    qg = q.double().view(rows, groups, GROUP4).transpose(0, 1)  # [G, R, 32]
    step = max(1, cells // max(1, rows * groups))
    pieces = []
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        w = values[c0:c1].double().view(c1 - c0, groups, GROUP4).permute(1, 2, 0)  # [G, 32, n]
        sums = torch.bmm(qg, w).float()  # exact: |S| <= 32 x 32 x 128 < 2^24
        s = scales[c0:c1].float()
        acc = torch.zeros(rows, c1 - c0)
        for g in range(groups):
            acc = acc + sums[g] * s[:, g]
        pieces.append((acc - zero * weight_sum[c0:c1]) * scale)
    out = torch.cat(pieces, 1)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


# 6-bit linear layers (mtp_edge::linear_i6): weights in [-32, 31] with a float16 scale per group
# of GROUP4 input columns, activations as linear_i8's; for an LM head, the layer whose 4-bit
# rounding costs the most (llama.cpp's Q4_K_M keeps its output tensor in 6 bits, Q6_K).


def quantize_weight6(weight: torch.Tensor, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight4 with 6-bit values: each group's largest magnitude maps to 31.5, values
    in [-32, 31]."""
    return _quantize_grouped(weight, 31.5, -32, 31, rows)


def _quantize_grouped(weight, top: float, low: int, high: int, rows: int):
    values, scales = [], []
    tiny = torch.finfo(torch.float16).tiny
    for start in range(0, weight.shape[0], rows):
        block = weight[start : start + rows].detach().float()
        groups = block.view(block.shape[0], -1, GROUP4)
        scale = (groups.abs().amax(-1) / top).clamp(min=tiny).half()
        q = torch.round(groups / scale.float()[..., None]).clamp(low, high).to(torch.int8)
        values.append(q.view(block.shape))
        scales.append(scale)
    return torch.cat(values), torch.cat(scales)


def pack_weight6(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values in [-32, 31] [N, K] and float16 scales [N, K / GROUP4] in the kernel's layout
    (int8_linear.cpp): stored as value + 32, blocks of 16 channels (N padded with zero
    channels), per group 384 bytes: first the low 4 bits as pack_weight4 lays them out (256
    bytes), then the top 2 bits, 16 bytes per 4 columns: byte 4 l + i (l < 4) holds in bits 0-1,
    2-3, 4-5, 6-7 column 4 j + i of channels l, 8 + l, 4 + l, 12 + l. Scales as pack_weight4's."""
    n, k = q.shape
    rows, groups = -(-n // BLOCK) * BLOCK, k // GROUP4
    u = torch.full((rows, k), 32, dtype=torch.uint8)
    u[:n] = (q.to(torch.int16) + 32).to(torch.uint8)
    padded = torch.zeros(rows, groups, dtype=torch.float16)
    padded[:n] = scale
    # The low 4 bits and the scales: pack_weight4's layout of (u & 15) - 8, every row given.
    low, scales = pack_weight4((u & 15).to(torch.int8) - 8, padded)
    # [block, half, m, l, group, quad, i] -> [block, group, quad, l, i, m, half]
    top = (u >> 4).view(rows // BLOCK, 2, 2, 4, groups, GROUP4 // 4, 4).permute(0, 4, 5, 3, 6, 2, 1)
    top = top.reshape(rows // BLOCK, groups, GROUP4 // 4, 16, 4)
    top = top[..., 0] | (top[..., 1] << 2) | (top[..., 2] << 4) | (top[..., 3] << 6)
    low = low.view(rows // BLOCK, groups, 256)
    packed = torch.cat([low, top.reshape(rows // BLOCK, groups, 128)], -1)
    return packed.contiguous().view(-1), scales


def unpack_weight6(packed: torch.Tensor, scales: torch.Tensor, n: int, k: int):
    """pack_weight6's inverse: (values int8 [n, k] in [-32, 31], float16 scales [n, k / 32])."""
    rows, groups = -(-n // BLOCK) * BLOCK, k // GROUP4
    both = packed.view(rows // BLOCK, groups, 384)
    low, scale = unpack_weight4(both[..., :256].contiguous().view(-1), scales, rows, k)
    top = both[..., 256:].reshape(rows // BLOCK, groups, GROUP4 // 4, 4, 4, 1)
    top = torch.cat([(top >> s) & 3 for s in (0, 2, 4, 6)], -1)  # [..., l, i, m * 2 + half]
    top = top.view(rows // BLOCK, groups, GROUP4 // 4, 4, 4, 2, 2)
    top = top.permute(0, 6, 5, 3, 1, 2, 4).reshape(rows, k)  # [block, half, m, l, group, quad, i]
    q = ((low + 8).to(torch.int16) | (top.to(torch.int16) << 4))[:n].to(torch.int8) - 32
    return q, scale[:n]


def linear_i6(x, weight, weight_scale, weight_sum, bias=None, cells: int = 1 << 25):
    """Eager reference of mtp_edge::linear_i6: linear_i4's arithmetic on 6-bit values
    (weight_sum: weight4_sum of the values and scales)."""
    k, n = x.shape[-1], weight_sum.numel()
    values, scales = unpack_weight6(weight, weight_scale, n, k)
    return _grouped_linear(x, values, scales, weight_sum, bias, cells)


# The element-wise glue between the linears (module doc).
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Eager reference of mtp_edge::rms_norm: weight x (x / sqrt(mean(x^2) + eps)) over the last
    dimension, in float32."""
    mean = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(mean + eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eager reference of mtp_edge::rope: x [1, T, H, D] rotated by the rows cos, sin [T, D]
    (row i for token i): x cos + rotate_half(x) sin, rotate_half(x) = (-x[D/2:], x[:D/2])."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos[None, :, None] + turned * sin[None, :, None]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Eager reference of mtp_edge::swiglu: silu(gate) x up."""
    return F.silu(gate) * up


def define() -> None:
    """Register our ops (torch.ops.mtp_edge.sdpa, linear_i8, linear_i4, linear_i6, rms_norm,
    rope, swiglu, and their .out) with torch; idempotent."""
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

    # The linears: the same signature; the output's width is weight_sum's (one per channel).
    arguments = "Tensor input, Tensor weight, Tensor weight_scale, Tensor weight_sum, Tensor? bias"
    for name, reference in (
        ("linear_i8", linear_i8),
        ("linear_i4", linear_i4),
        ("linear_i6", linear_i6),
    ):

        def linear_out(x, weight, weight_scale, weight_sum, bias, *, out, reference=reference):
            result = reference(x, weight, weight_scale, weight_sum, bias)
            out.resize_(result.shape).copy_(result)
            return out

        lib.define(f"{name}({arguments}) -> Tensor")
        lib.define(f"{name}.out({arguments}, *, Tensor(a!) out) -> Tensor(a!)")
        lib.impl(name, reference, "CPU")
        lib.impl(f"{name}.out", linear_out, "CPU")
        lib.impl(name, lambda x, w, s, t, b: x.new_empty((*x.shape[:-1], t.shape[0])), "Meta")
        lib.impl(f"{name}.out", lambda x, w, s, t, b, *, out: out, "Meta")

    lib.define("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor")
    lib.define(
        "rms_norm.out(Tensor input, Tensor weight, float eps, *, Tensor(a!) out) -> Tensor(a!)"
    )
    lib.define("rope(Tensor input, Tensor cos, Tensor sin) -> Tensor")
    lib.define("rope.out(Tensor input, Tensor cos, Tensor sin, *, Tensor(a!) out) -> Tensor(a!)")
    lib.define("swiglu(Tensor gate, Tensor up) -> Tensor")
    lib.define("swiglu.out(Tensor gate, Tensor up, *, Tensor(a!) out) -> Tensor(a!)")
    for name, reference in (("rms_norm", rms_norm), ("rope", rope), ("swiglu", swiglu)):

        def out_of(*args, out, reference=reference):
            result = reference(*args)
            out.resize_(result.shape).copy_(result)
            return out

        lib.impl(name, reference, "CPU")
        lib.impl(f"{name}.out", out_of, "CPU")
        lib.impl(name, lambda first, *rest: torch.empty_like(first), "Meta")
        lib.impl(f"{name}.out", lambda *args, out: out, "Meta")
    lib.impl("sdpa", functional, "CPU")
    lib.impl("sdpa.out", out_variant, "CPU")
    lib.impl("sdpa", lambda q, k, v, s: torch.empty_like(q), "Meta")
    lib.impl("sdpa.out", lambda q, k, v, s, *, out: out, "Meta")
    _library = lib
