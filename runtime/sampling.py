"""Sampling settings, the sampler, and the two verification rules (greedy and rejection sampling).

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): a drafted token x drawn from the
drafter's q is kept with probability min(1, p(x)/q(x)); on rejection the replacement is drawn from
the residual norm(max(p - q, 0)); when every draft is kept, a bonus token is drawn from p. The
emitted tokens are then distributed exactly as if sampled from the target's p alone. A drafter
that proposes deterministically (n-gram) has a one-hot q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mtp_edge.errors import UserError
from mtp_edge.limits import MAX_SEED


def _rows(logits: torch.Tensor) -> np.ndarray:
    """logits [..., V] as float32 NumPy rows [R, V] (no copy for float32 CPU logits)."""
    return logits.detach().float().reshape(-1, logits.shape[-1]).numpy()


def row_maxima(logits: torch.Tensor) -> tuple[list[float], list[int]]:
    """Each row's largest logit and its index, the first of equal maxima (a NaN counts as the
    largest, so that check_logits sees it). NumPy's argmax takes ~10 us for a row of a 152K
    vocabulary where torch's max with indices takes ~130 (2 cores): 1% of a 1.5B model's token,
    3% of the default model's 5-row verification."""
    rows = _rows(logits)
    best = rows.argmax(-1)
    return rows[np.arange(len(best)), best].tolist(), best.tolist()


def top2_gaps(logits: torch.Tensor) -> list[float]:
    """Per row, the largest logit minus the second largest (0 when two are equal): how near a
    row was to picking another token. Two passes of NumPy's max, not torch's topk (~260 us a
    152K row)."""
    gaps = []
    for row in _rows(logits):
        best = int(row.argmax())
        second = max(row[:best].max(initial=-np.inf), row[best + 1 :].max(initial=-np.inf))
        gaps.append(float(row[best] - second))
    return gaps


def check_logits(maxima: list[float], start: int | None) -> None:
    """Refuse logits whose best value (`maxima`: one per row read) is NaN or inf, or -inf (no
    finite logit at all). `start`: the target's position of the first row; None: a drafter's.

    NaN logits otherwise pick token 0, often an end-of-text token: an empty output that looks
    like a normal stop. -inf on some tokens (masked) is fine. A corrupt model or bundle is the
    user's input, so this is a UserError. Plain floats: no torch op per check.
    """
    for row, best in enumerate(maxima):
        if math.isfinite(best):
            continue
        if start is None:
            raise UserError(
                "the drafter produced non-finite logits (NaN/inf): its model, heads or bundle is "
                "corrupt; re-download or re-train them, re-export the bundle, or use --drafter "
                "ngram"
            )
        raise UserError(
            f"the target produced non-finite logits at position {start + row}: the model or "
            "bundle is corrupt (NaN/inf); re-download or re-convert the model, or re-export the "
            "bundle"
        )


def _maxima(logits: torch.Tensor) -> list[float]:
    """The best logit of each row of logits [V] or [T, V]."""
    return logits.amax(dim=-1).reshape(-1).tolist()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise UserError(
                f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be in 0..{MAX_SEED} (64 bits), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns logits into the sampling distribution and draws from it with a seeded generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """A drafter's logits [..., V] -> probabilities [..., V] (float64) after temperature,
        top-k, top-p; non-finite logits are refused."""
        check_logits(_maxima(logits), None)
        return self._probs(logits)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        scores = logits.to(torch.float64) / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # Drop a token when the tokens before it already reach top_p; the best always stays.
            drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= p.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores.softmax(-1)

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def pick(self, logits: torch.Tensor, position: int = 0) -> int:
        """One token from the target's row of logits at `position`: argmax when greedy, else a
        sample."""
        maxima, tokens = row_maxima(logits)
        check_logits(maxima, position)
        if self.greedy:
            return tokens[0]
        return self.sample(self._probs(logits))


def accept_greedy(target_logits: torch.Tensor, draft: list[int], start: int = 0) -> tuple[int, int]:
    """Longest draft prefix equal to the target's argmax, and the target's own next token.

    target_logits[i] is the target's prediction after draft[:i], at position start + i;
    returns (accepted, next token).
    """
    values, best = row_maxima(target_logits)
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    check_logits(values[: n + 1], start)  # the rows read
    return n, best[n]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to resample from after a rejection: norm(max(p - q, 0))."""
    r = torch.clamp(p - q, min=0)
    total = r.sum()
    return r / total if total > 0 else p


def accept_sampling(
    target_logits: torch.Tensor,
    draft: list[int],
    draft_probs: torch.Tensor | None,
    sampler: Sampler,
    start: int = 0,
) -> tuple[int, int]:
    """Rejection sampling over the draft; returns (accepted, next token).

    draft_probs[i] is the distribution draft[i] was drawn from (None: drawn deterministically);
    target_logits[i] is the target's row at position start + i.
    """
    maxima = _maxima(target_logits)
    p = sampler._probs(target_logits)
    for i, token in enumerate(draft):
        check_logits(maxima[i : i + 1], start + i)
        if draft_probs is None:
            q = torch.zeros_like(p[i])
            q[token] = 1.0
        else:
            q = draft_probs[i].to(p.dtype)
        if sampler.uniform() * q[token] < p[i, token]:  # u < p/q without dividing by zero
            continue
        return i, sampler.sample(residual(p[i], q))
    check_logits(maxima[len(draft) : len(draft) + 1], start + len(draft))
    return len(draft), sampler.sample(p[len(draft)])
