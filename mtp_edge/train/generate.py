"""Batched generation on the eager target (each row's K/V in a cache of the batch's own,
swapped in for the model's while it decodes), and one-at-a-time generation through an exported
target's session."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from mtp_edge.logs import progress_bar
from mtp_edge.model import KVCache, Transformer


def writing_bar(total: int, desc: str, unit: str, initial: int):
    """A progress bar of the text written, shown by the first process of a distributed run."""
    later = dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
    initial = initial if total is None else min(initial, total)
    return progress_bar(total, desc, unit=unit, initial=initial, disable=later)


def _batched_forward(model: Transformer, tokens, cols, offsets, key_ok, caches) -> torch.Tensor:
    """Transformer.forward with a batch dimension: tokens [B, T] at cache columns `cols` [T],
    each row's text starting at column offsets[b]; returns the last column's logits [B, V].

    A query sees the columns up to its own that hold its row's text; a padding query sees only
    itself, so that no row of the attention is empty (an empty row would be NaN, and NaN values
    poison even masked-out keys).
    """
    end = int(cols[-1]) + 1
    positions = (cols[None, :] - offsets[:, None]).clamp(min=0)
    cos, sin = model.rope_cos[positions][:, None], model.rope_sin[positions][:, None]
    keys = torch.arange(end)
    causal = keys[None, None, :] <= cols[None, :, None]
    itself = keys[None, None, :] == cols[None, :, None]
    mask = (causal & (key_ok[:, None, :end] | itself))[:, None]
    with _batch_caches(model, caches):
        hidden = model.hidden_states(tokens, cols, cos, sin, mask, end)
    return model.logits(hidden[:, -1])


@contextmanager
def _batch_caches(model: Transformer, caches):
    """Each layer attends through the batch's (K, V) in `caches` [B, KVH, S, hd] instead of the
    model's own cache, for the duration of the `with` block."""
    own = [layer.self_attn.cache for layer in model.layers]
    try:
        for layer, (k, v) in zip(model.layers, caches, strict=True):
            layer.self_attn.cache = KVCache.over(k, v)
        yield
    finally:
        for layer, cache in zip(model.layers, own, strict=True):
            layer.self_attn.cache = cache


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new: int,
    eos_ids: list[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    ended: list[bool] | None = None,
    on_step: Callable[[int], bool] | None = None,
) -> list[list[int]]:
    """Greedy (or, with a temperature, sampled) continuations of several prompts at once (eos
    left out; `ended`, if given, receives whether each row stopped at eos). `on_step`, if
    given, hears the tokens each decoding step added and answers whether to stop there (a
    deadline): the rows keep what they wrote so far, a prefix of their full continuation.

    One decode step reads the weights once for the whole batch, which is what makes writing a
    self-distillation corpus affordable on a CPU. Prompts are left-padded to a common length.
    """
    c = model.config
    longest = max(map(len, prompts))
    total = longest + max_new
    if model.max_seq_len < total:
        model.setup_cache(total)
    offsets = torch.tensor([longest - len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt)
    key_ok = torch.arange(total)[None, :] >= offsets[:, None]
    shape = (len(prompts), c.num_kv_heads, total, c.head_dim)
    caches = [
        (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
        for _ in model.layers
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    rows = list(range(len(prompts)))  # the prompt each batch row writes
    cols = torch.arange(longest)
    for step in range(max_new):
        if step == 0:  # prompts one at a time: padded together, attention would cost B x T^2
            first = []
            for b, start in enumerate(offsets.tolist()):
                first.append(
                    _batched_forward(
                        model,
                        tokens[b : b + 1, start:],
                        cols[start:],
                        offsets[b : b + 1],
                        key_ok[b : b + 1],
                        [(k[b : b + 1], v[b : b + 1]) for k, v in caches],
                    )
                )
                if on_step is not None and on_step(0):  # the deadline came while prefilling
                    if ended is not None:
                        ended[:] = [False] * len(prompts)
                    return outputs
            logits = torch.cat(first)
        else:
            logits = _batched_forward(model, tokens, cols, offsets, key_ok, caches)
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, -1)
            chosen = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            chosen = logits.argmax(-1)
        added = 0
        for row, token in zip(rows, chosen.tolist(), strict=True):
            if not done[row]:
                done[row] = token in eos_ids
                if not done[row]:
                    outputs[row].append(token)
                    added += 1
        if all(done) or (on_step is not None and on_step(added)):
            break
        tokens, cols = chosen[:, None], cols[-1:] + 1
        finished = sum(done[row] for row in rows)
        if finished * 4 >= len(rows):  # drop finished rows: they would cost as much as the rest
            keep = torch.tensor([i for i, row in enumerate(rows) if not done[row]])
            rows = [rows[i] for i in keep.tolist()]
            tokens, offsets, key_ok = tokens[keep], offsets[keep], key_ok[keep]
            caches = [(k[keep], v[keep]) for k, v in caches]
    if ended is not None:
        ended[:] = done
    return outputs


def generate_with_session(
    session, prompts: list[list[int]], max_new: int, eos_ids, on_step=None
) -> list:
    """Greedy continuations (eos left out), one prompt at a time through an exported target;
    `on_step` as in generate_batch, heard once per response (the rest are then left out)."""
    from mtp_edge.runtime.loop import GenerationConfig, generate

    config = GenerationConfig(max_new_tokens=max_new, k=0, eos_ids=tuple(eos_ids))
    outputs = []
    for prompt in prompts:
        room = session.max_seq_len - len(prompt)
        if room < 1:
            outputs.append([])
            continue
        config.max_new_tokens = min(max_new, room)
        ids = generate(session, prompt, None, config).token_ids
        outputs.append([t for t in ids if t not in eos_ids])
        if on_step is not None and on_step(len(outputs[-1])):
            break
    return outputs + [[] for _ in prompts[len(outputs) :]]
