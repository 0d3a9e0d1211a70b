"""Online fallback: each step drafts the number of tokens that pays best, none when none pays.

A step that drafts k' tokens emits E(k') = 1 + sum_{i<=k'} prod_{j<=i} a_j tokens on average
(a_j: the chance that draft position j is accepted once the ones before it were) and costs
C(k') = verify(k'+1) + k' * draft, where verify(1) is a plain decoding step. Both sides move with
the prompt (a drafter that helps on code may not on questions) and with the machine (a verify of
five tokens costs 1.0-1.5 decodes depending on backend, model and load), so both are measured
while generating: acceptance per position as an exponentially weighted average of the steps just
verified, costs from the loop's own timings of its calls (per width, the median of the last
few). Each step takes the k' in 0..k with the most tokens per second; k' = 0 is plain decoding.

While it does not draft, the controller still learns whether drafting would pay again: a
"shadow" draft is proposed and never verified, only compared with the tokens the target then
emits. Where a draft costs next to nothing (prompt lookup) every plain step shadows; for a model
drafter shadows come at growing intervals. (When sampling, a shadow token counts as accepted
only if it is the token drawn, which understates acceptance: resuming is then slower.) Only how
many tokens are drafted changes, never how the target's tokens are chosen: greedy output stays
exactly what it is without the fallback, sampled output keeps the target's distribution.

A drafter that combines sources (mtp+ngram: the lookup where the context repeats, the model
elsewhere) says which one will draft (`source(context)`): each source has its own acceptance and
draft cost, so that free, often right lookups still draft where the model's drafts do not pay.

Costs belong to the session (the backend, the model, the machine), so they are kept per session
across generations; acceptance belongs to the text, so each generation starts from a prior.
"""

from __future__ import annotations

import statistics
import weakref
from collections import deque
from collections.abc import Callable

ACCEPTANCE_WEIGHT = 0.15  # weight of the newest step in the acceptance averages
COST_WEIGHT = 0.2  # weight of the newest timing in the draft cost averages
RECENT_CALLS = 7  # a width's cost: the median of its last calls (a stalled call moves nothing)
TRUSTED_CALLS = 3  # calls of a width before their median is taken as it stands
PRIOR_ACCEPTANCE = 0.5  # the first position's, before a generation's first verified draft
PRIOR_VERIFY_SLOPE = 0.1  # verify(T) ~ verify(1) * (1 + slope (T - 1)) until T is measured
OUTLIER = 3.0  # a draft timing above this multiple of its average counts as this multiple
CHEAP_SHADOW = 0.02  # shadow every plain step when a k-token draft costs under 2% of a decode
FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 2, 8  # plain steps between shadows of a model drafter
REMEASURE_PLAIN_AFTER = 100  # drafted steps after which one plain step refreshes verify(1)


class StepCosts:
    """Seconds per target call of each width, and per requested draft token, as measured."""

    def __init__(self):
        self.verify: dict[int, deque] = {}  # width -> seconds of its last calls
        self.measured: dict[int, float] = {}  # width -> their median
        self.draft: dict[str, float] = {}  # draft source -> seconds per requested token
        self.steps_since_plain = 0  # drafted steps since the last measured plain step

    def record_verify(self, width: int, seconds: float) -> None:
        calls = self.verify.setdefault(width, deque(maxlen=RECENT_CALLS))
        calls.append(seconds)
        self.measured[width] = statistics.median(calls)
        self.steps_since_plain = 0 if width == 1 else self.steps_since_plain + 1

    def record_draft(self, source: str, requested: int, seconds: float) -> None:
        per_token, old = seconds / requested, self.draft.get(source)
        self.draft[source] = per_token if old is None else _average_time(old, per_token)

    def verify_seconds(self, width: int) -> float | None:
        """The median of the width's recent calls once there are TRUSTED_CALLS of them; else
        what the trusted widths say (interpolated, or scaled by the prior slope) where that is
        lower, since one or two calls may be a warm-up or a stall; never above a trusted wider
        call's. None before any call was measured."""
        calls = self.verify.get(width, ())
        if len(calls) >= TRUSTED_CALLS:
            return self.measured[width]
        trusted = {w: m for w, m in self.measured.items() if len(self.verify[w]) >= TRUSTED_CALLS}
        estimate = _from_neighbours(trusted or self.measured, width)
        if calls:
            estimate = (
                self.measured[width] if estimate is None else min(estimate, self.measured[width])
            )
        wider = [m for w, m in trusted.items() if w > width]
        return None if estimate is None else min([estimate, *wider])


def _from_neighbours(measured: dict[int, float], width: int) -> float | None:
    """A width's cost from other widths': interpolated, or scaled by the prior slope."""
    below = [w for w in measured if w < width]
    above = [w for w in measured if w > width]
    if below and above:
        lo, hi = max(below), min(above)
        share = (width - lo) / (hi - lo)
        return measured[lo] + share * (measured[hi] - measured[lo])
    if below or above:
        near = max(below) if below else min(above)
        return measured[near] * _prior_ratio(width) / _prior_ratio(near)
    return None


def _prior_ratio(width: int) -> float:
    return 1 + PRIOR_VERIFY_SLOPE * (width - 1)


