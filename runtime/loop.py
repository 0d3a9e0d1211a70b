"""The speculative decoding loop: prefill, then repeat {draft k, verify k+1 in one call, accept}.

Plain decoding is the same loop with no drafter (every verify call carries one token), so plain
and speculative output go through exactly the same code and can be compared token for token.

Invariant between steps: `context` holds every token so far; the target's cache holds all of
them but the last, which is fed (with the drafts behind it) at position `pos` by the next call.
A call may start from a cache that already holds the prompt's first tokens (the previous turn of
a conversation): only the rest is prefilled.

`decode` yields each step's tokens as they are verified (streaming without threads: closing it
stops generation at once); `generate` runs it to the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from mtp_edge.errors import ContextFull, UserError
from mtp_edge.runtime.drafters import Draft, Drafter
from mtp_edge.runtime.fallback import Fallback, session_costs
from mtp_edge.runtime.sampling import (
    Sampler,
    SamplingParams,
    accept_greedy,
    accept_sampling,
    top2_gaps,
)
from mtp_edge.runtime.session import Session, prefill


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    k: int = 4  # most tokens drafted per step
    adaptive_k: bool = False  # grow k by 2 after a fully accepted step, shrink by 1 otherwise
    # Draft per step only as many tokens (0..k) as measured acceptance and costs say pay
    # (runtime/fallback.py). True: always; None: when greedy (its choices follow timings, so
    # sampling with it gives other samples from run to run for one seed, each as the target
    # would draw); False (here, so that measurements of a drafter see all its drafts): never.
    fallback: bool | None = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.k < 0:
            raise UserError(f"--k must be >= 0, got {self.k}")


def tau_of(step_tokens: int, verify_steps: int) -> float:
    """Tokens per verify step: what the steps gave (`step_tokens`: the accepted drafts and each
    step's own token, an eos that ended generation included) over the steps. Every step gives
    at least its own token, so tau >= 1; plain decoding is 1.0, and so is a run with no step.
    The one formula for a run, a suite (sums over its runs) and every report of either."""
    return step_tokens / verify_steps if verify_steps else 1.0


@dataclass
class GenerationStats:
    generated_tokens: int = 0
    verify_steps: int = 0  # target calls after prefill
    # tokens the verify steps gave: the emitted ones plus the eos that ended generation, if a
    # step gave it (an eos is not emitted, but its step counts: without it plain tau < 1)
    step_tokens: int = 0
    drafted_tokens: int = 0
    drafted_steps: int = 0  # verify steps that carried at least one drafted token
    fallback_steps: int = 0  # steps the fallback drafted nothing for, as drafting did not pay
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # steps that kept draft i
    drafted_per_position: list[int] = field(default_factory=list)  # steps that drafted i
    ttft_ms: float = 0.0
    decode_seconds: float = 0.0  # everything after the first token
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def decoded_tokens(self) -> int:
        """Tokens after the first (which prefill gives); 0 when nothing was generated."""
        return max(self.generated_tokens - 1, 0)

    @property
    def tau(self) -> float:
        """Tokens per verify step, the bonus token included (1.0 for plain decoding)."""
        return tau_of(self.step_tokens, self.verify_steps)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens,
            "verify_steps": self.verify_steps,
            "step_tokens": self.step_tokens,
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "ttft_ms": round(self.ttft_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "accepted_per_position": self.accepted_per_position,
            "drafted_per_position": self.drafted_per_position,
            "drafted_tokens": self.drafted_tokens,
            "drafted_steps": self.drafted_steps,
            "fallback_steps": self.fallback_steps,
            "accepted_tokens": self.accepted_tokens,
            "draft_ms": round(self.draft_seconds * 1e3, 3),
            "verify_ms": round(self.verify_seconds * 1e3, 3),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens; an eos token that stopped generation is left out
    stop_reason: str  # eos | stop_string | max_tokens | context_full
    stats: GenerationStats
    # For each generated token, the gap between the target's two best logits where it was
    # chosen: where greedy speculative and plain output differ, this shows whether the first
    # difference is a numerical near-tie.
    top2_gaps: list[float] = field(default_factory=list)


@dataclass
class Step:
    """What one target call added, as `decode` yields it."""

    tokens: list[int]  # emitted: an eos token, and what follows an eos or a stop, left out
    top2_gaps: list[float]  # for each emitted token, its target's best-minus-second logit
    cache_len: int  # the target's cache holds the K/V of the context's first cache_len tokens
    stop_reason: str | None  # set on the last step: eos | stop_string | max_tokens | context_full
    stats: GenerationStats  # the run's stats so far (one object, updated in place)


def check_prompt(prompt: list[int], max_seq_len: int) -> None:
    """The one check of a prompt's tokens: at least one, and fewer than the context holds (the
    first generated token needs a slot). `decode` runs it; a caller that wants the error at call
    time rather than at the first step (the API's streams) runs it first."""
    if not prompt:
        raise UserError("the prompt is empty: give at least one token of text")
    if len(prompt) >= max_seq_len:
        raise ContextFull(
            f"the prompt has {len(prompt)} tokens but the context holds {max_seq_len}: "
            "shorten the prompt, or give a longer context (a model: --max-seq-len N; a bundle's "
            "is fixed when it is made: export it again with mtp-export --max-seq-len N)"
        )


def decode(
    target: Session,
    prompt: list[int],
    drafter: Drafter | None,
    config: GenerationConfig,
    detokenize: Callable[[list[int]], str] | None = None,
    cached: int = 0,
) -> Iterator[Step]:
    """Generate from `prompt` with `target`, drafting with `drafter` (None: plain decoding),
    yielding each step's tokens as soon as they are verified.

    `cached`: the target's cache already holds the K/V of prompt[:cached] (a previous call's
    context), so prefill starts there; at least the last prompt token is always fed, for its
    logits. Closing the iterator stops at once; every step says how much of the cache is valid.
    `detokenize` is needed for stop strings.
    """
    check_prompt(prompt, target.max_seq_len)
    if not 0 <= cached < len(prompt):
        raise ValueError(f"cached must be in 0..{len(prompt) - 1}, got {cached}")
    if config.stop_strings and detokenize is None:
        raise ValueError("stop strings need a detokenize function")
    sampler = Sampler(config.sampling)
    wants_hidden = drafter is not None and drafter.needs_hidden
    k_max = config.k if drafter is not None else 0
    k_now = k_max
    fallback = None
    use_fallback = sampler.greedy if config.fallback is None else config.fallback
    if drafter is not None and use_fallback and k_max > 0:
        source_of = getattr(drafter, "source", lambda context: drafter.name)
        fallback = Fallback(k_max, session_costs(target), source_of)
    stats = GenerationStats(accepted_per_position=[0] * k_max, drafted_per_position=[0] * k_max)
    generated: list[int] = []

    def emit(new_tokens: list[int], logits: torch.Tensor, pos: int) -> Step:
        """Keep tokens one by one, exactly as plain decoding would, up to a stop."""
        gaps_of = top2_gaps(logits)
        kept, gaps, stop = [], [], None
        for i, token in enumerate(new_tokens):
            if token in config.eos_ids:
                stop = "eos"
                break
            generated.append(token)
            kept.append(token)
            gaps.append(gaps_of[i])
            if config.stop_strings:
                tail = detokenize(generated[-64:])
                if any(s in tail for s in config.stop_strings):
                    stop = "stop_string"
                    break
            if len(generated) >= config.max_new_tokens:
                stop = "max_tokens"
                break
        stats.generated_tokens = len(generated)
        return Step(kept, gaps, pos, stop, stats)

    # Prefill what the cache lacks; the last logits give the first token.
    start = time.perf_counter()
    out = prefill(target, prompt[cached:], cached, return_hidden=wants_hidden)
    logits, hidden = out.logits, out.hidden
    first = sampler.pick(logits[-1], len(prompt) - 1)
    stats.ttft_ms = (time.perf_counter() - start) * 1e3
    context = prompt + [first]
    pos = len(prompt)
    step = emit([first], logits[-1:], pos)
    try:
        yield step
        while step.stop_reason is None:
            step_start = time.perf_counter()
            room = target.max_seq_len - pos  # free slots: the pending token plus any drafts
            if room < 1:
                yield Step([], [], pos, "context_full", stats)
                break
            k = min(k_now, room - 1, config.max_new_tokens - len(generated) - 1)
            requested, shadow = k, False
            if fallback is not None:
                requested, shadow = fallback.plan(k, context)
                stats.fallback_steps += k > 0 and requested == 0
                if shadow:  # drafted to learn whether drafting pays again, never verified
                    requested = k

            draft = (
                drafter.propose(context, hidden, requested, sampler)
                if drafter is not None
                else Draft([])
            )
            if shadow:
                fallback.start_shadow(draft.tokens[:k], len(context))
                draft = Draft([])
            draft_tokens = draft.tokens[:requested]
            t1 = time.perf_counter()
            out = target.forward([context[-1]] + draft_tokens, pos, return_hidden=wants_hidden)
            if sampler.greedy:
                n, next_token = accept_greedy(out.logits, draft_tokens, pos)
            else:
                probs = None if draft.probs is None else draft.probs[: len(draft_tokens)]
                n, next_token = accept_sampling(out.logits, draft_tokens, probs, sampler, pos)
            t2 = time.perf_counter()

            stats.draft_seconds += t1 - step_start
            stats.verify_seconds += t2 - t1
            stats.verify_steps += 1
            stats.drafted_tokens += len(draft_tokens)
            stats.drafted_steps += bool(draft_tokens)
            stats.accepted_tokens += n
            for i in range(len(draft_tokens)):
                stats.drafted_per_position[i] += 1
                stats.accepted_per_position[i] += i < n
            if config.adaptive_k and draft_tokens:
                k_now = min(k_max, k_now + 2) if n == len(draft_tokens) else max(1, k_now - 1)

            new_tokens = draft_tokens[:n] + [next_token]
            context += new_tokens
            if fallback is not None:
                fallback.record_step(requested, len(draft_tokens), n, t1 - step_start, t2 - t1)
                fallback.check_shadow(context)
            pos += n + 1
            hidden = None if out.hidden is None else out.hidden[: n + 1]
            step = emit(new_tokens, out.logits[: n + 1], pos)
            stats.step_tokens += len(step.tokens) + (step.stop_reason == "eos")
            stats.decode_seconds += time.perf_counter() - step_start
            yield step
    except GeneratorExit:
        pass  # closed early: the last step said what the cache holds
    if drafter is not None:  # a drafter that keeps state takes in the last verified rows
        drafter.observe(context, hidden)


def generate(
    target: Session,
    prompt: list[int],
    drafter: Drafter | None,
    config: GenerationConfig,
    detokenize: Callable[[list[int]], str] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    cached: int = 0,
) -> GenerationResult:
    """`decode` to the end; `on_tokens` receives each step's tokens as they are emitted."""
    tokens: list[int] = []
    gaps: list[float] = []
    for step in decode(target, prompt, drafter, config, detokenize, cached):
        tokens += step.tokens
        gaps += step.top2_gaps
        if on_tokens is not None and step.tokens:
            on_tokens(step.tokens)
    return GenerationResult(tokens, step.stop_reason, step.stats, gaps)


def first_divergence(plain: list[int], spec: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None if identical)."""
    for i, (a, b) in enumerate(zip(plain, spec, strict=False)):
        if a != b:
            return i
    return None if len(plain) == len(spec) else min(len(plain), len(spec))
