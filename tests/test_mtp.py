"""MTP heads: lossless drafting, training, DDP, heads files (one file: one fixture trains heads).

Drafting and training tests share the heads the module-scoped `trained` fixture trains once per
kind (minutes on two cores), so they stay in one module past 600 lines.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
from tiny import chi_square_pvalue, hf_reference, ours_from_hf, save_hf_dir, tiny_model

from mtp_edge.checkpoints import load_model
from mtp_edge.errors import UserError
from mtp_edge.mtp import (
    MTPConfig,
    MTPHead,
    carry_vocabulary,
    init_from_target,
    load_heads,
    save_heads,
    target_fingerprint,
)
from mtp_edge.runtime import sampling
from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.mtp_drafter import eager_step_fn, measure_step_cost, mtp_drafter
from mtp_edge.runtime.sampling import Sampler, SamplingParams
from mtp_edge.runtime.session import EagerSession
from mtp_edge.train import TrainOptions, generate_batch, train_heads

WORDS = "the cat sat on a mat and then the dog ran to the park while birds sang in trees".split()


def random_head(
    target, draft_ids: list[int], seed: int = 0, std: float = 0.3, attention: str = "none"
) -> MTPHead:
    from mtp_edge.mtp import cache_attention_config

    c = target.config
    extra = cache_attention_config(target, attention) if attention != "none" else {}
    config = MTPConfig(c.hidden_size, 2 * c.hidden_size, c.vocab_size, len(draft_ids), **extra)
    torch.manual_seed(seed)
    head = MTPHead(config).to(target.dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
    return init_from_target(head, target, torch.tensor(draft_ids)).eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny HF model directory and a text file of its vocabulary's words."""
    root = tmp_path_factory.mktemp("mtp")
    reference = hf_reference(
        "llama", hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    save_hf_dir(reference, root / "model")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(300))
    (root / "words.txt").write_text(text)
    return root


def options(root, **overrides) -> TrainOptions:
    values = dict(
        out=str(root / "heads.safetensors"),
        model=str(root / "model"),
        data=(str(root / "words.txt"),),
        steps=150,
        batch_size=64,
        seq_len=64,
        draft_vocab=48,
        lr=3e-3,
        warmup=10,
        eval_every=50,
        log_every=50,
        checkpoint_every=50,
    )
    values.update(overrides)
    return TrainOptions(**values)


@pytest.fixture(scope="module", params=["none", "target_cache", "self"])
def trained(tiny_dir, request):
    """Heads of each kind (mtp.py), the cache-reading one with soft labels."""
    out = tiny_dir / f"trained-{request.param}"
    labels = "soft" if request.param == "target_cache" else "hard"
    opts = options(
        tiny_dir, out=str(out / "heads.safetensors"), attention=request.param, labels=labels
    )
    summary = train_heads(opts, lambda _: None)
    return out / "heads.safetensors", summary


# --- lossless drafting -----------------------------------------------------------------------


def test_training_decreases_heldout_loss(trained):
    path, summary = trained
    losses = [entry["loss"] for entry in summary["history"]]
    assert losses[-1] < 0.6 * losses[0]
    assert summary["heldout_tau"] > summary["history"][0]["tau"]
    assert path.is_file() and path.with_suffix(".json").is_file()
    config = json.loads(path.with_suffix(".json").read_text())
    assert (
        config["k"] == 4 and config["recipe"]["heldout_acceptance"] == summary["heldout_acceptance"]
    )


def test_frozen_lm_head_and_feature_loss(tiny_dir):
    """--freeze-lm-head keeps the draft LM head at the target's rows; the hidden-state loss is
    reported, and it and the held-out loss fall."""
    from mtp_edge.checkpoints import load_model
    from mtp_edge.mtp import load_heads, target_lm_head

    out = tiny_dir / "frozen" / "heads.safetensors"
    opts = options(tiny_dir, out=str(out), steps=100, train_lm_head=False, feature_loss=1.0)
    summary = train_heads(opts, lambda _: None)
    first, last = summary["history"][0], summary["history"][-1]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["feature_loss"] < first["feature_loss"]
    target = load_model(str(tiny_dir / "model"))
    head = load_heads(out, target.model, target.name)
    rows = target_lm_head(target.model)[head.draft_ids].to(torch.float16)
    assert torch.equal(head.lm_head.weight.to(torch.float16), rows)


