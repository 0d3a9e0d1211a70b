"""What the target says at every position of the text (Labels, cached) and the draft vocabulary."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mtp_edge.files import write_with
from mtp_edge.logs import progress_bar
from mtp_edge.model import Transformer
from mtp_edge.train.corpus import Sequence


@dataclass
class Labels:
    """Per position of a set of sequences laid end to end."""

    hidden: torch.Tensor  # [N, D] float16: the target's final-normed hidden state
    tokens: torch.Tensor  # [N] the sequence's token
    argmax: torch.Tensor  # [N] the target's next-token argmax
    remaining: torch.Tensor  # [N] positions after this one in its sequence
    starts: torch.Tensor  # [M] positions a draft may start from
    bounds: torch.Tensor  # [S, 3] per sequence: offset, length, first draft origin (local)
    keys: torch.Tensor | None = None  # [N, KVH, hd] float16: the target's last-layer K (roped)
    values: torch.Tensor | None = None  # [N, KVH, hd] float16: and V


def _labels(sequences: list[Sequence], hidden, argmax, keys=None, values=None) -> Labels:
    starts, bounds, offset = [], [], 0
    for s in sequences:
        n = len(s.tokens)
        starts.append(torch.arange(offset + s.start, offset + n - 1))  # a next token follows
        bounds.append((offset, n, s.start))
        offset += n
    tokens = torch.tensor([t for s in sequences for t in s.tokens])
    remaining = torch.cat([torch.arange(len(s.tokens) - 1, -1, -1) for s in sequences])
    return Labels(
        hidden if isinstance(hidden, torch.Tensor) else torch.cat(hidden),
        tokens,
        argmax if isinstance(argmax, torch.Tensor) else torch.cat(argmax),
        remaining,
        torch.cat(starts),
        torch.tensor(bounds, dtype=torch.long).view(-1, 3),
        torch.cat(keys) if keys else None,
        torch.cat(values) if values else None,
    )


def _labelling_progress(say, total: int):
    """A bar over the `total` sequences labelled (labelling is minutes of work); none without
    `say` (a process other than the first of a distributed run)."""
    return progress_bar(total, "labelling", unit="seq", disable=say is None)


@torch.inference_mode()
def label_sequences(
    model: Transformer,
    sequences: list[Sequence],
    cache: bool = False,
    dtype: torch.dtype = torch.float16,
    say: Callable[[str], None] | None = None,
) -> Labels:
    """Run the frozen target over each sequence (one teacher-forced call through the static
    cache) and keep, per position, its final hidden state and its argmax (and with `cache`, its
    last layer's K/V as the cache holds them), stored in `dtype`."""
    longest = max(len(s.tokens) for s in sequences)
    if model.max_seq_len < longest:
        model.setup_cache(longest)
    hidden, argmax, keys, values = [], [], [], []
    last = model.layers[-1].self_attn
    bar = _labelling_progress(say, len(sequences))
    for s in sequences:
        n = len(s.tokens)
        logits, h = model(torch.tensor([s.tokens]), torch.tensor([0]), return_hidden=True, kv_len=n)
        hidden.append(h[0].to(dtype))
        argmax.append(logits[0].argmax(-1))
        if cache:  # [1, KVH, S, hd] -> [n, KVH, hd]
            keys.append(last.cache.k[0, :, :n].transpose(0, 1).to(dtype))
            values.append(last.cache.v[0, :, :n].transpose(0, 1).to(dtype))
        bar.update(1)
    bar.close()
    return _labels(sequences, hidden, argmax, keys, values)


def label_with_session(session, sequences: list[Sequence], say=None) -> Labels:
    """label_sequences through an exported target: its hidden states and argmax per position.

    The results go straight into tensors allocated once for all positions. Kept as thousands of
    small pieces between the per-call logits (up to 25 MB each, freed at once), they fragmented
    the heap: labelling 723k tokens grew past 18 GB of RSS and was killed."""
    total = sum(len(s.tokens) for s in sequences)
    hidden, argmax, at = None, torch.empty(total, dtype=torch.long), 0
    bar = _labelling_progress(say, len(sequences))
    for s in sequences:
        n = len(s.tokens)
        for i in range(0, n, session.max_chunk):
            out = session.forward(s.tokens[i : i + session.max_chunk], i, True)
            logits, h = out.logits, out.hidden
            if hidden is None:
                hidden = torch.empty(total, h.shape[-1], dtype=torch.float16)
            rows = len(h)
            hidden[at : at + rows] = h
            argmax[at : at + rows] = logits.argmax(-1)
            at += rows
        bar.update(1)
    bar.close()
    return _labels(sequences, hidden, argmax)


def cached_labels(path: Path, sequences, source: str, cache: bool, make, say) -> Labels:
    """Labels of `sequences` from `path` when it holds them for the same text, target and kind,
    else made by `make()` and stored there (labelling is the slow part of a rerun: the eager
    target over every token)."""
    digest = hashlib.sha256(json.dumps([source, cache]).encode())
    for s in sequences:
        digest.update(json.dumps([s.start, s.tokens]).encode())
    key = digest.hexdigest()
    names = ("hidden", "tokens", "argmax", "remaining", "starts", "bounds", "keys", "values")
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") == key:
                say(f"labels read from {path}")
                return Labels(*(f.get_tensor(n) if n in f.keys() else None for n in names))
    except (OSError, SafetensorError):
        pass
    labels = make()
    tensors = {n: getattr(labels, n).contiguous() for n in names if getattr(labels, n) is not None}
    write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata={"key": key}))
    return labels


# --- 3. draft vocabulary ---------------------------------------------------------------------


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent target predictions (ties: lower id) and the share they cover."""
    size = min(size, len(counts))
    order = torch.sort(-counts, stable=True).indices[:size]
    ids = torch.sort(order).values
    coverage = float(counts[ids].sum() / counts.sum().clamp(min=1))
    return ids, coverage


def label_counts(labels: Labels, vocab_size: int) -> torch.Tensor:
    """How often the target predicts each token at the positions draft steps are scored on."""
    return torch.bincount(labels.argmax[labels.starts + 1], minlength=vocab_size)
