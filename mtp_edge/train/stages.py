"""The run, in stages: setup (the target, who writes and labels), writing, labelling, the heads
and their optimizer, the step loop (step_loop.py), evaluation of the best heads and the report. The
stages share a Run (state.py) and hand each other what they made; under --minutes, each stage
runs on its deadline (budget.py).

What a run keeps next to --out (options.artifact_paths) is what --resume reads back: the text
(<out>.gen.jsonl), the labels (<out>.labels.*), the checkpoint (<out>.ckpt.safetensors: the head,
AdamW's state and the best held-out head) and <out>.ckpt.json (the step, the evaluations, and
under --minutes the seconds spent per stage and how much text was written)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from mtp_edge.checkpoints import load_model
from mtp_edge.errors import UserError
from mtp_edge.mtp import (
    MTPConfig,
    MTPHead,
    cache_attention_config,
    carry_vocabulary,
    init_from_target,
    load_heads,
    save_heads,
    target_lm_head,
)
from mtp_edge.train.budget import Budget, minutes_left
from mtp_edge.train.engines import set_up_engines
from mtp_edge.train.final_report import final_report
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
from mtp_edge.train.losses import IGNORE, describe, rope_tables
from mtp_edge.train.options import TrainOptions, artifact_paths
from mtp_edge.train.prompts import YOURS, encode_request, read_prompts
from mtp_edge.train.rates import measure_rates
from mtp_edge.train.resume import comparable, load_checkpoint, read_state
from mtp_edge.train.state import Labelled, Run, Scores, Trainer
from mtp_edge.train.step_loop import held_out, train_steps
from mtp_edge.train.writer import build_corpus


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


def _split_text(sequences, fraction: float, seed: int, world: int) -> tuple[list, list]:
    """_split over the text, the user's requests (--prompts) split on their own, so that the
    held-out part holds its share of them: what "tau on your requests" is measured on. A
    request's answers (--answers-per-request) stay on one side: a held-out request keeps its
    first (greedy) answer for the measurement, and its sampled ones are left out."""
    yours = [i for i, s in enumerate(sequences) if s.kind == YOURS]
    if not yours:
        return _split(len(sequences), fraction, seed, world)
    rest = [i for i, s in enumerate(sequences) if s.kind != YOURS]
    train, heldout = _split(len(rest), fraction, seed, world)
    train, heldout = [rest[i] for i in train], [rest[i] for i in heldout]
    groups: dict[str, list[int]] = {}  # a request's answers, its greedy one first
    for i in yours:
        groups.setdefault(sequences[i].group or f"\x00{i}", []).append(i)
    answers = list(groups.values())
    if len(answers) >= 2:
        order = torch.randperm(len(answers), generator=torch.Generator().manual_seed(seed + 1))
        cut = max(1, round(len(answers) * fraction))
        heldout += [answers[i][0] for i in order[:cut].tolist()]
        train += [j for i in order[cut:].tolist() for j in answers[i]]
    else:
        train += [j for group in answers for j in group]
    return sorted(train), sorted(heldout)


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
    run = set_up(options, rank, world, progress, clock)
    sequences = write(run)
    if options.write_only:
        tokens = sum(len(s.tokens) - s.start for s in sequences)
        run.say(f"wrote the text: {len(sequences)} sequences, {tokens} tokens to draft from")
        return {"sequences": len(sequences), "draft_tokens": tokens}
    labelled = label(run, sequences)
    trainer = heads_and_optimizer(run, labelled)
    scores = resumed(run, trainer, labelled)
    train_steps(run, trainer, scores)
    return evaluation(run, labelled, trainer, scores)


def init_heads(init: str) -> str:
    """The heads file --init names: a heads file, or a bundle directory (the heads it was
    exported from: those shipped for its model, checked against it)."""
    path = Path(init)
    if (path / "manifest.json").is_file():
        from mtp_edge.runtime.adapt import bundle_heads
        from mtp_edge.runtime.bundle import open_bundle

        return str(bundle_heads(open_bundle(path), None, "--init", "--init")[1])
    if not path.is_file():
        raise UserError(
            f"--init {init}: no heads file there; give the .safetensors heads to continue from "
            "(what mtp-train -o wrote) or the bundle they were exported into"
        )
    return init


def earlier_run(paths: dict[str, Path]) -> bool:
    """Whether anything a run keeps for --resume lies next to its --out."""
    labels = paths["labels"]
    kept = [path for name, path in paths.items() if name != "labels"]
    return any(p.exists() for p in kept) or any(labels.parent.glob(labels.name + ".*"))


def set_up(options: TrainOptions, rank: int, world: int, progress, clock) -> Run:
    """The budget (under --minutes), the target, --init's heads, who writes and who labels;
    under --minutes, this machine's rates measured."""
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.prompts:  # bad lines are refused before any long work (or any file made)
        options.requests = read_prompts(options.prompts)
    paths = artifact_paths(options.out)
    if options.resume and not earlier_run(paths):
        # A mistyped --out would otherwise start a whole new run of hours without a word.
        raise UserError(
            f"--resume: no earlier run next to {options.out} (no checkpoint, written text or "
            "labels beside it): check --out, or drop --resume to start a new run"
        )
    if rank == 0:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    state = read_state(paths["checkpoint_json"]) if options.resume else {}
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

    def say(message: str) -> None:
        if rank == 0:
            progress(message)

    loaded = load_model(options.model)
    loaded.model.requires_grad_(False)
    start = None
    if options.init:  # continue training these heads: their design carries over
        options.init = init_heads(options.init)
        start = load_heads(options.init, loaded.model, loaded.name)
        options.attention = start.config.attention
        say(f"starting from {options.init} ({start.config.attention} attention)")
    for number, request in enumerate(options.requests, 1):  # each renders, or one line
        try:
            encode_request(loaded.tokenizer, request)
        except UserError as e:
            raise UserError(f"--prompts {options.prompts}, request {number}: {e}") from None
    engines = set_up_engines(options, loaded, say, state.get("recipe", {}))
    run = Run(options, rank, world, progress, clock, paths, state, timer, budget, loaded, start,
              engines)  # fmt: skip
    if budget is not None:
        budget.stage("measuring")
        by_session = engines.by_session
        measure_rates(
            budget,
            run.target if by_session else engines.labeller,
            engines.session if by_session else None,
            options,
            say,
        )
        say(f"{options.minutes:g} minutes; measured: {budget.describe_plan()}")
    return run