@pytest.mark.parametrize("head_kind", ["untrained", "trained"])
def test_greedy_mtp_equals_plain_float64(tiny_dir, trained, head_kind):
    target = load_model(str(tiny_dir / "model"), dtype=torch.float64)
    model = target.model
    if head_kind == "trained":
        head = load_heads(trained[0], model, target.name)
    else:  # a reduced vocabulary that misses tokens the target picks
        head = random_head(model, list(range(0, model.config.vocab_size, 2)))
    session = EagerSession(model, 160, max_chunk=16)
    rng = random.Random(1)
    accepted = 0
    for k, confidence, n in itertools.product((1, 3, 5), (0.0, 0.3), range(3)):
        prompt = target.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(3 + 4 * n)))
        config = GenerationConfig(max_new_tokens=30 + 7 * n, k=k)
        plain = generate(session, prompt, None, config)
        spec = generate(session, prompt, mtp_drafter(head, model, confidence), config)
        assert spec.token_ids == plain.token_ids
        assert spec.stop_reason == plain.stop_reason
        accepted += spec.stats.accepted_tokens
    if head_kind == "trained":
        assert accepted > 0


def test_hybrid_keeps_a_self_heads_cache_whole(tiny_dir):
    """mtp+ngram with a self head: lossless, the lookup drafts some steps and the head others,
    and every draft the head makes equals what a fresh head fed the whole context at once
    drafts: the steps the lookup took were still fed into the head's cache (`observe`)."""
    from mtp_edge.runtime.drafters import HybridDrafter

    target = load_model(str(tiny_dir / "model"), dtype=torch.float64)
    model = target.model
    head = random_head(model, list(range(model.config.vocab_size)), seed=3, attention="self")
    session = EagerSession(model, 160, max_chunk=16)
    drafter = mtp_drafter(head, model)
    made = []
    propose = drafter.propose

    def recording(context, hidden, k, sampler):
        draft = propose(context, hidden, k, sampler)
        made.append((list(context), draft.tokens))
        return draft

    drafter.propose = recording
    hybrid = HybridDrafter(drafter, max_n=3, min_match=1)
    rng = random.Random(4)
    config = GenerationConfig(max_new_tokens=40, k=3)
    for n in range(3):
        words = [rng.choice(WORDS) for _ in range(4)]
        prompt = target.tokenizer.encode(" ".join(words * (2 + n)))
        plain = generate(session, prompt, None, config)
        assert generate(session, prompt, hybrid, config).token_ids == plain.token_ids
    assert hybrid.from_lookup > 0 and len(made) > 0
    fresh_session = EagerSession(model, 160, max_chunk=16)
    for context, tokens in made[-6:]:
        hidden = fresh_session.forward(context[:-1], 0, return_hidden=True).hidden
        fresh = mtp_drafter(head, model).propose(context, hidden, 3, Sampler(SamplingParams()))
        assert fresh.tokens == tokens


SAMPLE_VOCAB, NEW, PROMPT = 4, 4, [1, 2, 3]
SAMPLE_PARAMS = dict(temperature=0.9, top_k=3)


def exact_distribution(session, params) -> dict:
    """P(t1..t4 | prompt) under the target alone, by enumerating every sequence."""
    sampler = Sampler(params)
    dist = {}
    for seq in itertools.product(range(SAMPLE_VOCAB), repeat=NEW):
        logits = session.forward(PROMPT + list(seq[:-1]), 0).logits[len(PROMPT) - 1 :]
        probs = sampler.probs(logits)
        dist[seq] = float(torch.prod(probs[torch.arange(NEW), torch.tensor(seq)]))
    return dist


def sampled_counts(samples: int, hybrid: bool = False) -> tuple[Counter, dict, int]:
    from mtp_edge.runtime.drafters import HybridDrafter

    target = tiny_model(seed=11, vocab=SAMPLE_VOCAB, hidden_size=16, num_layers=1)
    session = EagerSession(target, 32)
    dist = exact_distribution(session, SamplingParams(**SAMPLE_PARAMS))
    # Token 1 is outside the draft vocabulary: q is zero there and the residual must supply it.
    drafter = mtp_drafter(random_head(target, [0, 2, 3], seed=3, std=0.5), target)
    if hybrid:  # 4 tokens: the lookup (one-hot drafts) often matches, the head drafts otherwise
        drafter = HybridDrafter(drafter, max_n=2, min_match=1)
    counts, accepted = Counter(), 0
    for seed in range(samples):
        config = GenerationConfig(
            max_new_tokens=NEW, k=2, sampling=SamplingParams(seed=seed, **SAMPLE_PARAMS)
        )
        result = generate(session, PROMPT, drafter, config)
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.accepted_tokens
    return counts, dist, accepted


SAMPLES = 5000
# The broken rule below is caught at p ~ 1e-107 with 1,500 seeds (1e-66 with 1,000): far past the
# 1e-6 it must reach, at under a third of the check's own cost.
BROKEN_SAMPLES = 1500


@pytest.mark.parametrize("hybrid", [False, True], ids=["mtp", "mtp+ngram"])
def test_mtp_sampling_follows_the_target_distribution(hybrid):
    counts, dist, accepted = sampled_counts(SAMPLES, hybrid)
    assert accepted > SAMPLES // 2  # the drafts are used, not just rejected
    assert chi_square_pvalue(counts, dist, SAMPLES) > 1e-3


