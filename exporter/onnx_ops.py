"""onnxruntime's com.microsoft GroupQueryAttention as torch custom ops, with their
translations for torch.onnx's dynamo exporter: how exporter/onnx.py's graphs reach the
operator that updates the static cache in place. The eager implementations are references
for tracing only; ONNX Runtime runs the real operator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_edge.model import rotate_half


@torch.library.custom_op("mtp_edge::gqa", mutates_args=())
def gqa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_len: torch.Tensor,
    num_heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What GroupQueryAttention computes, in PyTorch (the exporter replaces it by the op).

    q [1, T, H*D], k/v [1, T, KV*D], caches [1, KV, S, D]; returns (out [1, T, H*D], caches with
    the new rows at seqlens_k + 1 - T ..)."""
    t, d = q.shape[1], k_cache.shape[-1]
    start = int(seqlens_k[0]) + 1 - t
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[:, :, start : start + t] = k.reshape(1, t, kv_heads, d).transpose(1, 2)
    v_cache[:, :, start : start + t] = v.reshape(1, t, kv_heads, d).transpose(1, 2)
    total = int(total_len)
    positions = torch.arange(start, start + t)
    mask = torch.arange(total)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        q.view(1, t, num_heads, d).transpose(1, 2),
        k_cache[:, :, :total],
        v_cache[:, :, :total],
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(1, t, num_heads * d), k_cache, v_cache


@gqa.register_fake
def _(q, k, v, k_cache, v_cache, seqlens_k, total_len, num_heads, kv_heads):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


def _gqa_schema(rotary: bool = False):
    """The part of onnxruntime's GroupQueryAttention schema we use. onnx ships no schemas for
    onnxruntime's contrib ops, and the exporter's tracer needs one to emit a node. With `rotary`,
    key and value may be left out (query then packs q, k and v) and the op takes the rotary
    tables and rotates q and k itself."""
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional

    def param(name: str, type_str: str, maybe: bool = False) -> OpSchema.FormalParameter:
        if maybe:
            return OpSchema.FormalParameter(name, type_str, "", param_option=optional)
        return OpSchema.FormalParameter(name, type_str)

    inputs = [
        param("query", "T"),
        param("key", "T", rotary),
        param("value", "T", rotary),
        param("past_key", "T"),
        param("past_value", "T"),
        param("seqlens_k", "M"),
        param("total_sequence_length", "M"),
    ]
    attributes = [
        OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
        OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
    ]
    if rotary:
        inputs += [param("cos_cache", "T"), param("sin_cache", "T")]
        attributes += [
            OpSchema.Attribute("do_rotary", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("rotary_interleaved", OpSchema.AttrType.INT, ""),
        ]
    return OpSchema(
        "GroupQueryAttention",
        "com.microsoft",
        1,
        inputs=inputs,
        outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], ""),
            ("M", ["tensor(int32)"], ""),
        ],
        attributes=attributes,
    )


def gqa_onnx(q, k, v, k_cache, v_cache, seqlens_k, total_len, num_heads: int, kv_heads: int):
    from onnxscript.values import Op, Opset

    op = Op(Opset("com.microsoft", 1), "GroupQueryAttention", _gqa_schema())
    return op(
        q,
        k,
        v,
        k_cache,
        v_cache,
        seqlens_k,
        total_len,
        num_heads=num_heads,
        kv_num_heads=kv_heads,
    )


@torch.library.custom_op("mtp_edge::gqa_rope", mutates_args=())
def gqa_rope(
    qkv: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_len: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupQueryAttention that also applies the rotary embedding (do_rotary, half rotation):
    one op per layer instead of gqa plus ~13 small rotary nodes. `qkv` packs q, k, v along the
    last dim when k and v are None; cos/sin are [positions, head_dim / 2] tables, read at
    seqlens_k + 1 - T ..; the rest as gqa."""
    t, d = qkv.shape[1], k_cache.shape[-1]
    if k is None:
        q, k, v = qkv.split([num_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    else:
        q = qkv
    start = int(seqlens_k[0]) + 1 - t
    c = torch.cat([cos[start : start + t]] * 2, -1)[None, :, None]
    s = torch.cat([sin[start : start + t]] * 2, -1)[None, :, None]
    q, k = q.reshape(1, t, num_heads, d), k.reshape(1, t, kv_heads, d)
    q = (q * c + rotate_half(q) * s).reshape(1, t, -1)
    k = (k * c + rotate_half(k) * s).reshape(1, t, -1)
    return gqa(q, k, v, k_cache, v_cache, seqlens_k, total_len, num_heads, kv_heads)


@gqa_rope.register_fake
def _(qkv, k, v, k_cache, v_cache, seqlens_k, total_len, cos, sin, num_heads, kv_heads):
    out = qkv.new_empty((*qkv.shape[:-1], num_heads * k_cache.shape[-1]))
    return out, torch.empty_like(k_cache), torch.empty_like(v_cache)


def gqa_rope_onnx(
    qkv, k, v, k_cache, v_cache, seqlens_k, total_len, cos, sin, num_heads: int, kv_heads: int
):
    from onnxscript.values import Op, Opset

    op = Op(Opset("com.microsoft", 1), "GroupQueryAttention", _gqa_schema(rotary=True))
    return op(
        qkv,
        k,
        v,
        k_cache,
        v_cache,
        seqlens_k,
        total_len,
        cos,
        sin,
        num_heads=num_heads,
        kv_num_heads=kv_heads,
        do_rotary=1,
        rotary_interleaved=0,
    )
