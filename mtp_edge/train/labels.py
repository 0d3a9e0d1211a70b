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


def select_sequences(labels: Labels, chosen: list[int]) -> Labels:
    """The labels of some of the sequences (by index), laid end to end again."""
    rows = torch.cat(
        [torch.arange(int(o), int(o) + int(n)) for o, n, _ in labels.bounds[chosen].tolist()]
    )
    kept = [
        Sequence(labels.tokens[int(o) : int(o) + int(n)].tolist(), int(first))
        for o, n, first in labels.bounds[chosen].tolist()
    ]
    selected = _labels(kept, labels.hidden[rows], labels.argmax[rows])
    if labels.keys is not None:
        selected.keys, selected.values = labels.keys[rows], labels.values[rows]
    return selected


def labels_to(labels: Labels, device: str) -> Labels:
    """The same labels on another device (training on a GPU keeps them there)."""
    moved = [None if t is None else t.to(device) for t in vars(labels).values()]
    return Labels(*moved)


def _labelling_progress(say, total: int):
    """A bar over the `total` sequences labelled (labelling is minutes of work); none without
    `say` (a process other than the first of a distributed run)."""
    return progress_bar(total, "labelling", unit="seq", disable=say is None)


def _stop_here(stop: Callable[[int], str | None] | None, bar, tokens: int) -> bool:
    """Whether to stop labelling now, after a sequence of `tokens`; `stop` returns None to go
    on, else the time-left text shown on the bar (an empty text when the deadline has passed)."""
    if stop is None:
        return False
    left = stop(tokens)
    if left:
        bar.set_postfix_str(left, refresh=False)
    return left == ""


@torch.inference_mode()
def label_sequences(
    model: Transformer,
    sequences: list[Sequence],
    cache: bool = False,
    dtype: torch.dtype = torch.float16,
    say: Callable[[str], None] | None = None,
    stop: Callable[[int], str | None] | None = None,
) -> Labels:
    """Run the frozen target over each sequence (one teacher-forced call through the static
    cache) and keep, per position, its final hidden state and its argmax (and with `cache`, its
    last layer's K/V as the cache holds them), stored in `dtype`. With `stop` (a deadline),
    the sequences labelled before it said stop: a prefix of `sequences`."""
    longest = max(len(s.tokens) for s in sequences)
    if model.max_seq_len < longest:
        model.setup_cache(longest)
    hidden, argmax, keys, values = [], [], [], []
    last = model.layers[-1].self_attn
    bar = _labelling_progress(say, len(sequences))
    done = 0
    for s in sequences:
        if done and _stop_here(stop, bar, len(sequences[done - 1].tokens)):
            break
        done += 1
        n = len(s.tokens)
        logits, h = model(torch.tensor([s.tokens]), torch.tensor([0]), return_hidden=True, kv_len=n)
        hidden.append(h[0].to(dtype))
        argmax.append(logits[0].argmax(-1))
        if cache:  # [1, KVH, S, hd] -> [n, KVH, hd]
            keys.append(last.cache.k[0, :, :n].transpose(0, 1).to(dtype))
            values.append(last.cache.v[0, :, :n].transpose(0, 1).to(dtype))
        bar.update(1)
    bar.close()
    return _labels(sequences[:done], hidden, argmax, keys, values)


def label_with_session(session, sequences: list[Sequence], say=None, stop=None) -> Labels:
    """label_sequences through an exported target: its hidden states and argmax per position
    (with `stop`, as label_sequences: a prefix of the sequences).

    The results go straight into tensors allocated once for all positions. Kept as thousands of
    small pieces between the per-call logits (up to 25 MB each, freed at once), they fragmented
    the heap: labelling 723k tokens grew past 18 GB of RSS and was killed."""
    total = sum(len(s.tokens) for s in sequences)
    hidden, argmax, at = None, torch.empty(total, dtype=torch.long), 0
    bar = _labelling_progress(say, len(sequences))
    done = 0
    for s in sequences:
        if done and _stop_here(stop, bar, len(sequences[done - 1].tokens)):
            break
        done += 1
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
    return _labels(sequences[:done], hidden[:at], argmax[:at])


def _key(source: str, cache: bool, sequences) -> str:
    digest = hashlib.sha256(json.dumps([source, cache]).encode())
    for s in sequences:
        digest.update(json.dumps([s.start, s.tokens]).encode())
    return digest.hexdigest()


def cached_labels(
    path: Path, sequences, source: str, cache: bool, make, say, prefix_ok: bool = False
) -> Labels:
    """Labels of `sequences` from `path` when it holds them for the same text, target and kind,
    else made by `make()` and stored there (labelling is the slow part of a rerun: the eager
    target over every token). `make` may label only a prefix of the sequences (a deadline
    stopped it); the file then says how many, and with `prefix_ok` (a resumed --minutes run)
    that prefix is what is read back."""
    names = ("hidden", "tokens", "argmax", "remaining", "starts", "bounds", "keys", "values")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            count = int(meta.get("sequences", len(sequences)))
            if (count == len(sequences) or prefix_ok) and count <= len(sequences):
                if meta.get("key") == _key(source, cache, sequences[:count]):
                    say(f"labels read from {path}")
                    return Labels(*(f.get_tensor(n) if n in f.keys() else None for n in names))
    except (OSError, SafetensorError, ValueError):
        pass
    labels = make()
    count = len(labels.bounds)
    metadata = {"key": _key(source, cache, sequences[:count]), "sequences": str(count)}
    tensors = {n: getattr(labels, n).contiguous() for n in names if getattr(labels, n) is not None}
    write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return labels


# --- 3. draft vocabulary ---------------------------------------------------------------------


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent target predictions (ties: lower id) and the share they cover."""
    size = min(size, len(counts))
    order = torch.sort(-counts, stable=True).indices[:size]
    ids = torch.sort(order).values
    coverage = float(counts[ids].sum() / counts.sum().clamp(min=1))
    return ids, coverage


# The draft vocabulary --draft-vocab auto chooses covers this share of the target's predictions
# on the training text: at 99%, about one draft in a hundred cannot be right whatever the head
# learns, a small loss next to the ~50% a first draft step reaches; a larger vocabulary makes
# each draft step dearer (its LM head is most of the head's work).
COVERAGE_GOAL = 0.99
AUTO_VOCAB_MULTIPLE = 256  # sizes come in multiples of this (kernels like round shapes)
AUTO_VOCAB_RANGE = (1024, 32768)


def coverage_vocabulary_size(counts: torch.Tensor, goal: float = COVERAGE_GOAL) -> int:
    """The smallest draft vocabulary, a multiple of AUTO_VOCAB_MULTIPLE within AUTO_VOCAB_RANGE
    (or the whole vocabulary when smaller), whose most frequent tokens cover `goal` of `counts`
    (the target's predictions per token)."""
    vocab = len(counts)
    low, high = AUTO_VOCAB_RANGE
    if vocab <= low:
        return vocab
    ordered = torch.sort(counts.double(), descending=True).values
    covered = torch.cumsum(ordered, 0) / ordered.sum().clamp(min=1)
    needed = int(torch.searchsorted(covered, torch.tensor([goal], dtype=covered.dtype))) + 1
    size = -(-needed // AUTO_VOCAB_MULTIPLE) * AUTO_VOCAB_MULTIPLE
    return min(vocab, high, max(low, size))


def label_counts(labels: Labels, vocab_size: int) -> torch.Tensor:
    """How often the target predicts each token at the positions draft steps are scored on."""
    return torch.bincount(labels.argmax[labels.starts + 1], minlength=vocab_size)
