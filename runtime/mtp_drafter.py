"""The mtp drafter: runs an MTP head recurrently for k steps from the target's last hidden state.

The compute is one injected function, `step_fn(h [T, D], tokens [T], position) -> (draft_logits
[1, Vd], next h [1, D])` (of the last row), so that an exported program (e.g. an ExecuTorch
method) can replace the eager head without touching the drafting logic. `position` is where the
first row sits: a head that reads the target's cache writes its K/V into the target's last-layer
cache there (mtp.py explains why that is safe) and attends to the slots up to it; a "self"
(EAGLE) head writes and reads its own cache. T is 1 except for a self head's first call of a
draft, which feeds the rows the last verification added (the whole prompt after prefill). Draft
logits cover the head's reduced vocabulary; `draft_ids` maps them back to target token ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mtp_edge.errors import UserError
from mtp_edge.model import Transformer
from mtp_edge.mtp import MTPHead, apply_rope
from mtp_edge.runtime.drafters import Draft
from mtp_edge.runtime.sampling import row_maxima
from mtp_edge.runtime.session import Session

StepFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def eager_step_fn(head: MTPHead, target: Transformer) -> StepFn:
    """The head in PyTorch on the eager target: its embedding table and, for heads that read
    it, its last layer's static cache (the one the eager session decodes with); a self head
    gets a static cache of its own, as long as the target's."""
    own: dict[str, torch.Tensor] = {}

    def own_attend_at(position: int, rows: int):
        c = head.config
        if own.get("k") is None or own["k"].shape[2] != target.max_seq_len:
            shape = (1, c.num_kv_heads, target.max_seq_len, c.head_dim)
            own["k"] = torch.zeros(shape, dtype=target.dtype)
            own["v"] = torch.zeros(shape, dtype=target.dtype)
        positions = torch.arange(position, position + rows)
        cos, sin = target.rope_cos[positions], target.rope_sin[positions]
        # Slot p - 1 for the input that reads the token at p (nothing reads the token at 0).
        slots, end = positions - 1, position + rows - 1
        mask = torch.arange(end)[None] <= slots[:, None]

        def attend(q, k, v):  # q [T, H, hd], k/v [T, KVH, hd]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            own["k"][0, :, slots] = k.transpose(0, 1)
            own["v"][0, :, slots] = v.transpose(0, 1)
            keys, values = own["k"][:, :, :end], own["v"][:, :, :end]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True
            )
            return out[0].transpose(0, 1)  # [T, H, hd]

        return attend

    def attend_at(position: int):
        cache = target.layers[-1].self_attn.cache
        cos, sin = target.rope_cos[position], target.rope_sin[position]

        def attend(q, k, v):  # q [1, H, hd], k/v [1, KVH, hd]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.k[:, :, position] = k
            cache.v[:, :, position] = v
            keys, values = cache.k[:, :, : position + 1], cache.v[:, :, : position + 1]
            out = F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)
            return out[:, :, 0]  # [1, H, hd]

        return attend

    @torch.inference_mode()
    def step(h: torch.Tensor, tokens: torch.Tensor, position: int):
        attend = None
        if head.reads_target_cache:
            attend = attend_at(position)
        elif head.has_own_cache:
            attend = own_attend_at(position, len(tokens))
        logits, g = head.step(h, target.embed_tokens(tokens), attend)
        return logits[-1:], g[-1:]

    return step


