"""The training-time test: batches, losses, held-out evaluation, checkpoints, DDP, the run."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mtp_edge.checkpoints import load_model
from mtp_edge.errors import UserError
from mtp_edge.files import write_with
from mtp_edge.logs import progress_bar
from mtp_edge.model import rope_frequencies
from mtp_edge.mtp import (
    MTPConfig,
    MTPHead,
    cache_attention_config,
    carry_vocabulary,
    init_from_target,
    load_heads,
    save_heads,
    target_fingerprint,
    target_lm_head,
)
from mtp_edge.train.context import TrainContext
from mtp_edge.train.labels import (
    Labels,
    cached_labels,
    draft_vocabulary,
    label_counts,
    label_sequences,
    label_with_session,
)
from mtp_edge.train.options import TrainOptions, artifact_paths
from mtp_edge.train.writer import build_corpus, open_target_bundle

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
    bounds = labels.bounds[torch.as_tensor(seqs)]
    offset, n, first = bounds[:, 0:1], bounds[:, 1:2], bounds[:, 2:3]
    length = int(n.max())
    t = torch.arange(length)[None]  # local origin
    idx = offset + torch.minimum(t, n - 1)  # [B, L]
    steps = torch.arange(1, k + 1)
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
    steps = torch.arange(1, k + 1)
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
        torch.zeros(k, dtype=torch.float64) for _ in range(6)
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
        "loss": float(weighted_loss(sums, counts, weights.to(sums.dtype))),
        "feature_loss": round(float(weighted_loss(feature, feature_counts, weights.double())), 4),
        "acceptance": [round(a, 4) for a in acceptance],
        "tau": round(1 + sum(acceptance), 4),
    }


def _describe(result: dict) -> str:
    accepted = "/".join(f"{a:.2f}" for a in result["acceptance"])
    return f"loss {result['loss']:.3f}  acceptance {accepted}  tau~{result['tau']:.2f}"


def learning_rate(step: int, options: TrainOptions) -> float:
    """Linear warm-up, then cosine decay to a tenth of --lr."""
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    done = (step - options.warmup) / max(1, options.steps - options.warmup)
    return options.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


def save_checkpoint(path_st: Path, path_json: Path, head, optimizer, state: dict) -> None:
    """Head and AdamW state as tensors in safetensors, scalars in JSON (no pickle)."""
    tensors = {f"head.{n}": t.detach().contiguous() for n, t in head.state_dict().items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            tensors[f"optim.{i}.{key}"] = torch.as_tensor(value).contiguous()
    write_with(path_st, lambda tmp: save_file(tensors, str(tmp)))
    write_with(path_json, lambda tmp: tmp.write_text(json.dumps(state, indent=2) + "\n"))


def load_checkpoint(path_st: Path, path_json: Path, head, optimizer) -> dict:
    try:
        state = json.loads(path_json.read_text())
        with safe_open(str(path_st), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(
            f"cannot read the checkpoint {path_st}: {e}; rerun without --resume"
        ) from None
    head.load_state_dict({n[5:]: t for n, t in tensors.items() if n.startswith("head.")})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, tensor in tensors.items():
        if name.startswith("optim."):
            _, i, key = name.split(".", 2)
            optimizer.state[params[int(i)]][key] = tensor
    return state


def _distributed() -> tuple[int, int, bool]:
    """(rank, world size, whether we started the process group) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")
    return dist.get_rank(), world, started


def _split(n: int, fraction: float, seed: int, world: int) -> tuple[list[int], list[int]]:
    """Sequence indices for training and held-out evaluation, at least one per rank each."""
    cut = max(world, round(n * fraction))
    if n - cut < world:
        raise UserError(
            f"the training text makes only {n} sequences, too few to train and hold out some "
            f"on {world} process(es): give more text"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[cut:]), sorted(order[:cut])


def _without_steps(recipe: dict) -> dict:
    """A resumed run may change --steps (train longer); everything else must match."""
    return {k: v for k, v in recipe.items() if k != "steps"}


