"""The step loop: --steps steps, or under --minutes until training's deadline, with held-out
evaluations and checkpoints along the way; and the learning-rate schedule it follows."""

from __future__ import annotations

import math
import time

import torch

from mtp_edge.logs import progress_bar
from mtp_edge.train.budget import minutes_left
from mtp_edge.train.labels import Labels
from mtp_edge.train.losses import (
    Batch,
    batches_of,
    describe,
    draft_losses,
    evaluate,
    feature_losses,
    origin_batch,
    sequence_batch,
    weighted_loss,
)
from mtp_edge.train.options import TrainOptions
from mtp_edge.train.resume import save_checkpoint
from mtp_edge.train.state import Run, Scores, Trainer

# Under --minutes, held-out evaluations come this many times over the training time (and once
# more at its end); each is also a checkpoint.
EVALUATIONS_PER_RUN = 6

# Under --minutes the schedule runs on the share of the training time spent, not on steps (how
# many steps fit is only known at the end): the warm-up takes this share of it.
WARMUP_SHARE = 0.05


def learning_rate(step: int, options: TrainOptions, time_share: float | None = None) -> float:
    """Linear warm-up, then cosine decay to a tenth of --lr: over --steps, or over the training
    time (`time_share`: the share of it spent so far) under --minutes."""
    if time_share is not None:
        if time_share < WARMUP_SHARE:
            return options.lr * max(time_share / WARMUP_SHARE, 1 / options.warmup)
        done = (time_share - WARMUP_SHARE) / (1 - WARMUP_SHARE)
    elif step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    else:
        done = (step - options.warmup) / max(1, options.steps - options.warmup)
    return options.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


def held_out(
    run: Run, t: Trainer, data: Labels | None = None, show: bool = True, then: str = "training"
) -> dict:
    """Held-out results of the head as it is (its time is the evaluation stage's)."""
    run.timer.stage("evaluation")
    options = run.options
    result = evaluate(
        t.head, t.heldout if data is None else data, t.embedding, options.k, t.to_draft,
        t.weights, run.world, t.rope, t.teacher_head, t.soft, options.batch_size,
        show=show and run.rank == 0,
    )  # fmt: skip
    run.timer.stage(then)
    return result


def scored(run: Run, t: Trainer, show: bool = True) -> dict:
    """A held-out evaluation for the history: all the held-out text, and with --prompts also
    the held-out answers to the user's requests alone ("yours_tau")."""
    result = held_out(run, t, show=show)
    if t.yours is not None:
        result["yours_tau"] = held_out(run, t, t.yours, show=False)["tau"]
    return result


def checkpoint(run: Run, t: Trainer, scores: Scores) -> None:
    if run.rank == 0:
        record = {"step": scores.step, "recipe": scores.recipe, "world_size": run.world}
        record["history"], record["best"] = scores.history, scores.best_entry
        paths = run.paths
        save_checkpoint(
            paths["checkpoint"], paths["checkpoint_json"], t.head, t.optimizer, record, scores.best
        )
        if run.budget is not None:  # the same state, with the time spent so far
            run.keep_state(record)


def training_batch(run: Run, t: Trainer, generator) -> Batch:
    """--batch-size draft origins drawn at random from the whole text; for heads with
    attention, random whole sequences holding about that many (they need the context)."""
    size, k = run.options.batch_size, run.options.k
    if not t.context:
        draw = torch.randint(len(t.train.starts), (size,), generator=generator)
        origins = t.train.starts[draw.to(run.options.device)]
        return origin_batch(t.train, origins, t.embedding, k)
    order = torch.randperm(len(t.train.bounds), generator=generator).tolist()
    group = batches_of(t.train, order, size)[0]
    return sequence_batch(t.train, group, t.embedding, k, t.rope, t.context)