def test_the_sampling_check_has_power(monkeypatch):
    """Resampling from p instead of the residual after a rejection must be caught."""
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts, dist, _ = sampled_counts(BROKEN_SAMPLES)
    assert chi_square_pvalue(counts, dist, BROKEN_SAMPLES) < 1e-6


def test_drafter_probs_are_full_vocabulary_and_stop_before_drawing():
    target = tiny_model(seed=2, vocab=16)
    head = random_head(target, [1, 4, 5, 9])
    hidden = torch.randn(3, 32, dtype=torch.float64)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    draft = mtp_drafter(head, target).propose([3, 7], hidden, 4, sampler)
    assert len(draft.tokens) == 4 and draft.probs.shape == (4, 16)
    outside = torch.ones(16, dtype=torch.bool)
    outside[[1, 4, 5, 9]] = False
    assert (draft.probs[:, outside] == 0).all()
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(4, dtype=torch.float64))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    # A confidence above anything q reaches: nothing is drafted (the rule never sees a token).
    strict = mtp_drafter(head, target, min_confidence=0.999)
    assert strict.propose([3, 7], hidden, 4, sampler).tokens == []
    greedy = Sampler(SamplingParams())
    assert strict.propose([3, 7], hidden, 4, greedy).tokens == []


def test_draft_step_cost_is_measured():
    target = tiny_model(seed=0, vocab=48)
    head = random_head(target, list(range(24)))
    cost = measure_step_cost(
        eager_step_fn(head, target), EagerSession(target, 16), 32, torch.float64
    )
    print(f"tiny model: draft step {cost['draft_ms']:.3f} ms, target step {cost['target_ms']:.3f}")
    assert cost["draft_ms"] > 0 and cost["target_ms"] > 0 and cost["ratio"] > 0


# --- training --------------------------------------------------------------------------------


def test_batched_generation_equals_the_loop():
    """Rows padded together, prefilled one by one, dropped from the batch as they end: each
    row's text is what the one-sequence loop writes."""
    model = tiny_model(seed=3, vocab=48)
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [4, 4, 4, 4, 20]]
    prompts += [[p + 1 for p in prompt] for prompt in prompts]
    eos = [3, 17, 30]
    outs = generate_batch(model, prompts, 25, eos_ids=eos)
    assert min(map(len, outs)) < 12 and max(map(len, outs)) == 25  # rows did end early
    for prompt, out in zip(prompts, outs, strict=True):
        config = GenerationConfig(max_new_tokens=25, eos_ids=tuple(eos))
        assert out == [
            t
            for t in generate(EagerSession(model, 256), prompt, None, config).token_ids
            if t not in eos
        ]


def test_int8_writer():
    """The int8 writer: each linear within int8 rounding of the fp32 one, and text mostly the
    target's (a tiny random model has many near-ties, so not all of it)."""
    from mtp_edge.train import Int8Linear, int8_writer

    torch.manual_seed(0)
    weight, x = torch.randn(40, 24), torch.randn(5, 3, 24)
    exact = torch.nn.functional.linear(x, weight)
    approx = Int8Linear(weight)(x)
    assert approx.shape == exact.shape
    assert (approx - exact).abs().max() < 0.03 * exact.abs().max()
    # scaled in place, yet exactly the numbers of the plain formula (the cached text stays valid)
    bias = torch.randn(40)
    linear = Int8Linear(weight, bias)
    rows = x.reshape(-1, 24)
    step = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    q = (rows / step).round().to(torch.int8)
    plain = torch._int_mm(q, linear.weight_t).float() * step * linear.scale + bias
    assert torch.equal(linear(x), plain.reshape(5, 3, 40))
    model = tiny_model(seed=3, vocab=48)
    writer = int8_writer(model)
    assert writer.embed_tokens.weight is model.embed_tokens.weight  # shared, not copied
    assert isinstance(writer.layers[0].mlp.down_proj, Int8Linear)
    assert isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)  # the target untouched
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [4, 4, 4, 4, 20]]
    fp32, int8 = generate_batch(model, prompts, 16, []), generate_batch(writer, prompts, 16, [])
    first = [a[:1] == b[:1] for a, b in zip(fp32, int8, strict=True)]
    assert sum(first) >= 3, (fp32, int8)


