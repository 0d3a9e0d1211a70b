"""Sampling settings, the sampler, and the two verification rules (greedy and rejection sampling).

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): a drafted token x drawn from the
drafter's q is kept with probability min(1, p(x)/q(x)); on rejection the replacement is drawn from
the residual norm(max(p - q, 0)); when every draft is kept, a bonus token is drawn from p. The
emitted tokens are then distributed exactly as if sampled from the target's p alone. A drafter
that proposes deterministically (n-gram) has a one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_edge.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")

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
        """logits [..., V] -> probabilities [..., V] (float64) after temperature, top-k, top-p."""
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

    def pick(self, logits: torch.Tensor) -> int:
        """One token from one row of logits: argmax when greedy, else a sample."""
        if self.greedy:
            return int(torch.argmax(logits))
        return self.sample(self.probs(logits))


def accept_greedy(target_logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """Longest draft prefix equal to the target's argmax, and the target's own next token.

    target_logits[i] is the target's prediction after draft[:i]; returns (accepted, next token).
    """
    best = torch.argmax(target_logits, dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
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
) -> tuple[int, int]:
    """Rejection sampling over the draft; returns (accepted, next token).

    draft_probs[i] is the distribution draft[i] was drawn from (None: drawn deterministically).
    """
    p = sampler.probs(target_logits)
    for i, token in enumerate(draft):
        if draft_probs is None:
            q = torch.zeros_like(p[i])
            q[token] = 1.0
        else:
            q = draft_probs[i].to(p.dtype)
        if sampler.uniform() * q[token] < p[i, token]:  # u < p/q without dividing by zero
            continue
        return i, sampler.sample(residual(p[i], q))
    return len(draft), sampler.sample(p[len(draft)])
