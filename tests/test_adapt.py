"""Online adaptation of MTP heads (runtime/adapt.py): drafts change, the output never does; the
buffer and the store of past requests are bounded; the saved heads reproduce the adapted drafts;
a request log seeds the store; setups that cannot adapt say so in one line."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from tiny import amplify_cache_attention, save_random_heads

import mtp_edge
from mtp_edge.errors import UserError
from mtp_edge.mtp import load_heads
from mtp_edge.request_log import read_log
from mtp_edge.runtime.adapt import ReplayBuffer, with_tokens
from mtp_edge.runtime.answer_store import AnswerStore
from mtp_edge.runtime.drafters import Draft

PROMPTS = ["abc abc abc", "the cat sat on the mat", "0123456789", "hello, hello", "zzz"]
NEW = 24


@pytest.fixture(scope="module")
def heads_of(chat_tiny_dir, tmp_path_factory):
    """kind -> random MTP heads for chat_tiny_dir (as the bundles' fixture makes them)."""
    root = tmp_path_factory.mktemp("adapt-heads")

    def heads(kind: str) -> str:
        path = root / f"{kind}.safetensors"
        if not path.exists():
            save_random_heads(chat_tiny_dir, path, kind)
            if kind != "none":
                amplify_cache_attention(path)
        return str(path)

    return heads


def adapt_hard(llm, steps: int = 20, scale: float = 50.0) -> None:
    """Learn from PROMPTS, then blow the correction up: whatever it drafts, the output must not
    change (and the drafts surely do)."""
    for prompt in PROMPTS:
        llm.generate(prompt, max_new_tokens=NEW)
    adapter = llm.generator.adapter
    assert adapter.buffer.size > 0  # verification gave pairs
    for _ in range(steps):
        adapter.train_step()
    with torch.no_grad():
        adapter.u *= scale
    adapter.refresh()
    assert adapter.active and float((adapter.u @ adapter.v).detach().abs().max()) > 0


def drafting(llm) -> list[tuple]:
    out = []
    for prompt in PROMPTS:
        s = llm.generate(prompt, max_new_tokens=NEW).stats
        out.append((s.drafted_tokens, s.accepted_tokens, tuple(s.accepted_per_position)))
    return out


SETUPS = [
    ("model", "none", "mtp"),
    ("model", "target_cache", "mtp+ngram"),
    ("bundle", "none", None),
    ("bundle", "target_cache", None),
    ("bundle", "self", None),
]


@pytest.mark.parametrize(("where", "kind", "drafter"), SETUPS)
def test_adapted_greedy_output_is_plain_output(
    where, kind, drafter, chat_tiny_dir, mtp_bundle_of, heads_of
):
    if where == "model":
        heads = heads_of(kind)
        source = dict(model=str(chat_tiny_dir), max_seq_len=256)
        static = mtp_edge.load(**source, drafter=drafter, heads=heads)
        adapting = mtp_edge.load(**source, drafter=drafter, heads=heads, adapt=True)
    else:
        bundle = mtp_bundle_of(kind)
        heads = str(bundle.parent / "heads.safetensors")  # the bundle's own
        # the head alone, ungated: random heads seldom pass the bundle's confidence floor
        ungated = dict(bundle=bundle, drafter="mtp", draft_confidence=0.0)
        static = mtp_edge.load(**ungated)
        adapting = mtp_edge.load(**ungated, heads=heads, adapt=True)
        source = dict(bundle=bundle)
    plain = mtp_edge.load(**source, drafter="none")
    adapt_hard(adapting)
    before = drafting(static)
    after = drafting(adapting)
    assert after != before  # the drafts changed
    for prompt in [*PROMPTS, "a different prompt, longer than the others were"]:
        expected = plain.generate(prompt, max_new_tokens=NEW).token_ids
        assert adapting.generate(prompt, max_new_tokens=NEW).token_ids == expected
    report = adapting.adaptation
    assert report["pairs"] > 0 and report["steps"] >= 20


def test_the_buffer_is_bounded():
    buffer = ReplayBuffer(8, 4, 5)
    storage = buffer.features.data_ptr(), buffer.logits.data_ptr()
    for i in range(0, 100, 3):  # in batches of 3, which wrap around the ring
        rows = torch.arange(i, i + 3, dtype=torch.float32)
        buffer.add(rows[:, None].expand(3, 4), rows[:, None].expand(3, 5), list(range(i, i + 3)))
    buffer.add(torch.zeros(20, 4), torch.zeros(20, 5), list(range(200, 220)))  # > capacity
    assert (buffer.size, buffer.added) == (8, 122)
    assert (buffer.features.data_ptr(), buffer.logits.data_ptr()) == storage
    assert sorted(buffer.labels.tolist()) == list(range(212, 220))  # the newest are kept


def test_a_long_stream_keeps_the_buffer_within_its_capacity(chat_tiny_dir, heads_of):
    llm = mtp_edge.load(str(chat_tiny_dir), drafter="mtp", heads=heads_of("none"), adapt=True)
    adapter = llm.generator.adapter
    dim, vocab = adapter.buffer.features.shape[1], adapter.buffer.logits.shape[1]
    adapter.buffer = ReplayBuffer(16, dim, vocab)
    for i in range(12):
        llm.generate(f"{i} {PROMPTS[i % len(PROMPTS)]}", max_new_tokens=NEW)
    assert adapter.buffer.added > 16 and adapter.buffer.size == 16


@pytest.mark.parametrize("kind", ["none", "target_cache"])
def test_saved_heads_reproduce_the_adapted_drafts(kind, chat_tiny_dir, heads_of, tmp_path):
    heads = heads_of(kind)
    source = dict(model=str(chat_tiny_dir), drafter="mtp")
    adapting = mtp_edge.load(**source, heads=heads, adapt=True)
    adapt_hard(adapting, scale=5.0)
    adapter = adapting.generator.adapter
    adapter.after_request = lambda *args: 0  # frozen from here on, to compare
    adapter.store = AnswerStore()  # the heads alone draft, as the saved heads will
    saved = adapting.save_heads(tmp_path / "adapted.safetensors")

    target = adapting.generator.session.model
    head = load_heads(saved, target, adapting.name)  # the existing loader takes it
    assert head.config.recipe["adapted"]["steps"] == adapter.steps
    g = torch.randn(32, head.config.hidden_size)
    folded = head.float().lm_head(head.float().final_norm(g))
    original = adapter.head.lm_head(adapter.head.final_norm(g.to(adapter.head.lm_head.weight)))
    corrected = adapter.correct(original.float(), g)
    scale = float(corrected.abs().max())
    assert torch.allclose(folded, corrected, atol=2e-3 * scale)  # fp16 storage of the sum

    reloaded = mtp_edge.load(**source, heads=str(saved))
    assert drafting(reloaded) == drafting(adapting)


def test_cannot_adapt_without_mtp_heads(chat_tiny_dir, ngram_bundle_8da4w, draft_lm_bundle_256):
    from mtp_edge.cli import run

    cases = [
        ["--bundle", str(ngram_bundle_8da4w)],
        ["--bundle", str(draft_lm_bundle_256)],
        ["--model", str(chat_tiny_dir)],  # its default drafter is n-gram lookup
        ["--model", str(chat_tiny_dir), "--drafter", "none"],
    ]
    for args in cases:
        result = CliRunner().invoke(run, [*args, "--adapt", "--prompt", "hi", "-n", "2"])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --adapt adapts MTP heads"), lines
    result = CliRunner().invoke(run, ["--model", "x", "--save-heads", "h.safetensors"])
    assert result.exit_code == 2 and "add --adapt" in result.output
    with pytest.raises(UserError, match="--adapt adapts MTP heads"):
        mtp_edge.load(str(chat_tiny_dir), drafter="ngram", adapt=True)
    with pytest.raises(UserError, match="adapt must be bool"):
        mtp_edge.load(str(chat_tiny_dir), adapt="yes")
    with pytest.raises(UserError, match="adapt=True"):
        mtp_edge.load(str(chat_tiny_dir)).save_heads("x.safetensors")


def test_the_store_drafts_what_followed_most_often():
    store = AnswerStore(min_count=2, min_share=0.5)
    for tail in ([5, 6, 7], [5, 6, 7], [5, 6, 9]):
        store.add([1, 2, 3, 4, *tail], 4)
    assert store.draft([8, 2, 3, 4], 3) == [5, 6, 7]  # 7 followed 2 of 3 times
    assert store.draft([8, 2, 3, 4], 2) == [5, 6]
    assert store.draft([9, 9, 9], 3) == []  # a context it never saw
    once = AnswerStore(min_count=2)
    once.add([1, 2, 3, 4], 2)
    assert once.draft([1, 2, 3], 2) == []  # seen once: not confident


def test_the_store_is_bounded_and_forgets_exactly():
    store = AnswerStore(max_tokens=50)
    sequences = [[(7 * i + j) % 13 for j in range(9 + i % 5)] for i in range(40)]
    for seq in sequences:
        store.add(seq, 3)
        assert store.tokens <= 50
    kept = [seq for seq, first in store.sequences]
    assert kept == sequences[-len(kept) :] and sum(map(len, kept)) == store.tokens
    fresh = AnswerStore(max_tokens=50)
    for seq in kept:
        fresh.add(seq, 3)
    assert as_counts(store) == as_counts(fresh)  # the dropped requests' counts are all taken back


def as_counts(store: AnswerStore) -> dict:
    return {n: {k: dict(v) for k, v in t.items()} for n, t in store.tables.items()}


def test_a_conversation_is_counted_once_and_separate_requests_each_time():
    turn = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # a prompt of 6 tokens and its answer
    nxt = [*turn[:-1], 11, 12, 13, 14, 15]  # the next turn: its answer re-encoded differs at 10
    chat = AnswerStore()
    chat.add(turn, 6)
    chat.add(nxt, 12)
    once = AnswerStore()
    once.add(turn, 6)
    once._count(nxt, 9, +1)  # only the positions the first turn did not have
    assert as_counts(chat) == as_counts(once)
    assert chat.tokens == len(turn) + len(nxt) - 9 + 4  # kept: the new part and its context
    twice = AnswerStore()
    twice.add(turn, 6)
    twice.add(turn, 6)  # the same request again is another request
    assert twice.tables[4][(1, 2, 3, 4)] == {5: 2}
    other = AnswerStore()
    other.add(turn, 6)
    other.add([1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11], 7)  # another prompt: counted whole
    assert other.tables[4][(1, 2, 3, 4)] == {5: 2}


def test_a_chat_fills_the_store_with_each_turn_once(chat_tiny_dir, heads_of):
    model = mtp_edge.load(
        str(chat_tiny_dir), max_seq_len=256, drafter="mtp", heads=heads_of("none"), adapt=True
    )
    messages, sent = [], 0
    for prompt in PROMPTS[:3]:
        messages.append({"role": "user", "content": prompt})
        answer = model.chat(messages, max_new_tokens=NEW)
        sent += len(model.tokenizer.encode_messages(messages)) + len(answer.token_ids)
        messages.append({"role": "assistant", "content": answer.text})
    first_prompt = len(model.tokenizer.encode_messages(messages[:1]))
    report = model.adaptation
    assert report["store_requests"] == 3
    # the later turns did not bring the first turn's prompt again (but for a few tokens of
    # context before their new part)
    assert report["store_tokens"] <= sent - 2 * (first_prompt - 4)


def test_repeated_requests_draft_from_the_store_and_output_stays_plain(chat_tiny_dir, heads_of):
    source = dict(model=str(chat_tiny_dir), max_seq_len=256)
    plain = mtp_edge.load(**source, drafter="none")
    # a floor random heads never reach: the head stops at once, and the store goes on
    adapting = mtp_edge.load(
        **source, drafter="mtp", heads=heads_of("none"), adapt=True, draft_confidence=0.999
    )
    for prompt in [*PROMPTS, *PROMPTS]:
        expected = plain.generate(prompt, max_new_tokens=NEW).token_ids
        assert adapting.generate(prompt, max_new_tokens=NEW).token_ids == expected
    report = adapting.adaptation
    # the second round asks what the first did: its answers come from the store
    assert report["store_requests"] == 2 * len(PROMPTS) and report["store_drafts"] > 0


def test_a_request_log_seeds_the_store(chat_tiny_dir, heads_of, tmp_path):
    source = dict(model=str(chat_tiny_dir), max_seq_len=256, drafter="mtp", heads=heads_of("none"))
    with mtp_edge.load(**source, log=tmp_path / "log") as first:
        for prompt in PROMPTS:
            first.chat([{"role": "user", "content": prompt}], max_new_tokens=NEW)
    restarted = mtp_edge.load(**source, adapt=True, log=tmp_path / "log")
    assert restarted.adaptation["store_requests"] == len(PROMPTS)
    answered = sum(len(r.answer_ids) for r in read_log(tmp_path / "log"))
    assert restarted.adaptation["store_tokens"] > answered  # the prompts too, as encoded
    assert mtp_edge.load(**source, adapt=True).adaptation["store_requests"] == 0


def test_store_tokens_after_sampled_head_tokens_are_one_hot_proposals():
    head_probs = torch.softmax(torch.randn(2, 7, dtype=torch.float64), -1)
    draft = with_tokens(Draft([3, 1], head_probs), [5, 0])
    assert draft.tokens == [3, 1, 5, 0]
    assert torch.equal(draft.probs[:2], head_probs)
    assert draft.probs[2].tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert draft.probs[3].tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert with_tokens(Draft([4]), [2]) == Draft([4, 2])  # greedy: deterministic throughout


def test_sampled_generation_drafts_from_the_store(chat_tiny_dir, heads_of):
    source = dict(model=str(chat_tiny_dir), max_seq_len=256, drafter="mtp", heads=heads_of("none"))
    adapting = mtp_edge.load(**source, adapt=True, draft_confidence=0.2)
    for n, prompt in enumerate([*PROMPTS, *PROMPTS]):
        c = adapting.generate(prompt, max_new_tokens=NEW, temperature=0.7, seed=n)
        assert len(c.token_ids) == NEW or c.finish_reason == "eos"
    assert adapting.adaptation["store_drafts"] > 0  # its drafts went through rejection sampling


FREED_BLOCKS = """
import ctypes, sys
import torch
import mtp_edge
import mtp_edge.runtime.adapt as adapt
if sys.argv[3] == "skip":
    adapt.return_freed_memory = lambda: None
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
llm = mtp_edge.load(sys.argv[1], drafter="mtp", heads=sys.argv[2], adapt=True)
torch.ones(16 << 18)  # a freed 16 MB block: glibc's default then raises its mmap threshold
before = libc.mallinfo2().hblkhd
blocks = [torch.ones(8 << 18) for _ in range(4)]  # 4 x 8 MB, as an adaptation step's batch
print((libc.mallinfo2().hblkhd - before) / 2**20)
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's malloc")
def test_an_adapting_model_maps_its_large_blocks(chat_tiny_dir, heads_of):
    """An adaptation step allocates and frees blocks of several MB; in an adapting process they
    are mapped on their own, so freeing one gives it back (RSS flat over a stream: measured by
    benchmarks/adapt_memory.py), which glibc's malloc by default does not do for them."""
    import subprocess
    import sys

    def mapped(setting: str) -> float:
        args = [sys.executable, "-c", FREED_BLOCKS, str(chat_tiny_dir), heads_of("none"), setting]
        return float(subprocess.run(args, capture_output=True, text=True, check=True).stdout)

    assert mapped("as-shipped") >= 32  # MB of the 4 blocks held
    assert mapped("skip") < 8  # from the heap by default, kept when freed: the check can fail
