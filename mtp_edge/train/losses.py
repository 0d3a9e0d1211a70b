"""The training-time test: batches of draft origins, the losses, held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtp_edge.logs import progress_bar
from mtp_edge.model import rope_frequencies
from mtp_edge.mtp import MTPHead
from mtp_edge.train.context import TrainContext
from mtp_edge.train.labels import Labels

IGNORE = -100  # label of a position the loss skips (outside the draft vocabulary, or past the end)


@dataclass
class Batch:
    h: torch.Tensor  # [B, L, D] the target's hidden state at each origin
    embs: torch.Tensor  # [B, L, J, D] embedding of the token step j reads
    reads: torch.Tensor  # [B, L, J] global position whose token step j reads and predicts after
    valid: torch.Tensor  # [B, L, J] a step inside its sequence, from an allowed origin
    context: TrainContext | None


def sequence_batch(labels: Labels, seqs, embedding, k: int, rope, cache: bool) -> Batch:
    """B whole sequences, padded to the longest: every position is a draft origin."""
    bounds = labels.bounds[torch.as_tensor(seqs, device=labels.bounds.device)]
    offset, n, first = bounds[:, 0:1], bounds[:, 1:2], bounds[:, 2:3]
    length = int(n.max())
    device = labels.tokens.device
    t = torch.arange(length, device=device)[None]  # local origin
    idx = offset + torch.minimum(t, n - 1)  # [B, L]
    steps = torch.arange(1, k + 1, device=device)
    local = t[..., None] + steps  # [B, L, J] position step j reads
    valid = (t >= first)[..., None] & (local <= (n - 1)[..., None])
    reads = offset[..., None] + torch.minimum(local, (n - 1)[..., None])
    context = None
    if cache:  # a head with attention: rotary tables, padding (and the target's K/V if kept)
        cos, sin = rope
        keys = None if labels.keys is None else labels.keys[idx]
        values = None if labels.values is None else labels.values[idx]
        context = TrainContext(keys, values, t < n, cos[: length + k], sin[: length + k])
    h = labels.hidden[idx].to(embedding.dtype)
    return Batch(h, F.embedding(labels.tokens[reads], embedding), reads, valid, context)


def origin_batch(labels: Labels, origins: torch.Tensor, embedding, k: int) -> Batch:
    """Draft origins from anywhere in the text, as one row [1, N]: for heads without attention,
    which read only the hidden state and the tokens, so that no prompt position or padding is
    computed (a sequence batch spends about half its work on those)."""
    steps = torch.arange(1, k + 1, device=origins.device)
    left = labels.remaining[origins, None]
    valid = (steps <= left)[None]
    reads = (origins[:, None] + torch.minimum(steps, left))[None]
    h = labels.hidden[origins].to(embedding.dtype)[None]
    return Batch(h, F.embedding(labels.tokens[reads], embedding), reads, valid, None)


def labelled_batches(labels: Labels, embedding, k: int, rope, context: bool, budget: int):
    """Every draft origin of `labels` once, in batches of about `budget` origins."""
    if not context:
        for chunk in labels.starts.split(budget):
            yield origin_batch(labels, chunk, embedding, k)
        return
    for group in batches_of(labels, list(range(len(labels.bounds))), budget):
        yield sequence_batch(labels, group, embedding, k, rope, context)


def draft_losses(logits, batch: Batch, labels: Labels, to_draft, teacher_head, soft: bool):
    """Summed loss [k] and counted steps [k] per draft step. Soft: KL divergence from the
    target's distribution restricted to the draft vocabulary (what the target would say at the
    position step j predicts); hard: against its argmax (steps outside the vocabulary skipped)."""
    if soft:
        with torch.no_grad():
            teacher = F.linear(labels.hidden[batch.reads].to(teacher_head.dtype), teacher_head)
            teacher = torch.softmax(teacher.float(), -1)
        # KL(teacher || head): the cross-entropy less the teacher's own entropy, so 0 is perfect
        ce = teacher * (teacher.clamp_min(1e-30).log() - torch.log_softmax(logits.float(), -1))
        ce = ce.sum(-1)
        keep = batch.valid
    else:
        targets = to_draft[labels.argmax[batch.reads]]
        keep = batch.valid & (targets != IGNORE)
        ce = F.cross_entropy(
            logits.flatten(0, -2).float(),
            targets.masked_fill(~keep, 0).flatten(),
            reduction="none",
        ).view_as(targets)
    ce = ce.masked_fill(~keep, 0.0)
    return ce.flatten(0, 1).sum(0), keep.flatten(0, 1).sum(0)


def feature_losses(hidden, batch: Batch, labels: Labels):
    """Summed hidden-state loss [k] per draft step: smooth L1 between step j's output and the
    target's hidden state at the position whose token step j read (the state the target
    predicts the same next token from), averaged over the hidden dimension."""
    wanted = labels.hidden[batch.reads].to(hidden.dtype)
    loss = F.smooth_l1_loss(hidden.float(), wanted.float(), reduction="none").mean(-1)
    sums = loss.masked_fill(~batch.valid, 0.0).flatten(0, 1).sum(0)
    return sums, batch.valid.flatten(0, 1).sum(0)


def weighted_loss(sums, counts, weights) -> torch.Tensor:
    return (weights * sums / counts.clamp(min=1)).sum() / weights.sum()


def rope_tables(config, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(length, dtype=torch.float64), rope_frequencies(config))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def batches_of(labels: Labels, seqs: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sequences with about `budget` origins each."""
    groups, group, size = [], [], 0
    for i in seqs:
        group.append(i)
        size += int(labels.bounds[i, 1])
        if size >= budget:
            groups.append(group)
            group, size = [], 0
    return groups + ([group] if group else [])