def test_default_corpus_is_written_by_the_target_and_cached(tiny_dir, monkeypatch):
    from mtp_edge.texts import HELDOUT_TOPICS
    from mtp_edge.train import corpus, writer
    from mtp_edge.train import generate as generation

    assert not set(HELDOUT_TOPICS) & set(corpus.doc_topics())
    loaded = load_model(str(tiny_dir / "model"))
    settings = dict(data=(), gen_tokens=100, gen_max_new=12, gen_batch=3, raw_tokens=300)
    opts = options(
        tiny_dir, out=str(tiny_dir / "corpus" / "heads.safetensors"), writer="fp32", **settings
    )
    (tiny_dir / "corpus").mkdir()
    sequences = writer.build_corpus(loaded, opts, "hash", 0, 1, print)
    raw = [s for s in sequences if s.start == 0]
    written = [s for s in sequences if s.start > 0]
    assert sum(len(s.tokens) for s in raw) >= 300
    assert sum(len(s.tokens) - s.start - 1 for s in written) >= 100
    session = EagerSession(loaded.model, 512)
    for s in written[:3]:
        prompt, response = s.tokens[: s.start + 1], s.tokens[s.start + 1 :]
        config = GenerationConfig(max_new_tokens=12, eos_ids=tuple(loaded.tokenizer.eos_ids))
        assert generate(session, prompt, None, config).token_ids == response

    def no_generation(*args):
        raise AssertionError("the cached responses were generated again")

    monkeypatch.setattr(generation, "generate_batch", no_generation)
    again = writer.build_corpus(loaded, opts, "hash", 0, 1, print)
    assert [s.tokens for s in again] == [s.tokens for s in sequences]


def test_self_written_requests(tiny_dir, monkeypatch):
    """--self-prompt-tokens: the target samples requests from the start of a user turn of its
    chat template, whole turns only; the requests are cached and reused; their responses join
    the corpus after the template ones. Without a chat template: a one-line refusal."""
    from mtp_edge.train import generate as generation
    from mtp_edge.train import writer

    loaded = load_model(str(tiny_dir / "model"))
    root = tiny_dir / "requests"
    root.mkdir()
    settings = dict(data=(), gen_tokens=30, gen_max_new=8, gen_batch=2, raw_tokens=0)
    opts = options(tiny_dir, out=str(root / "heads.safetensors"), **settings)
    opts.self_prompt_tokens = 30
    with pytest.raises(UserError, match="no chat template"):
        writer.build_corpus(loaded, opts, "hash", 0, 1, print)
    loaded.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    real = generation.generate_batch

    word = loaded.tokenizer.encode(" a")[-1]  # a token that starts a word

    def ending(
        model, prompts, max_new, eos_ids, temperature=0.0, generator=None, ended=None, on_step=None
    ):
        # Tiny random weights rarely say eos, nor start words: end each sampled turn after 8
        # tokens, every other one starting a word (the requests must have 4 words or more).
        outs = real(model, prompts, 8, [], temperature, generator, None, on_step)
        if ended is not None:
            ended[:] = [temperature > 0] * len(outs)
            outs = [[word if i % 2 == 0 else t for i, t in enumerate(o)] for o in outs]
        return outs

    monkeypatch.setattr(generation, "generate_batch", ending)
    sequences = writer.build_corpus(loaded, opts, "hash", 0, 1, print)
    requests = [
        json.loads(line) for line in (root / "heads.requests.jsonl").read_text().splitlines()
    ]
    assert len({r["request"] for r in requests}) == len(requests) >= 30 // 150 + 16
    gen = [json.loads(line) for line in (root / "heads.gen.jsonl").read_text().splitlines()]
    asked = {r["request"] for r in requests}
    answered = [e for e in gen if e["prompt"] in asked]
    assert answered and len(answered) < len(gen)  # both kinds of request
    texts = [s.tokens for s in sequences]
    assert any(e["prompt_ids"] + e["response_ids"] in texts for e in answered if e["response_ids"])

    def no_sampling(*args, **kwargs):
        raise AssertionError("the cached requests were written again")

    monkeypatch.setattr(generation, "generate_batch", no_sampling)
    again = writer.build_corpus(loaded, opts, "hash", 0, 1, print)
    assert [s.tokens for s in again] == [s.tokens for s in sequences]


