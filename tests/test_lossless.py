"""Greedy speculative output equals plain greedy output, token for token.

Exact in float64 (rounding differences between a (k+1)-token verify and single-token steps are
far below any logit gap there); in float32 a difference is allowed only at a demonstrated
near-tie of the target's two best logits.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import tiny_model

from mtp_edge.runtime.drafters import Draft, DraftModelDrafter, HybridDrafter, NgramDrafter
from mtp_edge.runtime.loop import GenerationConfig, first_divergence, generate
from mtp_edge.runtime.session import EagerSession

VOCAB = 48


@functools.cache
def model(seed: int, dtype=torch.float64):
    return tiny_model(seed=seed, vocab=VOCAB, dtype=dtype)


def session(seed: int, max_seq_len: int = 160, chunk: int = 16, dtype=torch.float64):
    """A session over a cached model: never use two of the same seed at once (shared cache)."""
    return EagerSession(model(seed, dtype), max_seq_len=max_seq_len, max_chunk=chunk)


class NoisyOracleDrafter:
    """Proposes the target's own greedy continuation with some tokens corrupted: exercises full,
    partial and zero acceptance at every draft position."""

    name = "noisy-oracle"
    needs_hidden = False

    def __init__(self, model_seed: int, error_rate: float, seed: int, dtype=torch.float64):
        # Its own copy of the weights: sharing the target's module would share its KV cache.
        self.oracle = EagerSession(tiny_model(seed=model_seed, vocab=VOCAB, dtype=dtype), 160)
        self.error_rate = error_rate
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, context, hidden, k, sampler):
        k = min(k, self.oracle.max_seq_len - len(context))
        tokens = list(context)
        out = []
        for _ in range(k):
            logits = self.oracle.forward(tokens, 0).logits[-1]  # full recompute: stateless
            token = int(torch.argmax(logits))
            if float(torch.rand((), generator=self.rng)) < self.error_rate:
                token = (token + 1) % VOCAB
            out.append(token)
            tokens.append(token)
        return Draft(out)

    def observe(self, context, hidden):
        pass


def make_drafter(kind: str, seed: int, error_rate: float):
    if kind == "ngram":
        return NgramDrafter(max_n=1 + seed % 3, min_n=1)
    if kind == "draft-lm-other":
        return DraftModelDrafter(session(seed + 1, chunk=5))
    if kind == "draft-lm-self":  # same weights: accepts everything, exercises the bonus path
        return DraftModelDrafter(EagerSession(tiny_model(seed=seed, vocab=VOCAB), 160, 8))
    if kind == "hybrid":  # lookup where the context repeats, the noisy oracle elsewhere
        return HybridDrafter(NoisyOracleDrafter(seed, error_rate, seed), 3, 1 + seed % 2)
    return NoisyOracleDrafter(seed, error_rate, seed)


# Prompts with repeats, so that the n-gram drafter finds matches.
prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12).flatmap(
    lambda base: st.lists(st.sampled_from(base), min_size=1, max_size=40)
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2),
    prompt=prompts,
    k=st.integers(1, 6),
    kind=st.sampled_from(["ngram", "draft-lm-other", "draft-lm-self", "noisy-oracle", "hybrid"]),
    error_rate=st.sampled_from([0.0, 0.2, 0.6]),
    max_new=st.integers(1, 40),
    adaptive=st.booleans(),
    eos=st.sampled_from([(), (3,), (5, 7)]),
    max_seq_len=st.sampled_from([60, 160]),
)
def test_greedy_speculative_equals_plain_float64(
    seed, prompt, k, kind, error_rate, max_new, adaptive, eos, max_seq_len
):
    if len(prompt) >= max_seq_len:
        prompt = prompt[: max_seq_len - 1]
    target = session(seed, max_seq_len)
    config = GenerationConfig(max_new_tokens=max_new, k=k, adaptive_k=adaptive, eos_ids=eos)
    plain = generate(target, prompt, None, config)
    drafter = make_drafter(kind, seed, error_rate)
    spec = generate(target, prompt, drafter, config)
    assert spec.token_ids == plain.token_ids
    assert spec.stop_reason == plain.stop_reason
    assert spec.stats.verify_steps <= plain.stats.verify_steps


def test_context_full_stops_cleanly():
    target = session(0, max_seq_len=24)
    prompt = list(range(20))
    config = GenerationConfig(max_new_tokens=100, k=4)
    plain = generate(target, prompt, None, config)
    spec = generate(target, prompt, NoisyOracleDrafter(0, 0.0, 0), config)
    assert plain.stop_reason == spec.stop_reason == "context_full"
    # The prompt fills 20 slots; 4 more tokens fit, plus the last one, which needs no slot.
    assert len(plain.token_ids) == len(spec.token_ids) == 5
    assert spec.token_ids == plain.token_ids


def test_stop_strings_and_eos_cut_at_the_same_token():
    target = session(1)
    prompt = [1, 2, 3, 4]
    free = generate(target, prompt, None, GenerationConfig(max_new_tokens=30))
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV"

    def detok(ids):
        return "".join(letters[i] for i in ids)

    stop = detok(free.token_ids[5:7])
    config = GenerationConfig(max_new_tokens=30, k=5, stop_strings=(stop,))
    plain = generate(target, prompt, None, config, detok)
    oracle = NoisyOracleDrafter(1, 0.0, 0)
    spec = generate(target, prompt, oracle, config, detok)
    assert plain.stop_reason == spec.stop_reason == "stop_string"
    assert spec.token_ids == plain.token_ids
    assert stop in detok(plain.token_ids) and stop not in detok(plain.token_ids[:-1])

    eos = free.token_ids[8]
    config = GenerationConfig(max_new_tokens=30, k=5, eos_ids=(eos,))
    spec = generate(target, prompt, oracle, config)
    assert spec.stop_reason == "eos"
    assert spec.token_ids == free.token_ids[: free.token_ids.index(eos)]


def test_rollback_by_overwrite_gives_fresh_logits():
    """Verify after a rejected draft: the stale slots are overwritten, results equal a fresh run."""
    m = tiny_model(seed=4, vocab=VOCAB)
    target = EagerSession(m, 64)
    prompt = [5, 9, 2, 7, 7, 1]
    target.forward(prompt, 0)
    target.forward([3, 11, 12, 13, 14], len(prompt))  # a draft that will be "rejected" after 3
    after = target.forward([30, 31, 32], len(prompt) + 2).logits  # re-verify from the rejection
    fresh = EagerSession(tiny_model(seed=4, vocab=VOCAB), 64)
    fresh.forward(prompt, 0)
    expected = fresh.forward([3, 11, 30, 31, 32], len(prompt)).logits[2:]
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-12)


def test_chunked_prefill_equals_one_call():
    m = tiny_model(seed=5, vocab=VOCAB)
    tokens = torch.randint(0, VOCAB, (37,)).tolist()
    whole = EagerSession(m, 64, max_chunk=64).forward(tokens, 0).logits[-1]
    from mtp_edge.runtime.session import prefill

    chunked = prefill(EagerSession(m, 64, max_chunk=5), tokens).logits[-1]
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_float32_divergence_only_at_near_tie(seed):
    """float32: verify(k+1) and single steps round differently; an output difference is only
    allowed where the plain run's two best logits are within 1e-4 of each other."""
    target = session(seed, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    config = GenerationConfig(max_new_tokens=60, k=4)
    plain = generate(target, prompt, None, config)
    oracle = NoisyOracleDrafter(seed, 0.3, seed, torch.float32)
    spec = generate(target, prompt, oracle, config)
    j = first_divergence(plain.token_ids, spec.token_ids)
    if j is not None:
        gap = plain.top2_gaps[j]
        assert gap < 1e-4, f"divergence at {j} with top-2 gap {gap}: not a near-tie"


def test_stats_are_consistent():
    target = session(0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    config = GenerationConfig(max_new_tokens=40, k=4)
    spec = generate(target, prompt, NoisyOracleDrafter(0, 0.3, 1), config)
    s = spec.stats
    assert s.generated_tokens == len(spec.token_ids) == 40
    assert s.accepted_tokens == sum(s.accepted_per_position)
    assert s.drafted_tokens == sum(s.drafted_per_position)
    assert 0 < s.acceptance_rate < 1
    # every verify step emits its accepted drafts plus one token (the last step may be cut short)
    assert s.generated_tokens - 1 <= s.accepted_tokens + s.verify_steps
    assert s.tau == pytest.approx((s.generated_tokens - 1) / s.verify_steps)
    assert all(a <= d for a, d in zip(s.accepted_per_position, s.drafted_per_position, strict=True))
    assert s.accepted_per_position == sorted(s.accepted_per_position, reverse=True)


def latest_continuation(context: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup by brute force: for n from max_n down, the latest earlier window equal to
    the context's last n tokens; what followed it."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        for start in range(len(context) - 1 - n, -1, -1):
            if context[start : start + n] == context[-n:]:
                return context[start + n : start + n + k]
    return []


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    moves=st.lists(
        st.tuples(
            st.sampled_from(["extend", "extend", "extend", "rewind", "restart"]),
            st.lists(st.integers(0, 5), min_size=1, max_size=4),
            st.integers(1, 5),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_the_lookup_index_finds_what_a_full_search_finds(sizes, moves):
    """The n-gram drafter keeps an index it extends call by call; whatever the loop does to the
    context between calls (extend it, rewind it, start anew), it proposes exactly what searching
    the whole context would."""
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    drafter, context = NgramDrafter(max_n=max_n, min_n=min_n), [1]
    for move, tokens, k in moves:
        if move == "extend":
            context = context + tokens
        elif move == "rewind":
            context = context[: max(1, len(context) - len(tokens))] + tokens[:1]
        else:
            context = list(tokens)
        expected = latest_continuation(context, k, max_n, min_n)
        assert drafter.propose(context, None, k, None).tokens == expected
