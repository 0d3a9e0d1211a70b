"""The run: text, labels, draft vocabulary, training with held-out evaluations, the best heads,
the report; under --minutes, each stage on its deadline (budget.py).

What a run keeps next to --out (options.artifact_paths) is what --resume reads back: the text
(<out>.gen.jsonl), the labels (<out>.labels.*), the checkpoint (<out>.ckpt.safetensors: the head,
AdamW's state and the best held-out head) and <out>.ckpt.json (the step, the evaluations, and
under --minutes the seconds spent per stage and how much text was written)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from mtp_edge.checkpoints import load_model
from mtp_edge.errors import UserError
from mtp_edge.files import write_with
from mtp_edge.logs import progress_bar
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
from mtp_edge.train.budget import Budget, minutes_left
from mtp_edge.train.labels import (
    Labels,
    cached_labels,
    coverage_vocabulary_size,
    draft_vocabulary,
    label_counts,
    label_sequences,
    label_with_session,
    labels_to,
    select_sequences,
)
from mtp_edge.train.loop import (
    IGNORE,
    Batch,
    batches_of,
    describe,
    draft_losses,
    evaluate,
    feature_losses,
    learning_rate,
    load_checkpoint,
    origin_batch,
    rope_tables,
    save_checkpoint,
    sequence_batch,
    weighted_loss,
)
from mtp_edge.train.options import TrainOptions, artifact_paths
from mtp_edge.train.rates import measure_rates
from mtp_edge.train.report import final_report
from mtp_edge.train.writer import build_corpus, int8_writer, open_target_bundle

# Under --minutes, held-out evaluations come this many times over the training time (and once
# more at its end); each is also a checkpoint.
EVALUATIONS_PER_RUN = 6


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


def _comparable(recipe: dict) -> dict:
    """A resumed run may change --steps or --minutes (train longer); the rest must match.
    Runs recorded before --labeller existed were labelled by the bundle when given, else by
    the target as loaded."""
    recipe = {"labeller": "bundle" if recipe.get("bundle") else "fp32", **recipe}
    return {k: v for k, v in recipe.items() if k not in ("steps", "minutes")}


def _better(entry: dict, best: dict | None) -> bool:
    """The held-out result to keep: higher tau (greedy acceptance is what drafting earns), then
    lower loss."""
    if best is None:
        return True
    return (entry["tau"], -entry["loss"]) > (best["tau"], -best["loss"])


def _read_state(path: Path) -> dict:
    """<out>.ckpt.json, or nothing when there is none (or it is unreadable: then the
    checkpoint is refused later, with its own message)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def train_heads(
    options: TrainOptions,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Train MTP heads for options.model and write options.out (+ .json): the best held-out
    heads of the run. Returns a summary (with "report", the final report's text). `clock`
    times --minutes (injectable for tests)."""
    rank, world, started = _distributed()
    try:
        if options.minutes is not None and world > 1:
            raise UserError(
                "--minutes runs in one process (its stages stop on one clock): run it without "
                "torchrun, or give --steps"
            )
        summary = _train(options, rank, world, progress or print, clock)
        if started:  # leave together: rank 0 writes files last, and a rank that tears the
            dist.barrier()  # group down while the other still talks to it can abort at exit
        return summary
    finally:
        if started:
            dist.destroy_process_group()


def _train(options: TrainOptions, rank: int, world: int, progress, clock) -> dict:
    def say(message: str) -> None:
        if rank == 0:
            progress(message)

    if options.threads:
        torch.set_num_threads(options.threads)
    paths = artifact_paths(options.out)
    if rank == 0:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    state = _read_state(paths["checkpoint_json"]) if options.resume else {}
    # The stages' clock: a budget under --minutes, else one without end (stage times, rates).
    timer, budget = Budget(math.inf, clock=clock), None
    if options.minutes is not None:
        earlier = state.get("budget", {})
        timer = budget = Budget(options.minutes, earlier.get("spent"), clock)
        budget.frozen_text = earlier.get("written_text")
        if budget.frozen_text is not None:  # the same text: as much offline text as before
            budget.offline_cap = earlier.get("offline_tokens")
        if budget.left_s() <= 0:
            raise UserError(
                f"--minutes {options.minutes:g}: this run already spent "
                f"{budget.spent_s() / 60:.1f} minutes ({paths['checkpoint_json']}): give more "
                "minutes to train further"
            )
    timer.stage("loading")

    def keep_state(extra: dict | None = None) -> None:
        """<out>.ckpt.json: the budget so far (and the training state, when given)."""
        if rank != 0:
            return
        record = dict(extra or {})
        if budget is not None:
            record["budget"] = {"spent": budget.spent_by_stage()}
            if written_all:  # what a resumed run reads back instead of writing more
                written = budget.frozen_text or (budget.written_text + [0, 0])[:2]
                record["budget"]["written_text"] = written
                record["budget"]["offline_tokens"] = budget.offline_cap
        text = json.dumps(record, indent=2) + "\n"
        write_with(paths["checkpoint_json"], lambda tmp: tmp.write_text(text))

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
    # The cache of written text is keyed by who wrote it, the labels by who labelled them.
    int8 = int8_writer(target) if "int8" in (options.writer, options.labeller) else None
    text_hash, writer = {
        "bundle": (bundle_hash, session),
        "fp32": (target_hash, target),
        "int8": ("int8-" + target_hash, int8),
    }[options.writer]
    cache = options.attention == "target_cache"  # labels keep the target's last-layer K/V
    # The exported program returns no K/V: heads that read the cache are labelled by the
    # eager target (the bundle may still write the text).
    by_session = options.labeller == "bundle" and not cache
    labeller = {"int8": int8, "fp32": target, "bundle": target if cache else session}[
        options.labeller
    ]
    label_hash = (
        bundle_hash
        if by_session
        else {"int8": "int8-" + target_hash}.get(options.labeller, target_hash)
    )

    def named(kind: str) -> str:
        return "the exported target" if kind == "bundle" else f"the {kind} target"

    say(
        f"{named(options.writer)} writes the text; "
        f"{named('bundle' if by_session else options.labeller.replace('bundle', 'fp32'))} "
        "labels it"
    )
    if budget is not None:
        budget.stage("measuring")
        measure_rates(
            budget, target if by_session else labeller, session if by_session else None, options
        )
        say(f"{options.minutes:g} minutes; measured: {budget.describe_plan()}")

    earlier_training = {k: v for k, v in state.items() if k != "budget"}
    written_all = False
    if budget is not None:  # an interrupted run's writing time counts too
        budget.after_batch = lambda: keep_state(earlier_training)
    sequences = build_corpus(loaded, options, text_hash, rank, world, say, writer, timer)
    written_all = True
    if budget is not None:
        budget.after_batch = None
        keep_state(earlier_training)
    written = sum(len(s.tokens) - s.start - 1 for s in sequences if s.kind not in ("", "offline"))
    if options.write_only:
        tokens = sum(len(s.tokens) - s.start for s in sequences)
        say(f"wrote the text: {len(sequences)} sequences, {tokens} tokens to draft from")
        return {"sequences": len(sequences), "draft_tokens": tokens}
    train_ids, heldout_ids = _split(len(sequences), options.heldout, options.seed, world)
    say(f"labelling {sum(len(s.tokens) for s in sequences)} tokens in {len(sequences)} sequences")

    shown = say if rank == 0 else None  # progress bars: the first process's only
    context = options.attention != "none"
    timer.stage("labelling")
    stop = None
    if budget is not None:  # the text's tokens per draft origin: prompts are labelled too
        origins = sum(max(1, len(s.tokens) - s.start - 1) for s in sequences)
        tokens_per_origin = sum(len(s.tokens) for s in sequences) / origins
        stop = budget.labelling_stop(options.batch_size, tokens_per_origin)

    def label(ids: list[int], part: str) -> tuple[Labels, list]:
        chosen = [sequences[i] for i in ids[rank::world]]
        path = paths["labels"].with_name(f"{paths['labels'].name}.{part}{rank}.safetensors")
        labels = cached_labels(
            path,
            chosen,
            label_hash,
            cache,
            lambda: (
                label_with_session(session, chosen, shown, stop)
                if by_session
                else label_sequences(labeller, chosen, cache, say=shown, stop=stop)
            ),
            say,
            prefix_ok=budget is not None and options.resume,
        )
        return labels, chosen[: len(labels.bounds)]

    # Held-out first: under a deadline, the training text is what gets cut.
    heldout, heldout_seqs = label(heldout_ids, "heldout")
    train, train_seqs = label(train_ids, "train")
    labelled = int(train.bounds[:, 1].sum() + heldout.bounds[:, 1].sum())
    if len(train_seqs) < len(train_ids[rank::world]):
        say(f"labelled {len(train_seqs)} of {len(train_ids)} training sequences by the deadline")

    counts = label_counts(train, c.vocab_size)
    heldout_counts = label_counts(heldout, c.vocab_size)
    if world > 1:
        dist.all_reduce(counts)
        dist.all_reduce(heldout_counts)
    # Heads trained further (--init) take the vocabulary of the text they now learn, at their
    # own size: text of another kind uses other tokens (v6's 8192, chosen on template answers,
    # covered 93.6% of the target's choices on answers to self-written requests).
    if start is not None:
        size = start.config.draft_vocab_size
    elif options.draft_vocab == "auto":
        size = coverage_vocabulary_size(counts)
    else:
        size = options.draft_vocab
    draft_ids, coverage = draft_vocabulary(counts, size)
    heldout_coverage = float(heldout_counts[draft_ids].sum() / heldout_counts.sum().clamp(min=1))
    to_draft = torch.full((c.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    say(
        f"draft vocabulary {len(draft_ids)} tokens"
        f"{' (auto)' if options.draft_vocab == 'auto' and start is None else ''}: covers "
        f"{coverage:.1%} of the target's predictions in training, {heldout_coverage:.1%} held out"
    )

    device = options.device
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
    head = head.to(device)
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
    weights = options.step_decay ** torch.arange(options.k, dtype=torch.float32, device=device)
    embedding = target.embed_tokens.weight.detach().to(device)
    teacher_head = target_lm_head(target).detach()[draft_ids].to(device)
    to_draft = to_draft.to(device)
    heldout_cpu = heldout
    train, heldout = labels_to(train, device), labels_to(heldout, device)
    soft = options.labels == "soft"
    longest = int(max(train.bounds[:, 1].max(), heldout.bounds[:, 1].max()))
    rope = tuple(t.to(device) for t in rope_tables(c, longest + options.k + 1))

    step, history, best, best_entry = 0, [], None, None
    recipe = options.recipe()
    if options.resume and paths["checkpoint"].is_file() and "step" in state:
        state, best = load_checkpoint(
            paths["checkpoint"], paths["checkpoint_json"], head, optimizer
        )
        if (
            _comparable(state.get("recipe", {})) != _comparable(recipe)
            or state.get("world_size") != world
        ):
            raise UserError(
                f"{paths['checkpoint']} was made with other options or another number of "
                "processes: rerun with the same ones, or without --resume"
            )
        if not torch.equal(head.draft_ids.cpu(), draft_ids):
            raise UserError(
                f"the training text changed since {paths['checkpoint']}: rerun without --resume"
            )
        step, history = state["step"], state["history"]
        best_entry = state.get("best")
        best = {n: t.to(device) for n, t in best.items()} or None
        say(f"resumed at step {step}")
    elif options.resume:
        say(f"no checkpoint at {paths['checkpoint']}: starting from scratch")

    def held_out(data: Labels = heldout, show: bool = True, then: str = "training") -> dict:
        """Held-out results of the head as it is (its time is the evaluation stage's)."""
        timer.stage("evaluation")
        result = evaluate(
            head,
            data,
            embedding,
            options.k,
            to_draft,
            weights,
            world,
            rope,
            teacher_head,
            soft,
            options.batch_size,
            show=show and rank == 0,
        )
        timer.stage(then)
        return result

    def remember(entry: dict) -> None:
        """A held-out evaluation: into the history, and kept if it is the best so far."""
        nonlocal best, best_entry
        history.append(entry)
        if _better(entry, best_entry):
            best_entry = entry
            best = {n: t.detach().clone() for n, t in head.state_dict().items()}

    def checkpoint() -> None:
        if rank == 0:
            record = {"step": step, "recipe": recipe, "world_size": world, "history": history}
            record["best"] = best_entry
            save_checkpoint(
                paths["checkpoint"], paths["checkpoint_json"], head, optimizer, record, best
            )
            if budget is not None:  # the same state, with the time spent so far
                keep_state(record)

    def training_batch(generator) -> Batch:
        """--batch-size draft origins drawn at random from the whole text; for heads with
        attention, random whole sequences holding about that many (they need the context)."""
        if not context:
            draw = torch.randint(len(train.starts), (options.batch_size,), generator=generator)
            return origin_batch(train, train.starts[draw.to(device)], embedding, options.k)
        order = torch.randperm(len(train.bounds), generator=generator).tolist()
        group = batches_of(train, order, options.batch_size)[0]
        return sequence_batch(train, group, embedding, options.k, rope, context)

    timer.stage("training")
    if step == 0:
        remember({"step": 0, **held_out()})
        say("step 0  held-out " + describe(history[-1]))

    # Under --minutes: a deadline instead of --steps, the schedule by the share of time spent
    # (counting earlier runs' training), evaluations every so often.
    deadline = budget.training_deadline() if budget is not None else None
    trained_before = budget.before.get("training", 0.0) if budget is not None else 0.0
    began = clock()
    every_s = ((deadline or began) - began) / EVALUATIONS_PER_RUN
    last_eval = began

    def time_share() -> float | None:
        if deadline is None:
            return None
        spent = trained_before + clock() - began
        return spent / max(trained_before + deadline - began, 1e-9)

    def more() -> bool:
        if deadline is None:
            return step < options.steps
        return clock() < deadline

    running, last_log, first_step = [], time.perf_counter(), step
    bar = progress_bar(options.steps, "training", unit="step", initial=step, disable=rank != 0)
    going = more()
    while going:
        # Batches depend only on (seed, rank, step), so a resumed run draws the same ones.
        generator = torch.Generator().manual_seed(options.seed * 1_000_003 + rank * 7919 + step)
        batch = training_batch(generator)
        rate = learning_rate(step, options, time_share())
        for group in optimizer.param_groups:
            group["lr"] = rate
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
        postfix = f"loss {running[-1]:.3f}"
        if deadline is not None:
            postfix += "  " + minutes_left(deadline, clock)
        bar.set_postfix_str(postfix, refresh=False)
        bar.update(1)

        going = more()  # read once: the clock moves on
        last = not going
        if deadline is None:
            evaluate_now = step % options.eval_every == 0 or last
            save_now = step % options.checkpoint_every == 0 or last
        else:
            evaluate_now = save_now = last or clock() - last_eval >= every_s
        if evaluate_now:
            # No bar of its own under the training bar (in a log, a nested bar is noise).
            result = held_out(show=False)
            remember({"step": step, "train_loss": sum(running) / len(running), **result})
            last_eval = clock()
        if save_now:
            checkpoint()
        if step % options.log_every == 0 or last or (evaluate_now and deadline is not None):
            steps_s = len(running) / (time.perf_counter() - last_log)
            total = f"/{options.steps}" if options.steps else ""
            line = f"step {step}{total}  loss {sum(running) / len(running):.3f}"
            line += f"  held-out {describe(history[-1])} (step {history[-1]['step']})"
            say(f"{line}  lr {rate:.1e}  {steps_s:.1f} steps/s")
            running, last_log = [], time.perf_counter()
    bar.close()
    if step == first_step:  # no step this run (no time left for one): keep the state anyway
        checkpoint()

    timer.stage("evaluation")
    if budget is not None:
        say(f"evaluating the best heads ({minutes_left(budget.end(), budget.clock)})")
    if best is not None:
        head.load_state_dict(best)
    final = best_entry or history[-1]
    categories = {}
    kinds = sorted({s.kind for s in heldout_seqs if s.kind})
    if world == 1 and len(kinds) > 1:  # per kind of text (evaluate's all-reduce needs one set)
        for kind in kinds:
            chosen = [i for i, s in enumerate(heldout_seqs) if s.kind == kind]
            part = labels_to(select_sequences(heldout_cpu, chosen), device)
            categories[kind] = held_out(part, show=False, then="evaluation")
    summary = {
        "out": str(options.out),
        "target": loaded.name,
        "steps": step,
        "best_step": final["step"],
        "world_size": world,
        "train_tokens": int(train.bounds[:, 1].sum()),
        "sequences": len(sequences),
        "draft_vocab": len(draft_ids),
        "coverage": round(coverage, 4),
        "heldout_coverage": round(heldout_coverage, 4),
        "heldout_loss": round(final["loss"], 4),
        "heldout_acceptance": final["acceptance"],
        "heldout_tau": final["tau"],
    }
    config.recipe = {**recipe, **{k: v for k, v in summary.items() if k != "out"}}
    summary["history"] = history
    if rank == 0:
        save_heads(head.cpu(), config, options.out)
        say(f"wrote {options.out}: held-out {describe(final)} (step {final['step']})")
        text = {"written": written, "labelled": labelled, "sequences": len(sequences)}
        summary["report"] = final_report(
            options, loaded.name, target, head, summary, categories, timer, text
        )
        if budget is not None:
            keep_state({**_read_state(paths["checkpoint_json"]), "report": summary["report"]})
    return summary
