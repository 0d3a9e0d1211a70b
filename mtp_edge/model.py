"""A decoder-only transformer for the llama family (llama, qwen2, qwen3) with a static KV cache.

Every forward call takes tokens and the absolute position of the first one. Their K/V are written
into a preallocated cache at those positions and each query attends to the cache slots at or
before its own position. Rejected draft tokens therefore need no rollback: the next call writes
over their stale slots, and the mask never lets a query see past itself.

Parameter names follow transformers' checkpoints without the leading `model.` so that a
safetensors state dict loads directly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtp_edge.config import ModelConfig
from mtp_edge.errors import UserError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32, as the reference implementation does.
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    """Preallocated K/V for one layer: [1, kv_heads, max_seq_len, head_dim] (or, from `over`,
    a batch's own [B, kv_heads, S, head_dim])."""

    def __init__(self, kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (1, kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache whose K/V are the given tensors [B, kv_heads, S, head_dim] (not copies):
        `update` writes into them, as batched generation keeps one cache per row."""
        cache = cls(k.shape[1], 0, k.shape[3], k.dtype)
        cache.k, cache.v = k, v
        return cache

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
        return self.k, self.v


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3 / linear scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise UserError(f"unsupported rope scaling '{kind}': supported are llama3 and linear")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.cache: KVCache | None = None

    def forward(self, x, positions, cos, sin, mask, kv_len: int | None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = self.cache.update(positions, k, v)
        if kv_len is not None:  # eager only: skip the never-written tail of the cache
            keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, positions, cos, sin, mask, kv_len):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, mask, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_seq_len = 0

    @classmethod
    def from_state_dict(
        cls, config: ModelConfig, state_dict: dict, dtype: torch.dtype = torch.float32
    ) -> Transformer:
        """Build without allocating random weights first, so peak memory is one copy of them."""
        with torch.device("meta"):
            model = cls(config)
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        if missing or unexpected:
            raise UserError(
                f"checkpoint does not match a {config.arch} model: "
                f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
            )
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def parts(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of the parts a checkpoint fills one after another (checkpoints.py) and
        the exporter quantizes one at a time, in forward order."""
        parts = [("embed_tokens", self.embed_tokens)]
        parts += [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]
        parts.append(("norm", self.norm))
        if self.lm_head is not None:
            parts.append(("lm_head", self.lm_head))
        return parts

    def setup_cache(self, max_seq_len: int) -> None:
        """(Re)allocate the static KV cache and the rotary tables for `max_seq_len` positions."""
        dtype, c = self.dtype, self.config
        self.max_seq_len = max_seq_len
        for layer in self.layers:
            layer.self_attn.cache = KVCache(c.num_kv_heads, max_seq_len, c.head_dim, dtype)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), rope_frequencies(c))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        return_hidden: bool = False,
        kv_len: int | None = None,
    ):
        """tokens [1, T], input_pos [1] (position of tokens[0]) -> logits [1, T, vocab].

        With `return_hidden` also returns the final-normed hidden states [1, T, hidden] that the
        LM head reads. `kv_len` (eager use only) bounds attention to the first kv_len slots.
        """
        t = tokens.shape[1]
        positions = input_pos + torch.arange(t, device=tokens.device)
        cos = self.rope_cos[positions][None, None]
        sin = self.rope_sin[positions][None, None]
        span = kv_len if kv_len is not None else self.max_seq_len
        mask = torch.arange(span, device=tokens.device)[None, :] <= positions[:, None]
        hidden = self.hidden_states(tokens, positions, cos, sin, mask, kv_len)
        logits = self.logits(hidden)
        return (logits, hidden) if return_hidden else logits

    def hidden_states(self, tokens, positions, cos, sin, mask, kv_len=None) -> torch.Tensor:
        """embed -> layers -> final norm: the one trunk that every variant runs (eager, the
        exporters with their attention and MLP modules swapped in, batched training). The
        arguments after `tokens` go to each layer's attention as they are."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions, cos, sin, mask, kv_len)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (the embedding table when the model ties them)."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)  # a module: nn.Linear, or a quantized layer in its place