def test_self_written_requests_by_default(tiny_dir, monkeypatch):
    """Without --self-prompt-tokens, a model with a chat template answers requests it writes
    itself too (a quarter of --gen-tokens); one that writes no usable request gets the
    template prompts only, with a note instead of an error."""
    from mtp_edge.train import generate as generation
    from mtp_edge.train import own_requests, writer

    loaded = load_model(str(tiny_dir / "model"))
    loaded.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    real = generation.generate_batch
    word = loaded.tokenizer.encode(" a")[-1]
    rounds = []

    def sampled(usable):
        def generate(
            model, prompts, max_new, eos_ids, temperature=0.0, generator=None, ended=None,
            on_step=None,
        ):  # fmt: skip
            outs = real(model, prompts, 8, [], temperature, generator, None, on_step)
            if ended is not None:  # a request: ends its turn with 4+ words only when usable
                rounds.append(len(prompts))
                ended[:] = [usable] * len(outs)
                outs = [[word if i % 2 == 0 else t for i, t in enumerate(o)] for o in outs]
            return outs

        return generate

    settings = dict(data=(), gen_tokens=40, gen_max_new=8, gen_batch=2, raw_tokens=0)
    for usable in (True, False):
        root = tiny_dir / f"default-requests-{usable}"
        root.mkdir()
        opts = options(tiny_dir, out=str(root / "heads.safetensors"), **settings)
        assert opts.self_prompt_tokens is None
        monkeypatch.setattr(generation, "generate_batch", sampled(usable))
        notes, rounds[:] = [], []
        sequences = writer.build_corpus(loaded, opts, "hash", 0, 1, notes.append)
        kinds = {}
        for s in sequences:
            kinds[s.kind] = kinds.get(s.kind, 0) + len(s.tokens) - s.start - 1
        templates = sum(n for kind, n in kinds.items() if kind != "self-written")
        assert templates >= 40
        if usable:
            assert 40 // 4 <= kinds["self-written"] < 40 // 4 + 2 * 8  # up to a batch more
        else:
            assert "self-written" not in kinds
            assert len(rounds) == own_requests.AUTOMATIC_PATIENCE  # gave up, no error
            assert any("no usable request" in n for n in notes)


def test_init_continues_from_heads(tiny_dir, trained):
    """--init starts from given heads: their held-out result at step 0, their vocabulary."""
    path, summary = trained
    attention = json.loads(path.with_suffix(".json").read_text())["attention"]
    out = tiny_dir / f"init-{attention}" / "heads.safetensors"
    labels = "soft" if attention == "target_cache" else "hard"  # as the fixture trained them
    opts = options(tiny_dir, out=str(out), steps=20, init=str(path), labels=labels)
    again = train_heads(opts, lambda _: None)
    start = again["history"][0]
    assert start["loss"] == pytest.approx(summary["history"][-1]["loss"], rel=2e-2)
    target = load_model(str(tiny_dir / "model"))
    first = load_heads(path, target.model, target.name)
    second = load_heads(out, target.model, target.name)
    assert torch.equal(first.draft_ids, second.draft_ids)
    assert second.config.attention == first.config.attention


def test_init_takes_heads_or_the_bundle_they_were_exported_into(tmp_path, mtp_bundle_of):
    """--init names a heads file, or a bundle (the heads it was exported from, when they are at
    hand); anything else is one line naming --init, not a hint to train heads at that path."""
    from mtp_edge.train.stages import init_heads

    with pytest.raises(UserError, match=r"^--init \S*nope.safetensors: no heads file there"):
        init_heads(str(tmp_path / "nope.safetensors"))
    bundle = mtp_bundle_of("none")  # a tiny model: no heads are shipped for it
    with pytest.raises(UserError, match=r"^--init on bundle .*: pass --init FILE$"):
        init_heads(str(bundle))
    heads = str(bundle.parent / "heads.safetensors")
    assert init_heads(heads) == heads


def test_further_training_takes_the_new_texts_vocabulary():
    """--init on other text: the draft vocabulary is chosen anew; shared tokens keep their
    trained LM-head rows (wherever they now sit), new ones start from the target's rows."""
    target = tiny_model(seed=2, dtype=torch.float32)
    start = random_head(target, [3, 5, 7, 9])
    with torch.no_grad():
        start.lm_head.weight.add_(1.0)  # "trained": no longer the target's rows
    head = MTPHead(MTPConfig.from_dict(start.config.to_dict()))
    head.load_state_dict(start.state_dict())
    carry_vocabulary(head, start, target, torch.tensor([9, 4, 3, 11]))
    assert head.draft_ids.tolist() == [9, 4, 3, 11]
    rows, trained = head.lm_head.weight, start.lm_head.weight
    assert torch.equal(rows[0], trained[3]) and torch.equal(rows[2], trained[0])
    assert torch.equal(rows[1], target.lm_head.weight[4])
    assert torch.equal(rows[3], target.lm_head.weight[11])


def test_resume_continues_exactly(tiny_dir):
    straight = tiny_dir / "straight" / "heads.safetensors"
    train_heads(options(tiny_dir, out=str(straight), steps=20, checkpoint_every=10), print)

    class Interrupted(Exception):
        pass

    def interrupt_at_step_10(line):
        if line.startswith("step 10/"):
            raise Interrupted

    resumed = tiny_dir / "resumed" / "heads.safetensors"
    settings = dict(out=str(resumed), steps=20, checkpoint_every=10, log_every=10)
    with pytest.raises(Interrupted):
        train_heads(options(tiny_dir, **settings), interrupt_at_step_10)
    assert not resumed.exists()
    lines = []
    train_heads(options(tiny_dir, resume=True, **settings), lines.append)
    assert "resumed at step 10" in lines
    model = load_model(str(tiny_dir / "model")).model
    a, b = load_heads(straight, model, "tiny"), load_heads(resumed, model, "tiny")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    with pytest.raises(UserError, match="other options"):
        train_heads(options(tiny_dir, resume=True, lr=1e-2, **settings), lines.append)


