"""Quality report: what quantization cost, measured on the held-out text (mtp_edge/texts.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ROWS = 16  # rows of logits scored in float64 at a time (bounds memory, not the result)


def perplexity(
    forward: Callable[[list[int], int], torch.Tensor],
    tokens: list[int],
    chunk: int,
) -> float:
    """exp(mean next-token NLL) of `tokens`, fed in chunks through forward(tokens, start)."""
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        piece = tokens[start : start + chunk]
        logits = forward(piece, start)
        targets = torch.tensor(tokens[start + 1 : start + 1 + len(piece)])
        for row in range(0, len(targets), ROWS):  # a row of a 150k vocabulary: 1.2 MB
            block = logits[row : row + ROWS].to(torch.float64)
            nll += float(
                torch.nn.functional.cross_entropy(
                    block[: len(targets) - row], targets[row : row + ROWS], reduction="sum"
                )
            )
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
    # The steps' rows are kept as they came (float32); each wide call is compared as it comes,
    # in float64, so memory holds one copy of the logits, not several in float64.
    step = None
    for p, t in enumerate(tokens[start:], start):
        row = forward([t], p)
        if step is None:
            step = row.new_empty((len(tokens) - start, row.shape[-1]))
        step[p - start] = row[0]
    forward(tokens[:start], 0)
    gains, flips, max_shift = [], 0, 0.0
    for p in range(start, len(tokens), width):
        wide = forward(tokens[p : p + width], p).to(torch.float64)
        single = step[p - start : p - start + len(wide)].to(torch.float64)
        shift = wide - single
        best = single.argmax(-1, keepdim=True)
        gains.append((shift - shift.gather(-1, best)).scatter(-1, best, float("-inf")).amax(-1))
        flips += int((wide.argmax(-1, keepdim=True) != best).sum())
        max_shift = max(max_shift, float(shift.abs().max()))
    gain = torch.cat(gains)
    return {
        "width": width,
        "positions": len(step),
        "max_abs_logit_shift": max_shift,
        "rival_gain_p50": float(gain.quantile(0.5)),
        "rival_gain_p99": float(gain.quantile(0.99)),
        "rival_gain_max": float(gain.max()),
        "argmax_flips": flips,
    }


class StreamedPerplexity:
    """The float32 perplexity of `tokens`, computed while a loader reads the model one part at a
    time (checkpoints.load_model's on_part hook, before the part is quantized): the whole
    sequence goes through each part as it arrives, so no float copy of the model is needed.
    The same function as `perplexity` with an eager forward, summed in another order."""

    ROWS = 128  # rows of [rows, vocab] float64 logits at a time

    def __init__(self, config, tokens: list[int]):
        from mtp_edge.model import rope_frequencies

        n = len(tokens)
        self.config, self.tokens = config, tokens
        self.positions = torch.arange(n)
        angles = torch.outer(self.positions.double(), rope_frequencies(config))
        angles = torch.cat((angles, angles), dim=-1)
        self.cos, self.sin = angles.cos().float()[None, None], angles.sin().float()[None, None]
        self.mask = self.positions[None, :] <= self.positions[:, None]
        self.x: torch.Tensor | None = None
        self.nll: float | None = None

    @torch.inference_mode()
    def feed(self, name: str, module: torch.nn.Module) -> None:
        """Run the sequence through part `name` (Transformer.parts), its weights still float."""
        from mtp_edge.model import KVCache

        if name == "embed_tokens":
            self.x = module(torch.tensor([self.tokens])).float()
        elif name.startswith("layers."):
            c, n = self.config, len(self.tokens)
            attention = module.self_attn
            attention.cache = KVCache(c.num_kv_heads, n, c.head_dim, torch.float32)
            self.x = module(self.x, self.positions, self.cos, self.sin, self.mask, None)
            attention.cache = None
        elif name == "norm":
            self.x = module(self.x)
        elif name == "lm_head":
            self.nll = self._nll(module.weight)

    @torch.inference_mode()
    def finish(self, tied_head: torch.Tensor | None = None) -> float:
        """The perplexity; a model whose LM head is its embedding gives that table (float)."""
        if self.nll is None:
            self.nll = self._nll(tied_head)
        return math.exp(self.nll / (len(self.tokens) - 1))

    def _nll(self, head: torch.Tensor) -> float:
        targets, rows, nll = torch.tensor(self.tokens[1:]), self.x[0], 0.0
        for start in range(0, len(targets), self.ROWS):
            picked = targets[start : start + self.ROWS]
            logits = torch.nn.functional.linear(rows[start : start + len(picked)], head.float())
            nll += float(
                torch.nn.functional.cross_entropy(logits.double(), picked, reduction="sum")
            )
        return nll
