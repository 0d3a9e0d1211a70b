"""What the stages of a run share (Run), and what each stage hands to the next: the labelled
text (Labelled), the heads with their optimizer (Trainer), the evaluations so far (Scores)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp_edge.checkpoints import LoadedModel
from mtp_edge.files import write_with
from mtp_edge.model import Transformer
from mtp_edge.mtp import MTPConfig, MTPHead
from mtp_edge.train.budget import Budget
from mtp_edge.train.corpus import Sequence
from mtp_edge.train.engines import Engines
from mtp_edge.train.labels import Labels
from mtp_edge.train.options import TrainOptions


@dataclass
class Run:
    """The run's settings, its process, its clocks and the target, as setup leaves them."""

    options: TrainOptions
    rank: int
    world: int
    progress: Callable[[str], None]
    clock: Callable[[], float]
    paths: dict[str, Path]
    state: dict  # <out>.ckpt.json as an earlier run left it (--resume), else {}
    timer: Budget  # the stages' clock: the budget under --minutes, else one without end
    budget: Budget | None  # under --minutes
    loaded: LoadedModel
    start: MTPHead | None  # --init's heads
    engines: Engines  # who writes and who labels
    written_all: bool = False  # the writing stage has ended (what a resumed run reads back)

    @property
    def target(self) -> Transformer:
        return self.loaded.model

    def say(self, message: str) -> None:
        """A progress line, from the first process only."""
        if self.rank == 0:
            self.progress(message)

    def keep_state(self, extra: dict | None = None) -> None:
        """<out>.ckpt.json: the budget so far (and the training state, when given)."""
        if self.rank != 0:
            return
        record = dict(extra or {})
        budget = self.budget
        if budget is not None:
            record["budget"] = {"spent": budget.spent_by_stage()}
            if self.written_all:  # what a resumed run reads back instead of writing more
                text = budget.written_text
                written = budget.frozen_text or (text + [0, 0])[: max(2, len(text))]
                record["budget"]["written_text"] = written
                record["budget"]["offline_tokens"] = budget.offline_cap
        text = json.dumps(record, indent=2) + "\n"
        write_with(self.paths["checkpoint_json"], lambda tmp: tmp.write_text(text))


@dataclass
class Labelled:
    """The text as the labelling stage leaves it: labels (on the CPU), the sequences they are
    of, the draft vocabulary chosen on them."""

    sequences: list[Sequence]  # all the text
    written: int  # response tokens the target wrote
    train: Labels
    heldout: Labels
    train_seqs: list[Sequence]
    heldout_seqs: list[Sequence]
    draft_ids: torch.Tensor
    coverage: float
    heldout_coverage: float

    @property
    def labelled(self) -> int:
        return int(self.train.bounds[:, 1].sum() + self.heldout.bounds[:, 1].sum())


@dataclass
class Trainer:
    """The heads in training and what a step reads, on the training device."""

    config: MTPConfig
    head: MTPHead
    model: torch.nn.Module  # the head, or its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    train: Labels
    heldout: Labels
    to_draft: torch.Tensor  # target token -> draft token (IGNORE outside the vocabulary)
    weights: torch.Tensor  # loss weight per draft step
    embedding: torch.Tensor
    teacher_head: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    soft: bool
    context: bool  # heads with attention (trained on whole sequences)
    # the held-out answers to --prompts' requests, what the run's best heads are chosen on when
    # there are any (None: no --prompts, or several processes)
    yours: Labels | None = None


def _rank(entry: dict) -> tuple:
    return (entry.get("yours_tau", entry["tau"]), entry["tau"], -entry["loss"])


@dataclass
class Scores:
    """The held-out evaluations so far and the best heads among them."""

    recipe: dict
    step: int = 0
    history: list[dict] = field(default_factory=list)
    best: dict | None = None  # the best heads' weights
    best_entry: dict | None = None

    def remember(self, entry: dict, head: MTPHead) -> None:
        """A held-out evaluation: into the history, and kept if it is the best so far (higher
        tau, the greedy acceptance drafting earns; then lower loss). With the user's requests
        (--prompts) their held-out answers' tau decides first: the rest of the held-out text is
        default text, which heads started from --init may have trained on, so its tau favours
        the start over what the run learns."""
        self.history.append(entry)
        best = self.best_entry
        if best is None or _rank(entry) > _rank(best):
            self.best_entry = entry
            self.best = {n: t.detach().clone() for n, t in head.state_dict().items()}