def test_resume_with_no_earlier_run_is_refused(tiny_dir, tmp_path):
    """A mistyped --out with --resume must not start a new run quietly."""
    out = tmp_path / "typo" / "heads.safetensors"
    with pytest.raises(UserError, match="--resume: no earlier run next to .*drop --resume"):
        train_heads(options(tiny_dir, out=str(out), steps=2, resume=True), print)
    assert not out.parent.exists()


def test_writing_stops_when_no_template_prompt_fits(tiny_dir, tmp_path):
    """Sequences shorter than every template prompt: the endless template stream offers nothing
    to write, and the writing must stop and say so rather than draw from it forever."""
    lines = []
    settings = dict(out=str(tmp_path / "h.safetensors"), data=(), gen_tokens=2000, steps=2)
    summary = train_heads(options(tiny_dir, seq_len=24, **settings), lines.append)
    assert any(line.startswith("stopped writing: the last 5000 prompts") for line in lines)
    assert summary["steps"] == 2  # the offline text still trains the heads


DDP_SCRIPT = """
import json, os, sys
from mtp_edge.train import TrainOptions, train_heads
summary = train_heads(TrainOptions(**json.loads(sys.argv[1])), print)
if os.environ["RANK"] == "0":
    with open(sys.argv[2], "w") as f:
        json.dump(summary, f)
"""


def test_ddp_with_two_processes(tiny_dir, trained, tmp_path):
    (tmp_path / "ddp.py").write_text(textwrap.dedent(DDP_SCRIPT))
    kind = json.loads(trained[0].with_suffix(".json").read_text())["attention"]
    out = str(tmp_path / "heads.safetensors")
    settings = {**vars(options(tiny_dir, out=out, steps=40, attention=kind))}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(tmp_path / "ddp.py")]
    command += [json.dumps(settings), str(tmp_path / "summary.json")]
    # a guard against a hang, not a speed limit: two trainers on a loaded 2-core machine are slow
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and math.isfinite(summary["heldout_loss"])
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]
    model = load_model(str(tiny_dir / "model")).model
    ddp = load_heads(tmp_path / "heads.safetensors", model, "tiny").state_dict()
    single = load_heads(trained[0], model, "tiny").state_dict()
    assert {n: t.shape for n, t in ddp.items()} == {n: t.shape for n, t in single.items()}
    assert done.stdout.count("wrote ") == 1


# --- heads files -----------------------------------------------------------------------------


