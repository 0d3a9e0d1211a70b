"""Training-time attention: every origin's draft steps at once (MTPHead.forward's context)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mtp_edge.mtp import Attend, apply_rope


@dataclass
class TrainContext:
    """What training-time attention reads for B sequences padded to length L: the target's
    last-layer keys (rotary applied) and values per position, and the rotary tables."""

    k: torch.Tensor | None  # [B, L, KVH, hd] (None for a "self" head: its own, from step 0)
    v: torch.Tensor | None  # [B, L, KVH, hd]
    key_ok: torch.Tensor  # [B, L] bool: a real position, not padding
    cos: torch.Tensor  # [L + J, hd] by position
    sin: torch.Tensor

    def attends(self, kind: str) -> Iterator[Attend]:
        """The attention of each draft step in turn, for a head whose MTPConfig.attention is
        `kind` ("target_cache" or "self"); MTPHead.forward draws one per step, after running
        the previous one."""
        own: list = []
        if kind != "self":
            for j in itertools.count():
                yield training_attend(self, j, own)
        first: list = []
        yield training_self_attend(self, first)
        ((k0, v0),) = first  # later steps attend to step 0's K/V, as to a cache
        context = TrainContext(k0, v0, self.key_ok, self.cos, self.sin)
        for j in itertools.count():
            yield training_attend(context, j, own)


def training_attend(context: TrainContext, step: int, own: list) -> Attend:
    """Attention of draft step `step` (0-based) from every origin t at once (EAGLE-3's
    training-time test with the target's cache as the context): the query, at position
    t + step + 1, sees the target's keys at positions <= t and the head's own keys of steps
    0..step from the same origin — exactly the cache slots drafting will have written."""
    b, length = context.key_ok.shape
    device = context.key_ok.device
    positions = torch.arange(length, device=device) + step + 1
    cos, sin = context.cos[positions], context.sin[positions]  # [L, hd]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]
    causal = causal & context.key_ok[:, None]

    def attend(q, k, v):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        own.append((k, v))
        kv_heads, head_dim = k.shape[-2], k.shape[-1]
        q = q.unflatten(-2, (kv_heads, -1))  # [B, L, KVH, G, hd]
        scale = head_dim**-0.5
        scores = torch.einsum("blkgd,bskd->bkgls", q, context.k.to(q.dtype)) * scale
        scores = scores.masked_fill(~causal[:, None, None], float("-inf"))
        own_k = torch.stack([kk for kk, _ in own], dim=2)  # [B, L, S, KVH, hd]
        own_v = torch.stack([vv for _, vv in own], dim=2)
        own_scores = torch.einsum("blkgd,blskd->bkgls", q, own_k) * scale
        weights = torch.softmax(torch.cat((scores, own_scores), -1).float(), -1).to(q.dtype)
        out = torch.einsum("bkgls,bskd->blkgd", weights[..., :length], context.v.to(q.dtype))
        out = out + torch.einsum("bkgls,blskd->blkgd", weights[..., length:], own_v)
        return out.flatten(-3, -2)  # [B, L, H, hd]

    return attend


def training_self_attend(context: TrainContext, keep: list) -> Attend:
    """Step 0 of a "self" head from every origin at once: the query from origin t sees the
    head's keys from origins <= t, all made from the target's hidden states (the verified text,
    as the drafter's cache holds it). The K/V are kept (in `keep`) as the context later steps
    attend to through `training_attend`."""
    length = context.key_ok.shape[1]
    # Origin t at rotary position t (drafting puts it at t + 1: rotary scores depend only on
    # the distance between positions, so the two agree).
    cos, sin = context.cos[:length], context.sin[:length]
    causal = torch.ones(length, length, dtype=torch.bool, device=context.key_ok.device).tril()
    causal = causal[None] & context.key_ok[:, None]

    def attend(q, k, v):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keep.append((k, v))
        kv_heads, head_dim = k.shape[-2], k.shape[-1]
        q = q.unflatten(-2, (kv_heads, -1))  # [B, L, KVH, G, hd]
        scores = torch.einsum("blkgd,bskd->bkgls", q, k) * head_dim**-0.5
        scores = scores.masked_fill(~causal[:, None, None], float("-inf"))
        weights = torch.softmax(scores.float(), -1).to(q.dtype)
        return torch.einsum("bkgls,bskd->blkgd", weights, v).flatten(-3, -2)

    return attend