def train_heads(options: TrainOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Train MTP heads for options.model and write options.out (+ .json); returns a summary."""
    began = time.perf_counter()
    rank, world, started = _distributed()
    try:
        return _train(options, rank, world, progress or print, began)
    finally:
        if started:
            dist.destroy_process_group()


def _train(options, rank, world, progress, began) -> dict:
    def say(message: str) -> None:
        if rank == 0:
            progress(message)

    if options.threads:
        torch.set_num_threads(options.threads)
    paths = artifact_paths(options.out)
    if rank == 0:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    loaded = load_model(options.model)
    target = loaded.model.requires_grad_(False)
    target_hash = target_fingerprint(target)
    c = target.config
    start = None
    if options.init:  # continue training these heads: their design carries over
        start = load_heads(options.init, target, loaded.name)
        options.attention = start.config.attention
        say(f"starting from {options.init} ({start.config.attention} attention)")
    session, bundle_hash = None, None
    if options.bundle:
        session, bundle_hash = open_target_bundle(options.bundle, loaded)
    # The cache of written text is keyed by who wrote it.
    text_hash, writer = {
        "bundle": (bundle_hash, session),
        "fp32": (target_hash, target),
        "int8": ("int8-" + target_hash, None),
    }[options.writer]
    say(
        f"{'the exported target' if options.writer == 'bundle' else options.writer + ' target'}"
        f" writes the text; {'the exported target' if session else 'the target'} labels it"
    )

    sequences = build_corpus(loaded, options, text_hash, rank, world, say, writer)
    if options.write_only:
        tokens = sum(len(s.tokens) - s.start for s in sequences)
        say(f"wrote the text: {len(sequences)} sequences, {tokens} tokens to draft from")
        return {"sequences": len(sequences), "draft_tokens": tokens}
    train_ids, heldout_ids = _split(len(sequences), options.heldout, options.seed, world)
    say(f"labelling {sum(len(s.tokens) for s in sequences)} tokens in {len(sequences)} sequences")

    cache = options.attention == "target_cache"  # labels keep the target's last-layer K/V
    shown = say if rank == 0 else None  # progress bars: the first process's only
    context = options.attention != "none"

    def label(ids: list[int], part: str) -> Labels:
        chosen = [sequences[i] for i in ids[rank::world]]
        # The exported program returns no K/V: heads that read the cache learn it from the
        # eager target (the bundle still writes the text).
        by_session = session is not None and not cache
        source = bundle_hash if by_session else target_hash
        path = paths["labels"].with_name(f"{paths['labels'].name}.{part}{rank}.safetensors")
        return cached_labels(
            path,
            chosen,
            source,
            cache,
            lambda: (
                label_with_session(session, chosen, shown)
                if by_session
                else label_sequences(target, chosen, cache, say=shown)
            ),
            say,
        )

    train, heldout = label(train_ids, "train"), label(heldout_ids, "heldout")

    counts = label_counts(train, c.vocab_size)
    heldout_counts = label_counts(heldout, c.vocab_size)
    if world > 1:
        dist.all_reduce(counts)
        dist.all_reduce(heldout_counts)
    # Heads trained further (--init) take the vocabulary of the text they now learn, at their
    # own size: text of another kind uses other tokens (v6's 8192, chosen on template answers,
    # covered 93.6% of the target's choices on answers to self-written requests).
    size = options.draft_vocab if start is None else start.config.draft_vocab_size
    draft_ids, coverage = draft_vocabulary(counts, size)
    to_draft = torch.full((c.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    say(
        f"draft vocabulary {len(draft_ids)} tokens: covers {coverage:.1%} of the target's "
        f"predictions in training, "
        f"{float(heldout_counts[draft_ids].sum() / heldout_counts.sum().clamp(min=1)):.1%} held out"
    )

    torch.manual_seed(options.seed)
    config = MTPConfig(
        hidden_size=c.hidden_size,
        intermediate_size=options.intermediate_size or c.intermediate_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=len(draft_ids),
        rms_norm_eps=c.rms_norm_eps,
        num_blocks=options.num_blocks,
        target_name=loaded.name,
        target_hash=target_hash,
        k=options.k,
        **(cache_attention_config(target, options.attention) if context else {}),
    )
    if start is not None:
        config = MTPConfig.from_dict({**start.config.to_dict(), "k": options.k, "recipe": {}})
        head = MTPHead(config)
        head.load_state_dict(start.float().state_dict())
        carry_vocabulary(head, start, target, draft_ids)
    else:
        head = init_from_target(MTPHead(config), target, draft_ids)
    head.lm_head.weight.requires_grad_(options.train_lm_head)
    model = head
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(head)
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad],
        lr=options.lr,
        betas=(0.9, 0.95),
        weight_decay=options.weight_decay,
    )
    weights = options.step_decay ** torch.arange(options.k, dtype=torch.float32)
    embedding = target.embed_tokens.weight.detach()
    teacher_head = target_lm_head(target).detach()[draft_ids]
    soft = options.labels == "soft"
    longest = int(max(train.bounds[:, 1].max(), heldout.bounds[:, 1].max()))
    rope = rope_tables(c, longest + options.k + 1)

    step, history = 0, []
    recipe = options.recipe()
    if options.resume and paths["checkpoint"].is_file():
        state = load_checkpoint(paths["checkpoint"], paths["checkpoint_json"], head, optimizer)
        if (
            _without_steps(state["recipe"]) != _without_steps(recipe)
            or state["world_size"] != world
        ):
            raise UserError(
                f"{paths['checkpoint']} was made with other options or another number of "
                "processes: rerun with the same ones, or without --resume"
            )
        if not torch.equal(head.draft_ids, draft_ids):
            raise UserError(
                f"the training text changed since {paths['checkpoint']}: rerun without --resume"
            )
        step, history = state["step"], state["history"]
        say(f"resumed at step {step}")
    elif options.resume:
        say(f"no checkpoint at {paths['checkpoint']}: starting from scratch")

    def held_out() -> dict:
        return evaluate(
            head,
            heldout,
            embedding,
            options.k,
            to_draft,
            weights,
            world,
            rope,
            teacher_head,
            soft,
            options.batch_size,
            show=rank == 0,
        )

    def training_batch(generator) -> Batch:
        """--batch-size draft origins drawn at random from the whole text; for heads with
        attention, random whole sequences holding about that many (they need the context)."""
        if not context:
            draw = torch.randint(len(train.starts), (options.batch_size,), generator=generator)
            return origin_batch(train, train.starts[draw], embedding, options.k)
        order = torch.randperm(len(train.bounds), generator=generator).tolist()
        group = batches_of(train, order, options.batch_size)[0]
        return sequence_batch(train, group, embedding, options.k, rope, context)

    if step == 0:
        history.append({"step": 0, **held_out()})
        say("step 0  held-out " + _describe(history[-1]))
    running, last_log = [], time.perf_counter()
    bar = progress_bar(options.steps, "training", unit="step", initial=step, disable=rank != 0)
    while step < options.steps:
        # Batches depend only on (seed, rank, step), so a resumed run draws the same ones.
        generator = torch.Generator().manual_seed(options.seed * 1_000_003 + rank * 7919 + step)
        batch = training_batch(generator)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, options)
        logits, hidden = model(batch.h, batch.embs, batch.context, return_hidden=True)
        sums, counts = draft_losses(logits, batch, train, to_draft, teacher_head, soft)
        loss = weighted_loss(sums, counts, weights)
        if options.feature_loss:
            loss = loss + options.feature_loss * weighted_loss(
                *feature_losses(hidden, batch, train), weights
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        running.append(float(loss.detach()))
        step += 1
        bar.set_postfix_str(f"loss {running[-1]:.3f}", refresh=False)
        bar.update(1)

        if step % options.eval_every == 0 or step == options.steps:
            history.append({"step": step, "train_loss": sum(running) / len(running), **held_out()})
        if rank == 0 and (step % options.checkpoint_every == 0 or step == options.steps):
            state = {"step": step, "recipe": recipe, "world_size": world, "history": history}
            save_checkpoint(paths["checkpoint"], paths["checkpoint_json"], head, optimizer, state)
        if step % options.log_every == 0 or step == options.steps:
            rate = len(running) / (time.perf_counter() - last_log)
            line = f"step {step}/{options.steps}  loss {sum(running) / len(running):.3f}"
            line += f"  held-out {_describe(history[-1])} (step {history[-1]['step']})"
            say(f"{line}  lr {learning_rate(step - 1, options):.1e}  {rate:.1f} steps/s")
            running, last_log = [], time.perf_counter()
    bar.close()

    final = history[-1]
    summary = {
        "out": str(options.out),
        "target": loaded.name,
        "steps": step,
        "world_size": world,
        "train_tokens": int(train.bounds[:, 1].sum()),
        "sequences": len(sequences),
        "draft_vocab": len(draft_ids),
        "coverage": round(coverage, 4),
        "heldout_loss": round(final["loss"], 4),
        "heldout_acceptance": final["acceptance"],
        "heldout_tau": final["tau"],
        "seconds": round(time.perf_counter() - began, 1),
    }
    config.recipe = {**recipe, **{k: v for k, v in summary.items() if k != "out"}}
    summary["history"] = history
    if rank == 0:
        save_heads(head, config, options.out)
        say(f"wrote {options.out}: held-out {_describe(final)}, {summary['seconds']:.0f} s")
    return summary