def test_heads_round_trip_and_refuse_another_target(tiny_dir, trained, tmp_path):
    loaded = load_model(str(tiny_dir / "model"))
    head = load_heads(trained[0], loaded.model, loaded.name)
    assert head.lm_head.weight.dtype == torch.float32
    # The same weights in float64 are the same target.
    assert target_fingerprint(loaded.model) == target_fingerprint(loaded.model.double())
    other = ours_from_hf(
        hf_reference(
            "llama",
            seed=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(UserError, match=r"heads were trained for model .*retrain with mtp-train"):
        load_heads(trained[0], other, "other-model")
    wider = tiny_model(seed=0, vocab=97, hidden_size=48, num_heads=6, head_dim=8)
    with pytest.raises(UserError, match=r"hidden 32, vocab 97.*not for wide"):
        load_heads(trained[0], wider, "wide")
    with pytest.raises(UserError, match="not found"):
        load_heads(tmp_path / "missing.safetensors", loaded.model, loaded.name)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not an MTP heads file"):
        load_heads(tmp_path / "junk.safetensors", loaded.model, loaded.name)


def test_save_writes_fp16_and_json(tmp_path):
    target = tiny_model(seed=0, vocab=48)
    head = random_head(target, [0, 5, 7])
    config = head.config
    config.target_name, config.target_hash = "tiny", target_fingerprint(target)
    save_heads(head, config, tmp_path / "h.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h.safetensors"), framework="pt") as f:
        assert f.get_tensor("proj.weight").dtype == torch.float16
        assert f.get_tensor("draft_ids").tolist() == [0, 5, 7]
        assert not any("embed" in name for name in f.keys())  # the embedding is the target's
    assert json.loads((tmp_path / "h.json").read_text())["draft_vocab_size"] == 3
    back = load_heads(tmp_path / "h.safetensors", target, "tiny")
    torch.testing.assert_close(back.proj.weight, head.proj.weight, atol=1e-3, rtol=1e-3)


def test_a_heads_path_that_is_no_heads_file_says_what_to_give(tmp_path):
    """A directory, and a heads file whose tensors do not fit its own config (edited or
    damaged): one line each, saying what to give or do instead."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = tiny_model(seed=0, vocab=48)
    head = random_head(target, [0, 5, 7])
    config = head.config
    config.target_name, config.target_hash = "tiny", target_fingerprint(target)
    good = tmp_path / "h.safetensors"
    save_heads(head, config, good)
    with pytest.raises(UserError, match=r"is a directory.*--heads takes a \.safetensors"):
        load_heads(tmp_path, target, "tiny")
    with safe_open(str(good), framework="pt") as f:
        metadata = f.metadata()
        state = {name: f.get_tensor(name) for name in f.keys()}
    wrong_shape = {**state, "proj.weight": state["proj.weight"][:, :-1].contiguous()}
    missing = {name: t for name, t in state.items() if name != "proj.weight"}
    for name, tensors in (("shape", wrong_shape), ("missing", missing)):
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        with pytest.raises(UserError) as e:
            load_heads(path, target, "tiny")
        message = str(e.value)
        assert "does not match its own config" in message and "proj.weight" in message
        assert "train it again with mtp-train" in message, message
        assert "\n" not in message


# --- training against an exported target -----------------------------------------------------


@pytest.fixture(scope="module")
def fp32_bundle(tiny_dir):
    """tiny_dir's model exported in fp32 with heads (random, of the MLP kind), so that its
    target program returns the hidden states the training reads. What these tests check is
    the exported target's, whatever heads ride along: one export, not one per kind of head."""
    from click.testing import CliRunner
    from tiny import save_random_heads

    from mtp_edge.cli import export

    out = tiny_dir / "bundle"
    heads = save_random_heads(tiny_dir / "model", tiny_dir / "random-heads.safetensors", "none")
    args = ["--model", str(tiny_dir / "model"), "--drafter", "mtp", "--heads", str(heads)]
    args += ["--quant", "fp32", "--embedding-quant", "none", "--max-seq-len", "128"]
    result = CliRunner().invoke(export, [*args, "--quality-tokens", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_an_exported_target_labels_and_writes_the_training_text(tiny_dir, fp32_bundle):
    """--bundle: the exported program's hidden states and choices replace the eager model's;
    for an fp32 export they must be the eager ones (up to float rounding)."""
    from mtp_edge import train

    loaded = load_model(str(tiny_dir / "model"), dtype=torch.float32)
    session, text_hash = train.open_target_bundle(str(fp32_bundle), loaded)
    assert text_hash.startswith("bundle-")
    sequences = [train.Sequence([5 + (7 * i) % 40 for i in range(n)], 2) for n in (20, 37)]
    exported = train.label_with_session(session, sequences)
    eager = train.label_sequences(loaded.model, sequences)
    assert torch.equal(exported.argmax, eager.argmax)
    torch.testing.assert_close(exported.hidden, eager.hidden, atol=2e-3, rtol=0)
    assert torch.equal(exported.starts, eager.starts)
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7]]
    eos = loaded.tokenizer.eos_ids
    assert train.generate_with_session(session, prompts, 12, eos) == generate_batch(
        loaded.model, prompts, 12, eos
    )


def test_training_with_a_bundle(tiny_dir, fp32_bundle):
    out = tiny_dir / "from_bundle" / "heads.safetensors"
    opts = options(tiny_dir, out=str(out), steps=20, bundle=str(fp32_bundle))
    summary = train_heads(opts, lambda _: None)
    assert summary["steps"] == 20 and out.is_file()
    assert json.loads(out.with_suffix(".json").read_text())["recipe"]["bundle"] == "bundle"


def test_who_labels_the_text(tiny_dir, monkeypatch):
    """--labeller: by default int8 where this machine multiplies int8 fast (measured; here a
    machine with fast int8 is given), fp32 on request; the labels kept next to --out are keyed
    by who made them, so a run with another labeller labels again instead of reading the other's."""
    from safetensors.torch import load_file

    from mtp_edge import train
    from mtp_edge.train import engines
    from mtp_edge.train.options import artifact_paths

    monkeypatch.setattr(engines, "probe_paths", lambda target, rows: {"int8": 1.0, "fp32": 4.0})

    out = tiny_dir / "labellers" / "heads.safetensors"
    stored = artifact_paths(out)["labels"].with_name("heads.labels.train0.safetensors")
    runs = {}
    for labeller in ("fp32", "", "int8"):
        lines: list[str] = []
        opts = options(tiny_dir, out=str(out), steps=2, labeller=labeller)
        train_heads(opts, lines.append)
        recorded = json.loads(out.with_suffix(".json").read_text())
        runs[labeller] = (lines, load_file(stored), recorded)
    assert not any("labels read from" in line for line in runs[""][0])
    assert any("labels read from" in line for line in runs["int8"][0])
    assert any("the int8 target labels it" in line for line in runs[""][0])
    assert runs[""][2]["recipe"]["labeller"] == "int8"
    assert runs["fp32"][2]["recipe"]["labeller"] == "fp32"

    loaded = load_model(str(tiny_dir / "model"))
    tokens, bounds = runs[""][1]["tokens"], runs[""][1]["bounds"]
    sequences = [
        train.Sequence(tokens[o : o + n].tolist(), int(first)) for o, n, first in bounds.tolist()
    ]
    for labeller, model in (("", train.int8_writer(loaded.model)), ("fp32", loaded.model)):
        expected = train.label_sequences(model, sequences)
        assert torch.equal(runs[labeller][1]["hidden"], expected.hidden)
        assert torch.equal(runs[labeller][1]["argmax"], expected.argmax)
    assert not torch.equal(runs[""][1]["hidden"], runs["fp32"][1]["hidden"])


def test_a_bundle_of_another_model_is_refused(tiny_dir, fp32_bundle, tmp_path):
    other = save_hf_dir(hf_reference("llama", seed=8), tmp_path / "other")
    opts = options(tiny_dir, out=str(tmp_path / "h.safetensors"), model=str(other))
    opts.bundle = str(fp32_bundle)
    with pytest.raises(UserError, match="not the target"):
        train_heads(opts, lambda _: None)


@pytest.mark.parametrize("attention", ["target_cache", "self"])
def test_training_attention_is_what_drafting_computes(tiny_dir, attention):
    """The training-time test (all origins at once; as context the target's K/V, or for a self
    head its own step-0 K/V; the head's K/V of earlier steps on the diagonal) equals drafting
    step by step on the eager target, which writes the head's K/V into the target's cache or
    into the self head's own (fed the verified rows as one chunk first): training learns what
    drafting runs."""
    from mtp_edge.mtp import cache_attention_config
    from mtp_edge.train import Sequence, label_sequences, rope_tables, sequence_batch

    target = load_model(str(tiny_dir / "model"), dtype=torch.float64).model
    c = target.config
    extra = cache_attention_config(target, attention)
    config = MTPConfig(c.hidden_size, 2 * c.hidden_size, c.vocab_size, c.vocab_size, **extra)
    torch.manual_seed(5)
    head = MTPHead(config).to(torch.float64)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head.eval()
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, c.vocab_size, (24,), generator=generator).tolist()
    k = 3
    own = attention == "self"
    labels = label_sequences(target, [Sequence(tokens, 0)], cache=not own, dtype=torch.float64)
    rope = tuple(t.to(torch.float64) for t in rope_tables(c, len(tokens) + k + 1))
    batch = sequence_batch(labels, [0], target.embed_tokens.weight.detach(), k, rope, True)
    with torch.no_grad():
        trained = head(batch.h, batch.embs, batch.context)[0]  # [L, k, V]

    session = EagerSession(target, 64)
    step = eager_step_fn(head, target)
    for origin in (0, 5, 17, 9):  # 9 after 17: stale slots past the chunk must not matter
        hidden = session.forward(tokens[: origin + 1], 0, return_hidden=True).hidden
        h = hidden if own else hidden[-1:]
        feed = tokens[1 : origin + 2] if own else tokens[origin + 1 : origin + 2]
        position = origin + 2 - len(feed)
        for j in range(k):
            logits, h = step(h, torch.tensor(feed), position)
            torch.testing.assert_close(logits[0], trained[origin, j], atol=1e-6, rtol=1e-5)
            position += len(feed)
            feed = [tokens[origin + 2 + j]]