class MtpDrafter:
    """Drafts from the target's hidden state at the position of context[-2] (whose logits chose
    context[-1]) and the embedding of context[-1].

    Greedy: the argmax of the draft logits. Sampling: tokens are drawn from q, the sampler's
    distribution over the draft logits placed in the full target vocabulary (zero elsewhere),
    and q is returned so that rejection sampling stays exact. Drafting stops early when q's best
    probability is below `min_confidence` (0 = always draft k); the rule looks only at q, before
    drawing, so the drawn tokens stay distributed as q.

    A self head (`feeds_context`) first feeds every row of `hidden` (the positions the last
    verification added; the whole prompt after prefill) with the tokens that follow them, which
    fills its cache with the verified text's features and gives the first draft from the last.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(
        self,
        step_fn: StepFn,
        draft_ids: torch.Tensor,
        vocab_size: int,
        min_confidence: float = 0.0,
        cache_len: Callable[[], int] | None = None,
        feeds_context: bool = False,
    ):
        if not 0 <= min_confidence < 1:
            raise UserError(f"draft confidence threshold must be in [0, 1), got {min_confidence}")
        self.step_fn = step_fn
        self.draft_ids = draft_ids.to(torch.long)
        self.vocab_size = vocab_size
        self.min_confidence = min_confidence
        # For a head that writes the target's cache: its length (drafting stops at its end).
        self.cache_len = cache_len
        self.feeds_context = feeds_context

    def observe(self, context, hidden) -> None:
        """A self head's cache takes in the verified rows of a step it did not draft for."""
        if self.feeds_context and hidden is not None and len(hidden):
            position = len(context) - len(hidden)
            self.step_fn(hidden, torch.tensor(context[-len(hidden) :]), position)

    def propose(self, context, hidden, k, sampler) -> Draft:
        if hidden is None or len(hidden) == 0:
            return Draft([])
        position = len(context) - 1
        if self.cache_len is not None:
            k = min(k, self.cache_len() - position)
        if k <= 0:  # nothing to draft, but a self head's cache must still take in the rows
            self.observe(context, hidden)
            return Draft([])
        if self.feeds_context:  # rows at positions len(context) - 1 - T .. len(context) - 2
            h, feed = hidden, context[-len(hidden) :]
        else:
            h, feed = hidden[-1:], context[-1:]
        position -= len(feed) - 1
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            logits, h = self.step_fn(h, torch.tensor(feed), position)
            position += len(feed)
            logits = logits[0]
            if sampler.greedy:
                best = row_maxima(logits)[1][0]
                if self.min_confidence > 0:
                    confidence = torch.softmax(logits.to(torch.float64), -1)[best]
                    if confidence < self.min_confidence:
                        break
                token = int(self.draft_ids[best])
            else:
                # Filtering the draft logits alone equals filtering the full vocabulary with -inf
                # outside it (those tokens carry no mass and never pass top-k or top-p first).
                q_draft = sampler.probs(logits)
                if q_draft.max() < self.min_confidence:
                    break
                token = int(self.draft_ids[sampler.sample(q_draft)])
                q = torch.zeros(self.vocab_size, dtype=q_draft.dtype)
                probs.append(q.index_copy_(0, self.draft_ids, q_draft))
            tokens.append(token)
            feed = [token]
        return Draft(tokens, torch.stack(probs) if probs else None)


def mtp_drafter(head: MTPHead, target: Transformer, min_confidence: float = 0.0) -> MtpDrafter:
    """The eager drafter on the eager target (whose session must have set up its cache)."""
    return MtpDrafter(
        eager_step_fn(head, target),
        head.draft_ids,
        head.config.vocab_size,
        min_confidence,
        (lambda: target.max_seq_len) if head.config.attention != "none" else None,
        feeds_context=head.has_own_cache,
    )


def measure_step_cost(
    step_fn: StepFn,
    target: Session,
    hidden_size: int,
    dtype: torch.dtype = torch.float32,
    repeats: int = 20,
) -> dict:
    """Milliseconds of one draft step and of one single-token target step, and their ratio.

    Each is the best of `repeats` calls after a warm-up call. The target step writes at position 0
    of its cache (so call this before generating, not during it) and attends to one slot: a
    lower bound on a decode step, whose cost is dominated by reading the weights anyway. The
    draft step runs at position 1 (a head that reads the cache attends to two slots).
    """
    h = torch.zeros(1, hidden_size, dtype=dtype)
    token = torch.tensor([0])

    def best_of(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    draft_ms = best_of(lambda: step_fn(h, token, 1))
    target_ms = best_of(lambda: target.forward([0], 0))
    return {"draft_ms": draft_ms, "target_ms": target_ms, "ratio": draft_ms / target_ms}
