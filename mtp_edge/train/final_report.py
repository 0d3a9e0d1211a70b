"""The report a run ends with: one screen of what the heads reach on held-out text, what a draft
step costs, where the time went, and the command that exports the heads."""

from __future__ import annotations

import math
import shlex

from mtp_edge.machine import measure_matmul_gops
from mtp_edge.model import Transformer
from mtp_edge.mtp import MTPHead
from mtp_edge.train.budget import Budget
from mtp_edge.train.prompts import YOURS
from mtp_edge.train.rates import draft_cost

STAGES = ("loading", "measuring", "writing", "labelling", "training", "evaluation")


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}G" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _positions(acceptance: list[float]) -> str:
    return " ".join(f"{a:5.2f}" for a in acceptance)


def matmul_params(target: Transformer) -> int:
    """Weights a token's forward multiplies by: all but the embedding table, which is looked up
    (a tied LM head multiplies by it, so it counts once then)."""
    total = sum(p.numel() for p in target.parameters())
    if target.lm_head is not None:
        total -= target.embed_tokens.weight.numel()
    return total


def final_report(
    options,
    model_name: str,
    target: Transformer,
    head: MTPHead,
    summary: dict,
    categories: dict[str, dict],
    timer: Budget,
    text: dict,
) -> str:
    """The report's lines (held-out tau and acceptance per draft position, per kind of text
    when the text has kinds; the draft step's cost, measured; stage times; tokens; the export
    command)."""
    cost = draft_cost(head, target)
    k = len(summary["heldout_acceptance"])
    header = " ".join(f"{j:>5}" for j in range(1, k + 1))
    lines = [
        f"heads for {model_name}: {options.out}",
        f"held-out      tau {summary['heldout_tau']:.2f}  loss {summary['heldout_loss']:.3f}  "
        f"(best of {len(summary['history'])} evaluations: step {summary['best_step']} of "
        f"{summary['steps']})",
        f"  position    {header}",
        f"  acceptance  {_positions(summary['heldout_acceptance'])}",
    ]
    if "your_requests_tau" in summary:
        yours = categories[YOURS]
        lines.append(
            f"tau on your requests  {yours['tau']:.2f}  (held out: {yours['origins']} draft "
            f"origins of answers to requests training never saw)"
        )
    if categories:
        lines.append("  by kind of text: tau, acceptance per position (draft origins)")
        width = max(map(len, categories))
        for kind, result in categories.items():
            lines.append(
                f"    {kind:<{width}}  {result['tau']:.2f}  {_positions(result['acceptance'])}"
                f"  ({result['origins']})"
            )
    lines.append(
        f"draft cost    a head step {cost['draft_ms']:.2f} ms = {cost['ratio']:.1%} of a target "
        f"forward(1) ({cost['target_ms']:.1f} ms), eager, batch 1, measured"
    )
    lines.append(
        f"vocabulary    {summary['draft_vocab']} draft tokens: cover {summary['coverage']:.1%} "
        f"of the target's predictions in training, {summary['heldout_coverage']:.1%} held out"
    )
    lines.append(
        f"text          {text['sequences']} sequences; {text['written']} tokens written by the "
        f"target, {text['labelled']} labelled; {summary['train_tokens']} trained on"
    )
    spent = timer.spent_by_stage()
    stages = ", ".join(f"{s} {_clock(spent[s])}" for s in STAGES if s in spent)
    total = f"total {_clock(timer.spent_s())}"
    if not math.isinf(timer.total_s):
        total += f" of {_clock(timer.total_s)}"
    lines.append(f"time          {stages} ({total})")
    weights = matmul_params(target)
    rates = [
        (name, rate, who)
        for name, rate, who in (
            ("writer", timer.write_tps, options.writer),
            ("labeller", timer.label_tps, options.labeller),
        )
        if rate
    ]
    if rates:
        int8_peak, fp32_peak = measure_matmul_gops()
    for name, rate, who in rates:
        gops = 2 * weights * rate / 1e9
        # fp32 models multiply in float; int8 and exported (8-bit) ones in int8
        peak, kind = (fp32_peak, "fp32") if who == "fp32" else (int8_peak, "int8")
        lines.append(
            f"{name:<13} {rate:.0f} tokens/s x 2 x {_count(weights)} weights = {gops:.1f} Gop/s"
            f" = {gops / peak:.0%} of this machine's {kind} matmul peak ({peak:.0f} Gop/s, "
            f"measured; {who} target)"
        )
    model = "default" if options.model == "default" else shlex.quote(options.model)
    lines.append(
        "export        mtp-export --target android --model "
        f"{model} --heads {shlex.quote(str(options.out))}"
    )
    return "\n".join(lines)