def _average(old: float, new: float, weight: float) -> float:
    return old + weight * (new - old)


def _average_time(old: float, new: float) -> float:
    """A timing's average; a stall (another process took the core) counts as OUTLIER x."""
    return _average(old, min(new, OUTLIER * old) if old > 0 else new, COST_WEIGHT)


_costs_by_session: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def session_costs(session) -> StepCosts:
    """The costs measured on `session` so far (kept as long as the session lives)."""
    try:
        return _costs_by_session.setdefault(session, StepCosts())
    except TypeError:  # a session that cannot be weakly referenced learns per generation
        return StepCosts()


class Fallback:
    """Chooses each step's draft length from measured acceptance and costs (module docstring).

    The loop asks `plan(k, context)` before drafting, reports each step with `record_step`, and
    hands every context it extends to `check_shadow`. `source_of(context)` names the drafter's
    source that will draft next (one name for a drafter with one source).
    """

    def __init__(self, k_max: int, costs: StepCosts, source_of: Callable[[list[int]], str]):
        self.k_max, self.costs, self.source_of = k_max, costs, source_of
        # per source and draft position; None until seen, then read as the position before it
        self.observed: dict[str, list[float | None]] = {}
        self.source = ""  # the current step's
        self.shadow: list[int] = []  # a draft proposed but not verified
        self.shadow_source = ""
        self.shadow_start = 0  # index in the context where the shadow draft's first token goes
        self.shadow_checked = 0
        self.probe_interval = FIRST_PROBE_INTERVAL
        self.plain_since_shadow = 0

    def acceptance(self, source: str) -> list[float]:
        """Per position, the chance a draft token is kept once the ones before it were; a
        position not seen yet in this generation is taken to be like the one before it."""
        out, last = [], PRIOR_ACCEPTANCE
        for a in self.observed.get(source, [None] * self.k_max):
            last = last if a is None else a
            out.append(last)
        return out

    def best_k(self, k: int, source: str) -> int:
        """The draft length n in 0..k with the most expected tokens per second: a step
        emits 1 + sum_{i<=n} prod_{j<=i} a_j tokens and costs verify(n + 1) + n draft steps."""
        verify = [self.costs.verify_seconds(n + 1) for n in range(k + 1)]
        if verify[0] is None:
            return 0  # measure a plain step first: everything else is judged against it
        draft = self.costs.draft.get(source, 0.0)
        best, best_rate, tokens, reach = 0, 1.0 / verify[0], 1.0, 1.0
        for n, a in enumerate(self.acceptance(source)[:k], start=1):
            reach *= a
            tokens += reach
            rate = tokens / (verify[n] + n * draft)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def plan(self, k: int, context: list[int]) -> tuple[int, bool]:
        """(tokens to draft and verify, whether to draft k more as a shadow only) for a step
        that may draft up to k."""
        if k <= 0:
            return 0, False
        self.source = self.source_of(context)
        if self.costs.steps_since_plain >= REMEASURE_PLAIN_AFTER:
            return 0, self._wants_shadow(k)
        best = self.best_k(k, self.source)
        if best > 0:
            self.probe_interval = FIRST_PROBE_INTERVAL
            return best, False
        return 0, self._wants_shadow(k)

    def _wants_shadow(self, k: int) -> bool:
        if self.shadow:
            return False  # one at a time: the pending one is still being compared
        v1, draft = self.costs.verify_seconds(1), self.costs.draft.get(self.source)
        if draft is None or v1 is None or k * draft <= CHEAP_SHADOW * v1:
            return True
        self.plain_since_shadow += 1
        if self.plain_since_shadow < self.probe_interval:
            return False
        self.plain_since_shadow = 0
        self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        return True

    def record_step(
        self,
        requested: int,
        drafted: int,
        accepted: int,
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        """A verified step: `requested` tokens asked of the drafter (a shadow's included),
        `drafted` of them verified, `accepted` kept."""
        if requested > 0:
            self.costs.record_draft(self.source, requested, draft_seconds)
        self.costs.record_verify(drafted + 1, verify_seconds)
        for i in range(min(accepted + 1, drafted)):
            self._observe(self.source, i, i < accepted)

    def start_shadow(self, tokens: list[int], start: int) -> None:
        """A draft for the context's indices start.. that the target will not verify."""
        self.shadow, self.shadow_start, self.shadow_checked = list(tokens), start, 0
        self.shadow_source = self.source

    def check_shadow(self, context: list[int]) -> None:
        """Compare the pending shadow draft with the tokens the target has emitted since."""
        while self.shadow and self.shadow_checked < len(self.shadow):
            index = self.shadow_start + self.shadow_checked
            if index >= len(context):
                return
            hit = context[index] == self.shadow[self.shadow_checked]
            self._observe(self.shadow_source, self.shadow_checked, hit)
            self.shadow_checked += 1
            if not hit:
                break
        self.shadow = []

    def _observe(self, source: str, position: int, accepted: bool) -> None:
        if position < self.k_max:
            estimate = self.acceptance(source)[position]
            observed = self.observed.setdefault(source, [None] * self.k_max)
            observed[position] = _average(estimate, float(accepted), ACCEPTANCE_WEIGHT)
