"""Quality report: what quantization cost, measured on the held-out text (mtp_edge/texts.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


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


def verify_step_discrepancy(
    forward: Callable[[list[int], int], torch.Tensor],
    tokens: list[int],
    width: int,
    chunk: int,
) -> dict:
    """How much a `width`-token call (a verify) and single-token calls (decode steps) disagree.

    Plain decoding reads logits from one-token calls; speculative decoding from (k+1)-token
    calls. Both are the same function of the same weights, but kernels for different widths
    round differently, and with dynamically quantized activations a tiny difference can move a
    value across a rounding boundary. The two can choose different tokens only where, at a
    position, some rival token gains on the single-step argmax by at least the argmax's lead
    there. This measures that gain over `tokens` (teacher-forced: the first `chunk` tokens are
    prefilled, every later position is scored both ways) and returns its distribution; its
    maximum is the near-tie tolerance a divergence is judged by.
    """
    start = min(chunk, len(tokens) // 2)
    if len(tokens) - start < width:
        raise ValueError(f"need more than {start + width} tokens, got {len(tokens)}")
    forward(tokens[:start], 0)
    step = torch.cat([forward([t], p) for p, t in enumerate(tokens[start:], start)])
    forward(tokens[:start], 0)
    wide = torch.cat([forward(tokens[p : p + width], p) for p in range(start, len(tokens), width)])
    step, wide = step.to(torch.float64), wide.to(torch.float64)
    shift = wide - step
    best = step.argmax(-1, keepdim=True)
    gain = (shift - shift.gather(-1, best)).scatter(-1, best, float("-inf")).amax(-1)
    flips = int((wide.argmax(-1, keepdim=True) != best).sum())
    return {
        "width": width,
        "positions": len(step),
        "max_abs_logit_shift": float(shift.abs().max()),
        "rival_gain_p50": float(gain.quantile(0.5)),
        "rival_gain_p99": float(gain.quantile(0.99)),
        "rival_gain_max": float(gain.max()),
        "argmax_flips": flips,
    }
