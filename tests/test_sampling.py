"""Speculative sampling preserves the target's distribution (and a broken residual is caught)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from tiny import chi_square_pvalue, tiny_model

from mtp_edge.errors import UserError
from mtp_edge.runtime import sampling
from mtp_edge.runtime.drafters import DraftModelDrafter
from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.sampling import Sampler, SamplingParams
from mtp_edge.runtime.session import EagerSession

VOCAB = 4
NEW = 4  # the first token comes from prefill, the next two from drafts, the last is a bonus
PROMPT = [1, 2, 3]
# 81 possible outcomes (top-k 3, 4 tokens): 92 expected samples in the rarest, 137 in the
# median one, none pooled; a bias the size of a missing residual's is caught with a sixth.
SAMPLES = 12_000
# The broken rule below is caught at p ~ 1e-101 with these 2,000 seeds (1e-239 with 4,000):
# far past the 1e-6 it must reach, where the 12,000 of the check itself would cost 6x more.
BROKEN_SAMPLES = 2_000
PARAMS = dict(temperature=0.9, top_k=3)


def exact_distribution(target: EagerSession, params: SamplingParams) -> dict:
    """P(t1..t4 | prompt) under the target alone, by enumerating every sequence."""
    sampler = Sampler(params)
    dist = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        logits = target.forward(PROMPT + list(seq[:-1]), 0).logits[len(PROMPT) - 1 :]
        probs = sampler.probs(logits)
        dist[seq] = float(torch.prod(probs[torch.arange(NEW), torch.tensor(seq)]))
    return dist


def speculative_counts(target: EagerSession, drafter_model, samples: int = SAMPLES) -> Counter:
    drafter = DraftModelDrafter(EagerSession(drafter_model, 32))
    counts = Counter()
    for seed in range(samples):
        config = GenerationConfig(
            max_new_tokens=NEW, k=2, sampling=SamplingParams(seed=seed, **PARAMS)
        )
        counts[tuple(generate(target, PROMPT, drafter, config).token_ids)] += 1
    return counts


@pytest.fixture(scope="module")
def models():
    target = EagerSession(tiny_model(seed=11, vocab=VOCAB, hidden_size=16, num_layers=1), 32)
    drafter = tiny_model(seed=12, vocab=VOCAB, hidden_size=16, num_layers=1)
    return target, drafter


def test_speculative_samples_follow_the_target_distribution(models):
    target, drafter = models
    dist = exact_distribution(target, SamplingParams(**PARAMS))
    counts = speculative_counts(target, drafter)
    assert sum(counts.values()) == SAMPLES
    assert chi_square_pvalue(counts, dist, SAMPLES) > 1e-3


def test_the_check_catches_a_missing_residual(models, monkeypatch):
    """Resampling from p instead of norm(max(p - q, 0)) after a rejection biases the output."""
    target, drafter = models
    dist = exact_distribution(target, SamplingParams(**PARAMS))
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts = speculative_counts(target, drafter, BROKEN_SAMPLES)
    assert chi_square_pvalue(counts, dist, BROKEN_SAMPLES) < 1e-6


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = Sampler(SamplingParams(temperature=1.0, top_k=2)).probs(logits)
    assert (p[2:] == 0).all() and torch.isclose(p[:2].sum(), torch.tensor(1.0, dtype=p.dtype))
    full = torch.softmax(logits.double(), -1)
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.7)).probs(logits)
    # keep the smallest prefix of the sorted tokens whose mass reaches 0.7
    keep = int((torch.cumsum(full, 0) < 0.7).sum()) + 1
    assert (p[keep:] == 0).all() and (p[:keep] > 0).all()
    torch.testing.assert_close(p[:keep], full[:keep] / full[:keep].sum())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "--temperature"),
        (dict(top_k=-1), "--top-k"),
        (dict(top_p=0.0), "--top-p"),
        (dict(top_p=1.5), "--top-p"),
        (dict(temperature=float("nan")), "--temperature"),
    ],
)
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingParams(**kwargs)


def test_adapting_mtp_drafts_keep_the_target_distribution(models):
    """An MTP drafter whose correction learns and changes during the run (runtime/adapt.py):
    every sample is still drawn as the target alone would draw it."""
    from mtp_edge.mtp import MTPConfig, MTPHead
    from mtp_edge.runtime.adapt import adapting
    from mtp_edge.runtime.mtp_drafter import mtp_drafter

    target, _ = models
    torch.manual_seed(13)
    head = MTPHead(MTPConfig(16, 32, VOCAB, VOCAB)).to(torch.float64).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    drafter, adapter = adapting(mtp_drafter(head, target.model), head, "test")
    dist = exact_distribution(target, SamplingParams(**PARAMS))
    counts = Counter()
    samples = 3000  # fewer than the other checks': each draft step runs the head eagerly
    for seed in range(samples):
        config = GenerationConfig(
            max_new_tokens=NEW, k=2, sampling=SamplingParams(seed=seed, **PARAMS)
        )
        counts[tuple(generate(target, PROMPT, drafter, config).token_ids)] += 1
        if seed % 500 == 499:  # learn, then exaggerate: the drafts move far from the head's
            for _ in range(5):
                adapter.train_step()
            with torch.no_grad():
                adapter.u *= 4.0
            adapter.refresh()
    assert adapter.buffer.added > samples  # drafted and verified all along
    assert chi_square_pvalue(counts, dist, samples) > 1e-3


def test_numpy_maxima_and_gaps_are_torchs():
    """row_maxima and top2_gaps (NumPy, the loop's hot path) give torch's max and topk: the
    first of equal maxima, a gap of 0 on a tie, and a NaN row's NaN for check_logits."""
    from mtp_edge.runtime.sampling import row_maxima, top2_gaps

    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[1, 3] = logits[1, 7] = 50.0  # a tie: index 3, gap 0
    logits[2, 999] = 60.0  # the last index
    values, indices = row_maxima(logits)
    want_values, want_indices = torch.max(logits, dim=-1)
    assert indices == want_indices.tolist() and values == want_values.tolist()
    top = torch.topk(logits, 2, dim=-1).values
    assert top2_gaps(logits) == [float(a - b) for a, b in top]
    assert top2_gaps(logits)[1] == 0.0
    nan = torch.tensor([[1.0, float("nan"), 2.0]])
    assert math.isnan(row_maxima(nan)[0][0])
    assert row_maxima(logits[0]) == ([values[0]], [indices[0]])  # one row, 1-D
