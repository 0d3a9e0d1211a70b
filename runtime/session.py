"""The session interface every backend implements, and the eager PyTorch session.

A session owns one model and its static KV cache. `forward(tokens, start)` writes the tokens'
K/V at positions start.. and returns their `Output` (logits, and hidden states on request);
writing at a position that held a rejected draft simply overwrites it, so there is no rollback
call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mtp_edge.errors import UserError
from mtp_edge.model import Transformer


@dataclass(frozen=True)
class Output:
    """What every session's `forward` returns, on every backend."""

    logits: torch.Tensor  # [T, V]
    hidden: torch.Tensor | None = None  # [T, D], the final-normed states, when asked for


class Session(Protocol):
    name: str  # backend name, e.g. "eager"
    vocab_size: int
    max_seq_len: int  # positions the static cache holds
    max_chunk: int  # most tokens one forward call accepts (prefill is split into such chunks)

    def forward(self, tokens: list[int], start: int, return_hidden: bool = False) -> Output:
        """Logits for tokens at positions start..start+T-1 (and their hidden states)."""
        ...


def check_token_ids(tokens: list[int], vocab_size: int) -> None:
    """Refuse token ids outside the vocabulary before a kernel indexes its embedding with them
    (ExecuTorch's embedding kernel aborts the process); every session calls it."""
    if vocab_size > 0 and not all(0 <= t < vocab_size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise UserError(f"token id {bad} is outside the vocabulary: ids run 0..{vocab_size - 1}")


def prefill(session: Session, tokens: list[int], start: int = 0, return_hidden: bool = False):
    """Run `tokens` through `session` in chunks: the last chunk's logits (and all hidden)."""
    hidden = []
    out = None
    for i in range(0, len(tokens), session.max_chunk):
        out = session.forward(tokens[i : i + session.max_chunk], start + i, return_hidden)
        hidden.append(out.hidden)
    return Output(out.logits, torch.cat(hidden) if return_hidden else None)


class EagerSession:
    """The PyTorch model itself: the reference every other backend is compared with."""

    name = "eager"

    def __init__(self, model: Transformer, max_seq_len: int, max_chunk: int = 128):
        self.model = model
        if model.max_seq_len != max_seq_len:
            model.setup_cache(max_seq_len)
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = max_seq_len
        self.max_chunk = max_chunk

    @torch.inference_mode()
    def forward(self, tokens: list[int], start: int, return_hidden: bool = False):
        end = start + len(tokens)
        if end > self.max_seq_len:
            raise ValueError(f"positions up to {end} exceed the cache of {self.max_seq_len}")
        check_token_ids(tokens, self.vocab_size)
        ids = torch.tensor([tokens], dtype=torch.long)
        logits, hidden = self.model(ids, torch.tensor([start]), return_hidden=True, kv_len=end)
        return Output(logits[0], hidden[0] if return_hidden else None)
