"""Quality report: what quantization cost, measured on text that is available offline.

The held-out text is prose from the Python documentation that ships with the interpreter
(`pydoc_data.topics`); the topics below are reserved for evaluation and must not be used to
train drafters.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

HELDOUT_TOPICS = ("execmodel", "exceptions", "naming")


def heldout_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in HELDOUT_TOPICS)


def perplexity(
    forward: Callable[[list[int], int], torch.Tensor],
    tokens: list[int],
    chunk: int,
) -> float:
    """exp(mean next-token NLL) of `tokens`, fed in chunks through forward(tokens, start)."""
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        piece = tokens[start : start + chunk]
        logits = forward(piece, start).to(torch.float64)
        targets = torch.tensor(tokens[start + 1 : start + 1 + len(piece)])
        logits = logits[: len(targets)]
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return math.exp(nll / count)