def test_chat_pairs_as_data(tiny_dir):
    """--data FILE.jsonl[.gz]: prompt/response pairs, drafted from where the response starts;
    a malformed line is refused with its number."""
    import gzip

    from mtp_edge import train

    loaded = load_model(str(tiny_dir / "model"))
    root = tiny_dir / "chat-data"
    root.mkdir()
    pairs = [
        {"prompt": "the cat sat", "response": "on the mat, then the dog"},
        {"prompt": "a" * 500, "response": "too long a prompt"},
        {"prompt": "hi", "response": "the end"},
    ]
    path = root / "pairs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    opts = options(tiny_dir, out=str(root / "heads.safetensors"), data=(str(path),), seq_len=64)
    sequences = train.build_corpus(loaded, opts, "hash", 0, 1, print)
    assert len(sequences) == 2  # the 500-character prompt is longer than seq_len
    tokenizer = loaded.tokenizer
    for s, pair in zip(sequences, [pairs[0], pairs[2]], strict=True):
        prompt = tokenizer.encode_prompt(pair["prompt"])
        assert s.tokens == prompt + tokenizer.encode(pair["response"])
        assert s.start == len(prompt) - 1
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps(pairs[0]) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    opts.data = (str(bad),)
    with pytest.raises(UserError, match="bad.jsonl, line 2: expected a JSON object"):
        train.build_corpus(loaded, opts, "hash", 0, 1, print)