def one_step(run: Run, t: Trainer, step: int, time_share: float | None) -> tuple[float, float]:
    """One optimizer step on a batch that depends only on (seed, rank, step), so that a resumed
    run draws the same ones; returns the loss and the learning rate."""
    options = run.options
    generator = torch.Generator().manual_seed(options.seed * 1_000_003 + run.rank * 7919 + step)
    batch = training_batch(run, t, generator)
    rate = learning_rate(step, options, time_share)
    for group in t.optimizer.param_groups:
        group["lr"] = rate
    logits, hidden = t.model(batch.h, batch.embs, batch.context, return_hidden=True)
    sums, counts = draft_losses(logits, batch, t.train, t.to_draft, t.teacher_head, t.soft)
    loss = weighted_loss(sums, counts, t.weights)
    if options.feature_loss:
        loss = loss + options.feature_loss * weighted_loss(
            *feature_losses(hidden, batch, t.train), t.weights
        )
    t.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(t.head.parameters(), 1.0)
    t.optimizer.step()
    return float(loss.detach()), rate


class Pace:
    """When the loop stops, evaluates and saves: after --steps, or under --minutes on training's
    deadline, the schedule by the share of time spent (counting earlier runs' training) and
    evaluations every so often."""

    def __init__(self, run: Run):
        budget, self.options, self.clock = run.budget, run.options, run.clock
        self.deadline = budget.training_deadline() if budget is not None else None
        self.before = budget.before.get("training", 0.0) if budget is not None else 0.0
        self.began = self.last_eval = self.clock()
        self.every_s = ((self.deadline or self.began) - self.began) / EVALUATIONS_PER_RUN

    def time_share(self) -> float | None:
        if self.deadline is None:
            return None
        spent = self.before + self.clock() - self.began
        return spent / max(self.before + self.deadline - self.began, 1e-9)

    def more(self, step: int) -> bool:
        if self.deadline is None:
            return step < self.options.steps
        return self.clock() < self.deadline

    def now(self, step: int, last: bool) -> tuple[bool, bool]:
        """Whether to evaluate, whether to save after `step`."""
        if self.deadline is None:
            # at least ~10 evaluations a run: a short refinement (--init) can pass its best
            # between two evaluations 500 steps apart
            steps = self.options.steps or 0
            every = min(self.options.eval_every, max(25, steps // 10))
            return step % every == 0 or last, step % self.options.checkpoint_every == 0 or last
        due = last or self.clock() - self.last_eval >= self.every_s
        return due, due

    def left(self) -> str:
        return "" if self.deadline is None else "  " + minutes_left(self.deadline, self.clock)


def train_steps(run: Run, t: Trainer, scores: Scores) -> None:
    """The training stage: steps until Pace says stop, evaluating the held-out text and saving
    checkpoints as it says; the best heads so far stay in `scores`."""
    options, say = run.options, run.say
    run.timer.stage("training")
    if scores.step == 0:
        scores.remember({"step": 0, **scored(run, t)}, t.head)
        say("step 0  held-out " + describe(scores.history[-1]))
    pace = Pace(run)
    running, last_log, first_step = [], time.perf_counter(), scores.step
    bar = progress_bar(
        options.steps, "training", unit="step", initial=scores.step, disable=run.rank != 0
    )
    going = pace.more(scores.step)
    while going:
        loss, rate = one_step(run, t, scores.step, pace.time_share())
        running.append(loss)
        scores.step += 1
        step = scores.step
        bar.set_postfix_str(f"loss {loss:.3f}" + pace.left(), refresh=False)
        bar.update(1)

        going = pace.more(step)  # read once: the clock moves on
        evaluate_now, save_now = pace.now(step, last=not going)
        if evaluate_now:
            # No bar of its own under the training bar (in a log, a nested bar is noise).
            result = scored(run, t, show=False)
            entry = {"step": step, "train_loss": sum(running) / len(running), **result}
            scores.remember(entry, t.head)
            pace.last_eval = run.clock()
        if save_now:
            checkpoint(run, t, scores)
        timed_eval = evaluate_now and pace.deadline is not None
        if step % options.log_every == 0 or not going or timed_eval:
            steps_s = len(running) / (time.perf_counter() - last_log)
            total = f"/{options.steps}" if options.steps else ""
            line = f"step {step}{total}  loss {sum(running) / len(running):.3f}"
            line += f"  held-out {describe(scores.history[-1])} (step {scores.history[-1]['step']})"
            say(f"{line}  lr {rate:.1e}  {steps_s:.1f} steps/s")
            running, last_log = [], time.perf_counter()
    bar.close()
    if scores.step == first_step:  # no step this run (no time left for one): keep the state
        checkpoint(run, t, scores)
