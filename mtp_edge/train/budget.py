"""`mtp-train --minutes N`: one wall-clock budget for writing, labelling and training.

The split: the heads learn the target, not their text, only when the text is large next to
what training draws from it (heads drawing ~10 times on 76k tokens memorised them; v4 drawing
1.3 times on 590k did not). So the budget buys text and the steps that read it together. Every
written token costs the time to write it, to label it (with its share of the prompt) and to be
drawn PASSES_PER_ORIGIN times by training; the text already there (offline text, text reused
from the cache) costs only the last two. Writing goes on while it pays:

    T = (time left - evaluation reserve - cost of the text already there)
        / (1/write + f/label + P x step/B)

more tokens, that is T/write more seconds (write, label: tokens/s; f: labelled tokens per
written token; step: seconds per training step of B origins; P: PASSES_PER_ORIGIN), with
writing kept between MIN_WRITING_SHARE and MAX_WRITING_SHARE of the time. Labelling then gets
the same rule with write = infinity, a draft origin paying for the labelling of the text's
tokens per origin (prompts are labelled but not drafted from; counting a labelled token as an
origin left a third of a 0.5B run's written text unlabelled), and at most 1 -
MIN_TRAINING_SHARE of what is left;
training runs to the end of the budget less EVALUATION_SHARE, kept for held-out evaluations
and the report. Each stage stops on its own deadline. The rates are measured on this machine:
labelling and a training step on a short probe before writing (random tokens: their cost does
not depend on the content), writing on its own decoding steps (the plan is redone at each).

Under --resume, the seconds earlier runs spent per stage (recorded in <out>.ckpt.json) count
against the same budget: `--minutes 60` after 40 spent has 20 left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Times training draws each draft origin on average: v4 (1.3 passes) did not memorise, v6 (2.5)
# memorised a little while held-out acceptance still rose (benchmarks/README.md, "Heads
# training"); 2 sits between.
PASSES_PER_ORIGIN = 2.0
# Share of the budget kept for held-out evaluations, the final one and the report.
EVALUATION_SHARE = 0.08
# Bounds of the writing share of the time left, whatever the measured rates say: training needs
# time to learn anything, and writing needs time to make text that is the target's own.
MIN_WRITING_SHARE = 0.15
MAX_WRITING_SHARE = 0.6
# Training gets at least this share of what is left after labelling starts.
MIN_TRAINING_SHARE = 0.3
# Share of the writing time for answers to requests the target writes itself (Magpie-style),
# written before the template prompts' answers: such requests are costlier per token (most
# sampled turns are dropped) but are what makes heads draft for requests unlike the templates
# (benchmarks/README.md, "What the text is about").
SELF_WRITTEN_SHARE = 0.4
# Offline text (Python docs and sources: not the target's own words) is at most this share of
# the tokens the budget can label and train on: at --raw-tokens' 50k it took the whole of a
# 10-minute budget on a busy 2-core machine, leaving writing its minimum.
OFFLINE_SHARE = 0.2


class Budget:
    """Wall-clock seconds for a run, with the seconds earlier runs of it already spent (a
    resumed run), per stage. `clock` is injectable (tests)."""

    def __init__(
        self,
        minutes: float,
        spent: dict[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total_s = minutes * 60.0
        self.clock = clock
        self.began = clock()
        self.before = dict(spent or {})  # seconds per stage spent by earlier runs
        self.stages: dict[str, float] = {}  # this run's seconds per stage
        self._stage: tuple[str, float] | None = None
        # Measured rates (None until measured)
        self.write_tps: float | None = None
        self.label_tps: float | None = None
        self.step_s: float | None = None
        self.labelled_per_written = 1.5  # prompt tokens are labelled too; measured when writing
        # Response tokens written per kind of request (templates, self-written requests), and
        # the same from an earlier run whose writing had ended: a resumed run reads that back.
        self.written_text: list[int] = []
        self.frozen_text: list[int] | None = None
        self.after_batch: Callable[[], None] | None = None  # records the time spent so far
        self.offline_cap: int | None = None  # offline tokens taken (kept for a resumed run)
        # The share of the writing time the current kind of text may take (its deadline: that
        # share of the way from the start of writing to writing's own deadline).
        self.writing_share = 1.0

    def spent_s(self) -> float:
        return sum(self.before.values()) + self.clock() - self.began

    def left_s(self) -> float:
        return max(0.0, self.total_s - self.spent_s())

    def stage(self, name: str) -> None:
        """Charge the time from now on to stage `name` (until the next call)."""
        now = self.clock()
        if self._stage is not None:
            last, since = self._stage
            self.stages[last] = self.stages.get(last, 0.0) + now - since
        self._stage = (name, now)

    def spent_by_stage(self) -> dict[str, float]:
        """Seconds per stage, this run's and earlier runs' together (the current one so far)."""
        totals = dict(self.before)
        current = dict(self.stages)
        if self._stage is not None:
            name, since = self._stage
            current[name] = current.get(name, 0.0) + self.clock() - since
        for name, seconds in current.items():
            totals[name] = totals.get(name, 0.0) + seconds
        return {name: round(seconds, 1) for name, seconds in totals.items()}

    def deadline(self, seconds: float) -> float:
        """The clock reading `seconds` from now, no later than the end of the budget."""
        return self.clock() + min(seconds, self.left_s())

    def past(self, deadline: float) -> bool:
        return self.clock() >= deadline

    def _training_s_per_origin(self, batch_origins: int) -> float:
        return PASSES_PER_ORIGIN * (self.step_s or 0.0) / batch_origins

    def writing_seconds(self, batch_origins: int, text_tokens: int) -> float:
        """Seconds of writing still worth spending from now (the rule in the module docstring),
        given the draft origins already in the text (no more writing, but labelling and
        training); None while the writer's rate is unknown."""
        left = self.room_s()
        per_origin = self._training_s_per_origin(batch_origins)
        label_s = 1 / self.label_tps if self.label_tps else 0.0
        fixed = text_tokens * (label_s + per_origin)
        per_token = 1 / self.write_tps + self.labelled_per_written * label_s + per_origin
        return max(0.0, (left - fixed) / per_token) / self.write_tps

    def _labelling_share(self, batch_origins: int, tokens_per_origin: float = 1.0) -> float:
        if not self.label_tps:
            return 1 - MIN_TRAINING_SHARE
        label_s = tokens_per_origin / self.label_tps  # a draft origin's share of the labelling
        per_origin = label_s + self._training_s_per_origin(batch_origins)
        return min(1 - MIN_TRAINING_SHARE, label_s / per_origin)

    def labelling_seconds(self, batch_origins: int, tokens_per_origin: float = 1.0) -> float:
        """Seconds of labelling worth spending from now: the same rule with the text already
        there, each draft origin costing the labelling of `tokens_per_origin` tokens (a
        response's origins also pay for its prompt), and training's share kept."""
        return self.room_s() * self._labelling_share(batch_origins, tokens_per_origin)

    def labelling_stop(
        self, batch_origins: int, tokens_per_origin: float = 1.0
    ) -> Callable[[int], str | None]:
        """What labelling asks after each sequence, with the tokens it just labelled: None (go
        on) or the time left as text ("" once the deadline has passed). The deadline follows
        the labelling rate as it is measured (the probe's is a first guess)."""
        began, room, labelled = self.clock(), self.room_s(), [0]

        def stop(tokens: int) -> str | None:
            now = self.clock()
            labelled[0] += tokens
            if labelled[0] and now > began:
                self.label_tps = labelled[0] / (now - began)
            until = began + room * self._labelling_share(batch_origins, tokens_per_origin)
            return "" if now >= until else minutes_left(until, self.clock)

        return stop

    def end(self) -> float:
        """The clock reading at which the budget runs out."""
        return self.clock() + self.left_s()

    def room_s(self) -> float:
        """Seconds left for writing, labelling and training: the budget left less the
        evaluation reserve (EVALUATION_SHARE of the whole budget)."""
        if math.isinf(self.total_s):
            return math.inf
        return max(0.0, self.left_s() - self.total_s * EVALUATION_SHARE)

    def training_deadline(self) -> float:
        """Training stops here: the end of the budget less the evaluation reserve."""
        return self.clock() + self.room_s()

    def offline_tokens(self, batch_origins: int, wanted: int) -> int:
        """Offline tokens to take (of `wanted`): OFFLINE_SHARE of what the time left can
        label and train on; decided once per text."""
        if self.offline_cap is None:
            self.offline_cap = wanted
            if not math.isinf(self.total_s) and self.label_tps:
                per_token = 1 / self.label_tps + self._training_s_per_origin(batch_origins)
                affordable = self.room_s() / per_token
                self.offline_cap = min(wanted, int(OFFLINE_SHARE * affordable))
        return self.offline_cap

    # --- writing: re-planned as the writer's rate becomes known --------------------------

    def start_writing(self, batch_origins: int, text_tokens: int) -> None:
        """Writing begins, with `text_tokens` of text already there (offline text). Until the
        writer's rate is known it may take MAX_WRITING_SHARE of the time left."""
        self.stage("writing")
        self._batch_origins = batch_origins
        self.text_tokens = text_tokens  # draft origins the text holds so far
        self._written, self._writing_s, self._since = 0, 0.0, None
        self._writing_began = self.clock()
        self._writing_room = self.room_s()
        self.writing_until = self._writing_began + self._writing_room * MAX_WRITING_SHARE

    def _replan_writing(self) -> None:
        now = self.clock()
        planned = now - self._writing_began
        planned += self.writing_seconds(self._batch_origins, self.text_tokens)
        room = self._writing_room
        planned = min(MAX_WRITING_SHARE * room, max(MIN_WRITING_SHARE * room, planned))
        self.writing_until = self._writing_began + planned

    def writing_over(self) -> bool:
        return self.past(self.writing_deadline())

    def writing_deadline(self) -> float:
        """The clock reading at which writing the current kind of text stops."""
        if self.writing_share >= 1.0 or math.isinf(self.writing_until):
            return self.writing_until
        began = self._writing_began
        return began + self.writing_share * (self.writing_until - began)

    def writer_starts(self) -> None:
        """The writer starts a batch of generation (time outside generation is not its rate)."""
        self._since = self.clock()

    def wrote(self, tokens: int) -> bool:
        """The writer added `tokens` new tokens; returns whether writing is over."""
        now = self.clock()
        if self._since is not None:
            self._writing_s += now - self._since
        self._since = now
        self._written += tokens
        self.text_tokens += tokens
        if self._written and self._writing_s > 0:
            self.write_tps = self._written / self._writing_s
            self._replan_writing()
        return self.writing_over()

    def text_reused(self, tokens: int) -> None:
        """Tokens of text an earlier run wrote, reused from the cache (no writing time)."""
        self.text_tokens += tokens

    def wrote_batch(self, prompt_tokens: int, response_tokens: int) -> None:
        if response_tokens:
            self.labelled_per_written = (prompt_tokens + response_tokens) / response_tokens
        self._since = None
        if self.after_batch is not None:
            self.after_batch()

    def describe_plan(self) -> str:
        rates = []
        if self.write_tps:
            rates.append(f"writing {self.write_tps:.0f} tok/s")
        if self.label_tps:
            rates.append(f"labelling {self.label_tps:.0f} tok/s")
        if self.step_s:
            rates.append(f"a training step {self.step_s:.2f} s")
        return ", ".join(rates)


def minutes_left(deadline: float, clock: Callable[[], float]) -> str:
    """'m:ss left' until `deadline`, for progress lines ("" without one)."""
    if math.isinf(deadline):
        return ""
    seconds = max(0, round(deadline - clock()))
    return f"{seconds // 60}:{seconds % 60:02d} left"
