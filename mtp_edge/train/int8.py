"""The int8 target: the same model with int8 linears, multiplied by torch._int_mm (--writer,
--labeller int8). Fast where the CPU multiplies int8 in hardware (VNNI, AMX, ARM's dot
products); engines.py measures whether this machine does before choosing it."""

from __future__ import annotations

import copy

import torch
from torch import nn

from mtp_edge.model import Transformer


class Int8Linear(nn.Module):
    """x W^T (+ b) with W in int8 per output row and each row of x quantized as it comes
    (dynamic, symmetric), multiplied in int8 by torch._int_mm (VNNI/AMX where the CPU has
    them). For writing and labelling training text (--writer, --labeller int8)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer("weight_t", (w / scale[:, None]).round().to(torch.int8).t())
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        step = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        q = (rows / step).round().to(torch.int8)
        # Scaled in place: the same values as (y * step) * scale, without two more tensors of
        # the output's size (an LM head's is [rows, vocabulary]: 20% of its time at 64 rows).
        y = torch._int_mm(q, self.weight_t).float()
        y.mul_(step).mul_(self.scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


class Int8Transformer(Transformer):
    """What int8_writer returns: its LM head is an Int8Linear, which has no float weight for
    Transformer.logits to multiply by."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def int8_writer(model: Transformer) -> Transformer:
    """A copy of `model` whose linear layers and LM head are Int8Linear: batched greedy
    writing ~3x faster than fp32 on a 2-core x86 CPU (benchmarks/README.md, "Writing the
    text"). Shares every other tensor with `model`, so it costs a quarter of the linears'
    memory, not a second model."""
    shared = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    shared.append(model.embed_tokens.weight)
    writer = copy.deepcopy(model, {id(p): p for p in shared})
    for module in list(writer.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child.weight, child.bias))
    if writer.lm_head is None:
        writer.lm_head = Int8Linear(model.embed_tokens.weight)
    writer.__class__ = Int8Transformer  # the same modules; only `logits` differs
    return writer