def write(run: Run) -> list:
    """The text: the user's files, or offline text and what the target writes (cached)."""
    budget, earlier_training = run.budget, {k: v for k, v in run.state.items() if k != "budget"}
    if budget is not None:  # an interrupted run's writing time counts too
        budget.after_batch = lambda: run.keep_state(earlier_training)
    e = run.engines
    sequences = build_corpus(
        run.loaded, run.options, e.text_hash, run.rank, run.world, run.say, e.writer, run.timer
    )
    run.written_all = True
    if budget is not None:
        budget.after_batch = None
        run.keep_state(earlier_training)
    return sequences


def label(run: Run, sequences: list) -> Labelled:
    """Labels of the held-out and the training text (cached), and the draft vocabulary."""
    options, rank, world, budget, e = run.options, run.rank, run.world, run.budget, run.engines
    written = sum(len(s.tokens) - s.start - 1 for s in sequences if s.kind not in ("", "offline"))
    train_ids, heldout_ids = _split_text(sequences, options.heldout, options.seed, world)
    run.say(
        f"labelling {sum(len(s.tokens) for s in sequences)} tokens in {len(sequences)} sequences"
    )
    shown = run.say if rank == 0 else None  # progress bars: the first process's only
    run.timer.stage("labelling")
    stop = None
    if budget is not None:  # the text's tokens per draft origin: prompts are labelled too
        origins = sum(max(1, len(s.tokens) - s.start - 1) for s in sequences)
        tokens_per_origin = sum(len(s.tokens) for s in sequences) / origins
        stop = budget.labelling_stop(options.batch_size, tokens_per_origin)

    def part(ids: list[int], name: str) -> tuple[Labels, list]:
        chosen = [sequences[i] for i in ids[rank::world]]
        labels_path = run.paths["labels"]
        path = labels_path.with_name(f"{labels_path.name}.{name}{rank}.safetensors")
        labels = cached_labels(
            path,
            chosen,
            e.label_hash,
            e.cache,
            lambda: (
                label_with_session(e.session, chosen, shown, stop)
                if e.by_session
                else label_sequences(e.labeller, chosen, e.cache, say=shown, stop=stop)
            ),
            run.say,
            prefix_ok=budget is not None and options.resume,
        )
        return labels, chosen[: len(labels.bounds)]

    # Held-out first: under a deadline, the training text is what gets cut.
    heldout, heldout_seqs = part(heldout_ids, "heldout")
    train, train_seqs = part(train_ids, "train")
    if len(train_seqs) < len(train_ids[rank::world]):
        run.say(
            f"labelled {len(train_seqs)} of {len(train_ids)} training sequences by the deadline"
        )

    vocab = run.target.config.vocab_size
    counts, heldout_counts = label_counts(train, vocab), label_counts(heldout, vocab)
    if world > 1:
        dist.all_reduce(counts)
        dist.all_reduce(heldout_counts)
    # Heads trained further (--init) take the vocabulary of the text they now learn, at their
    # own size: text of another kind uses other tokens (v6's 8192, chosen on template answers,
    # covered 93.6% of the target's choices on answers to self-written requests).
    if run.start is not None:
        size = run.start.config.draft_vocab_size
    elif options.draft_vocab == "auto":
        size = coverage_vocabulary_size(counts)
    else:
        size = options.draft_vocab
    draft_ids, coverage = draft_vocabulary(counts, size)
    heldout_coverage = float(heldout_counts[draft_ids].sum() / heldout_counts.sum().clamp(min=1))
    auto = " (auto)" if options.draft_vocab == "auto" and run.start is None else ""
    run.say(
        f"draft vocabulary {len(draft_ids)} tokens{auto}: covers {coverage:.1%} of the "
        f"target's predictions in training, {heldout_coverage:.1%} held out"
    )
    return Labelled(sequences, written, train, heldout, train_seqs, heldout_seqs, draft_ids,
                    coverage, heldout_coverage)  # fmt: skip