@torch.no_grad()
def evaluate(
    head: MTPHead,
    labels: Labels,
    embedding: torch.Tensor,
    k: int,
    to_draft: torch.Tensor,
    weights: torch.Tensor,
    world: int,
    rope,
    teacher_head: torch.Tensor,
    soft: bool,
    budget: int,
    show: bool = True,
) -> dict:
    """Held-out loss and acceptance per draft position, over every origin of the held-out
    sequences.

    Draft step j from a position counts as accepted when it and every earlier step equal the
    target's argmax. On text the target wrote (greedy), the steps read exactly the tokens
    drafting would feed, so this is the greedy acceptance drafting will see; on other text it is
    a teacher-forced estimate.
    """
    sums, counts, feature, feature_counts, hits, scored = (
        torch.zeros(k, dtype=torch.float64, device=embedding.device) for _ in range(6)
    )
    context = head.needs_context
    count = (
        len(batches_of(labels, list(range(len(labels.bounds))), budget))
        if context
        else len(labels.starts.split(budget))
    )
    bar = progress_bar(count, "evaluating", unit="batch", leave=False, disable=not show)
    for batch in labelled_batches(labels, embedding, k, rope, context, budget):
        bar.update(1)
        logits, hidden = head(batch.h, batch.embs, batch.context, return_hidden=True)
        s, c = draft_losses(logits, batch, labels, to_draft, teacher_head, soft)
        f, fc = feature_losses(hidden, batch, labels)
        feature += f
        feature_counts += fc
        sums += s
        counts += c
        right = (head.draft_ids[logits.argmax(-1)] == labels.argmax[batch.reads]) & batch.valid
        first_valid = batch.valid[..., 0]
        hits += (right.long().cumprod(-1).bool() & batch.valid)[first_valid].sum(0)
        scored += batch.valid[first_valid].sum(0)
    bar.close()
    if world > 1:
        for t in (sums, counts, feature, feature_counts, hits, scored):
            dist.all_reduce(t)
    acceptance = (hits / scored.clamp(min=1)).tolist()
    return {
        "origins": int(scored[0]),
        "loss": float(weighted_loss(sums, counts, weights.to(sums.dtype))),
        "feature_loss": round(float(weighted_loss(feature, feature_counts, weights.double())), 4),
        "acceptance": [round(a, 4) for a in acceptance],
        "tau": round(1 + sum(acceptance), 4),
    }


def describe(result: dict) -> str:
    """One held-out result on one line."""
    accepted = "/".join(f"{a:.2f}" for a in result["acceptance"])
    line = f"loss {result['loss']:.3f}  acceptance {accepted}  tau~{result['tau']:.2f}"
    if "yours_tau" in result:
        line += f"  your requests tau~{result['yours_tau']:.2f}"
    return line