def heads_and_optimizer(run: Run, labelled: Labelled) -> Trainer:
    """The heads (new from the target's rows, or --init's with the new vocabulary), AdamW,
    and what a step reads, on the training device."""
    options, target, draft_ids = run.options, run.target, labelled.draft_ids
    c, device = target.config, options.device
    context = options.attention != "none"
    torch.manual_seed(options.seed)
    config = MTPConfig(
        hidden_size=c.hidden_size,
        intermediate_size=options.intermediate_size or c.intermediate_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=len(draft_ids),
        rms_norm_eps=c.rms_norm_eps,
        num_blocks=options.num_blocks,
        target_name=run.loaded.name,
        target_hash=run.engines.target_hash,
        k=options.k,
        **(cache_attention_config(target, options.attention) if context else {}),
    )
    if run.start is not None:
        config = MTPConfig.from_dict({**run.start.config.to_dict(), "k": options.k, "recipe": {}})
        head = MTPHead(config)
        head.load_state_dict(run.start.float().state_dict())
        carry_vocabulary(head, run.start, target, draft_ids)
    else:
        head = init_from_target(MTPHead(config), target, draft_ids)
    head = head.to(device)
    head.lm_head.weight.requires_grad_(options.train_lm_head)
    model = head
    if run.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(head)
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad],
        lr=options.lr,
        betas=(0.9, 0.95),
        weight_decay=options.weight_decay,
    )
    to_draft = torch.full((c.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    train, heldout = labels_to(labelled.train, device), labels_to(labelled.heldout, device)
    longest = int(max(train.bounds[:, 1].max(), heldout.bounds[:, 1].max()))
    mine = [i for i, s in enumerate(labelled.heldout_seqs) if s.kind == YOURS]
    yours = None  # evaluate's all-reduce needs one held-out set on every process
    if mine and run.world == 1:
        yours = labels_to(select_sequences(labelled.heldout, mine), device)
    return Trainer(
        config=config,
        head=head,
        model=model,
        optimizer=optimizer,
        train=train,
        heldout=heldout,
        to_draft=to_draft.to(device),
        weights=options.step_decay ** torch.arange(options.k, dtype=torch.float32, device=device),
        embedding=target.embed_tokens.weight.detach().to(device),
        teacher_head=target_lm_head(target).detach()[draft_ids].to(device),
        rope=tuple(t.to(device) for t in rope_tables(c, longest + options.k + 1)),
        soft=options.labels == "soft",
        context=context,
        yours=yours,
    )


def resumed(run: Run, trainer: Trainer, labelled: Labelled) -> Scores:
    """The evaluations so far: none, or (--resume) the checkpoint's, loaded into the trainer."""
    options, paths, state = run.options, run.paths, run.state
    scores = Scores(recipe=options.recipe())
    if options.resume and paths["checkpoint"].is_file() and "step" in state:
        state, best = load_checkpoint(
            paths["checkpoint"], paths["checkpoint_json"], trainer.head, trainer.optimizer
        )
        run.state = state
        if (
            comparable(state.get("recipe", {})) != comparable(scores.recipe)
            or state.get("world_size") != run.world
        ):
            raise UserError(
                f"{paths['checkpoint']} was made with other options or another number of "
                "processes: rerun with the same ones, or without --resume"
            )
        if not torch.equal(trainer.head.draft_ids.cpu(), labelled.draft_ids):
            raise UserError(
                f"the training text changed since {paths['checkpoint']}: rerun without --resume"
            )
        scores.step, scores.history = state["step"], state["history"]
        scores.best_entry = state.get("best")
        scores.best = {n: t.to(options.device) for n, t in best.items()} or None
        run.say(f"resumed at step {scores.step}")
    elif options.resume:
        run.say(f"no checkpoint at {paths['checkpoint']}: starting from scratch")
    return scores


def evaluation(run: Run, labelled: Labelled, trainer: Trainer, scores: Scores) -> dict:
    """The best heads: per kind of text on the held-out part, written to --out, the report."""
    options, budget, head = run.options, run.budget, trainer.head
    run.timer.stage("evaluation")
    if budget is not None:
        run.say(f"evaluating the best heads ({minutes_left(budget.end(), budget.clock)})")
    if scores.best is not None:
        head.load_state_dict(scores.best)
    final = scores.best_entry or scores.history[-1]
    categories = {}
    kinds = sorted({s.kind for s in labelled.heldout_seqs if s.kind})
    if run.world == 1 and len(kinds) > 1:  # per kind of text (evaluate's all-reduce needs one set)
        for kind in kinds:
            chosen = [i for i, s in enumerate(labelled.heldout_seqs) if s.kind == kind]
            part = labels_to(select_sequences(labelled.heldout, chosen), options.device)
            categories[kind] = held_out(run, trainer, part, show=False, then="evaluation")
    sequences = labelled.sequences
    summary = {
        "out": str(options.out),
        "target": run.loaded.name,
        "steps": scores.step,
        "best_step": final["step"],
        "world_size": run.world,
        "train_tokens": int(labelled.train.bounds[:, 1].sum()),
        "sequences": len(sequences),
        "draft_vocab": len(labelled.draft_ids),
        "coverage": round(labelled.coverage, 4),
        "heldout_coverage": round(labelled.heldout_coverage, 4),
        "heldout_loss": round(final["loss"], 4),
        "heldout_acceptance": final["acceptance"],
        "heldout_tau": final["tau"],
    }
    if YOURS in categories:
        summary["your_requests_tau"] = categories[YOURS]["tau"]
    config = trainer.config
    config.recipe = {**scores.recipe, **{k: v for k, v in summary.items() if k != "out"}}
    summary["history"] = scores.history
    if run.rank == 0:
        save_heads(head.cpu(), config, options.out)
        run.say(f"wrote {options.out}: held-out {describe(final)} (step {final['step']})")
        if final["step"] == 0 and options.init and scores.step > 0:
            run.say(
                f"note: no step beat the heads of --init on held-out text ({scores.step} steps): "
                "they are written as they were (on this run's draft vocabulary); fewer --steps "
                "or a lower --lr learn without forgetting them, more text per request "
                "(--answers-per-request) gives more to learn"
            )
        text = {
            "written": labelled.written,
            "labelled": labelled.labelled,
            "sequences": len(sequences),
        }
        summary["report"] = final_report(
            options, run.loaded.name, run.target, head, summary, categories, run.timer, text
        )
        if budget is not None:
            run.keep_state(
                {**read_state(run.paths["checkpoint_json"]), "report": summary["report"]}
            )
    return summary
