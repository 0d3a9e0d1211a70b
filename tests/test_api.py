"""The Python API: generate, stream, chat with the KV cache kept across calls.

The promise checked here: a call that reuses the cache gives the tokens a fresh model gives for
the same prompt (greedy; plain, n-gram and MTP drafting), while prefilling only what follows the
cached prefix; a stream shows the text generate returns, never a stop string; closing a stream
early leaves the model as good as new.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from tiny import hf_reference, save_hf_dir, save_random_heads

import mtp_edge
from mtp_edge.api import Model, StreamText, held_back, shared_prefix
from mtp_edge.errors import UserError

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = {"role": "system", "content": "answer in one line"}
TURN1 = [SYSTEM, {"role": "user", "content": "the cat sat on"}]
DRAFTERS = ["none", "ngram", "mtp"]
NEW = 24


def second_turn(first_answer: str) -> list[dict]:
    return TURN1 + [
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "and then the dog ran after it"},
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    model = save_hf_dir(hf_reference("llama", seed=3), root / "model")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    save_random_heads(model, root / "heads.safetensors")
    return model


def load(model_dir, drafter: str, **options) -> Model:
    if drafter == "mtp":
        options["heads"] = str(model_dir.parent / "heads.safetensors")
    return mtp_edge.load(model_dir, drafter=drafter, max_seq_len=256, **options)


def test_import_is_cheap_and_names_load_lazily():
    import subprocess
    import sys

    code = "import sys, mtp_edge; assert 'torch' not in sys.modules; print(mtp_edge.load)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "function load" in done.stdout, done.stderr


def test_generate(model_dir):
    llm = load(model_dir, "ngram")
    assert llm.max_seq_len == 256 and llm.eos_ids == llm.tokenizer.eos_ids
    r = llm.generate("the cat", max_new_tokens=NEW)
    assert r.finish_reason in {"eos", "max_tokens"} and 0 < len(r.token_ids) <= NEW
    assert r.text == llm.tokenizer.decode(r.token_ids)
    assert r.prompt_tokens == len(llm.tokenizer.encode_prompt("the cat"))
    assert r.stats.generated_tokens == len(r.token_ids) and r.stats.verify_steps > 0
    assert set(r.to_dict()) >= {"text", "token_ids", "finish_reason", "stats"}
    # Token ids and a raw prompt; the same prompt again is served from the cache.
    raw = load(model_dir, "none", chat=False)
    ids = raw.tokenizer.encode("the cat sat")
    first = raw.generate(ids, max_new_tokens=NEW)
    assert first.cached_tokens == 0
    again = raw.generate(ids, max_new_tokens=NEW)
    assert again.token_ids == first.token_ids and again.cached_tokens == len(ids) - 1
    assert raw.generate("the cat sat", max_new_tokens=NEW).token_ids == first.token_ids


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_stream_shows_what_generate_returns(model_dir, drafter):
    llm = load(model_dir, drafter)
    full = llm.generate("the cat", max_new_tokens=NEW)
    chunks = list(llm.stream("the cat", max_new_tokens=NEW))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == full.finish_reason and chunks[-1].stats is not None

    # A stop string taken from the middle of the text: nothing from it on is ever streamed.
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    expected = full.text[: full.text.index(stop)]
    shown = ""
    for chunk in llm.stream("the cat", max_new_tokens=NEW, stop=[stop]):
        shown += chunk.text
        assert expected.startswith(shown)
    assert shown == expected
    stopped = llm.generate("the cat", max_new_tokens=NEW, stop=stop)
    assert stopped.text == expected and stopped.finish_reason == "stop_string"


def test_stream_text_holds_back_partial_characters_and_stop_prefixes():
    pieces = {1: "ab", 2: "\ufffd", 3: "é", 4: "<", 5: "/", 6: "x", 7: "<", 8: "/s>"}

    def detokenize(tokens):  # token 2 is the first byte of é: alone it decodes to U+FFFD
        text = "".join(pieces[t] for t in tokens)
        return text.replace("\ufffdé", "é")

    stream = StreamText(detokenize, ("</s>",))
    tokens, shown = [], []
    for token in (1, 2, 3, 4, 5, 6, 7):
        tokens.append(token)
        shown.append(stream.feed(tokens))
    assert shown == ["ab", "", "é", "", "", "</x", ""]
    assert stream.finish(tokens + [8]) == ""  # "</s>" completed: the held "<" is never shown
    assert held_back("abc</", ("</s>", "c<")) == 2 and held_back("abc", ("</s>",)) == 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_closing_a_stream_early_leaves_the_model_as_new(model_dir, drafter):
    llm = load(model_dir, drafter)
    stream = llm.stream_chat(TURN1, max_new_tokens=NEW)
    next(stream), next(stream)
    stream.close()
    assert llm.cached_tokens  # what the two steps wrote is known and kept
    conversation = second_turn("it sat there")
    reused = llm.chat(conversation, max_new_tokens=NEW)
    assert reused.cached_tokens > 0
    fresh = load(model_dir, drafter).chat(conversation, max_new_tokens=NEW)
    assert reused.token_ids == fresh.token_ids and fresh.cached_tokens == 0
    # Leaving a loop over a stream stops it too; a new call also ends a stream left open.
    for _chunk in llm.stream_chat(TURN1, max_new_tokens=NEW):
        break
    left_open = llm.stream_chat(TURN1, max_new_tokens=NEW)
    next(left_open)
    assert llm.chat(conversation, max_new_tokens=NEW).token_ids == fresh.token_ids
    assert list(left_open) == []


def assert_cache_holds(llm: Model, prompt: list[int], result) -> list[int]:
    """The cache holds the prompt and the generated tokens, but perhaps the last (the pending
    token of the last step, never fed)."""
    held = llm.cached_tokens
    everything = prompt + result.token_ids
    assert held == everything[: len(held)] and len(held) >= len(everything) - 1
    return held


def check_chat_reuse(make_model, drafters, new: int = NEW):
    """Second turns that reuse the first's cache give a fresh model's tokens, prefilling only
    what follows the cached prefix; speculative equals plain."""
    answers = {}
    for drafter in drafters:
        llm = make_model(drafter)
        prompt1 = llm.tokenizer.encode_messages(TURN1)
        first = llm.chat(TURN1, max_new_tokens=new)
        assert first.cached_tokens == 0 and first.prompt_tokens == len(prompt1)
        conversation = second_turn(first.text)
        prompt2 = llm.tokenizer.encode_messages(conversation)
        held = assert_cache_holds(llm, prompt1, first)
        second = llm.chat(conversation, max_new_tokens=new)
        assert second.cached_tokens == shared_prefix(held, prompt2[:-1]) >= len(prompt1)
        assert second.prefilled_tokens == len(prompt2) - second.cached_tokens
        fresh = make_model(drafter).chat(conversation, max_new_tokens=new)
        assert fresh.cached_tokens == 0
        assert second.token_ids == fresh.token_ids, drafter
        answers[drafter] = (first.token_ids, second.token_ids)
        if drafter != "none":
            assert second.stats.drafted_tokens > 0
    assert len({json.dumps(a) for a in answers.values()}) == 1  # speculative == plain


def test_chat_reuses_the_cache_and_gives_a_fresh_models_tokens(model_dir):
    # fallback off: drafting must be exercised, and on a model this small it rarely pays
    check_chat_reuse(lambda drafter: load(model_dir, drafter, fallback=False), DRAFTERS)


def test_reuse_of_generated_tokens_and_reset(model_dir):
    """A prompt that continues the previous prompt and its output reuses both."""
    for drafter in DRAFTERS:
        llm = load(model_dir, drafter, chat=False)
        ids = llm.tokenizer.encode("the cat sat on the mat")
        first = llm.generate(ids, max_new_tokens=NEW)
        held = assert_cache_holds(llm, ids, first)
        longer = ids + first.token_ids + llm.tokenizer.encode(" then")
        second = llm.generate(longer, max_new_tokens=NEW)
        assert second.cached_tokens == len(held)
        assert (
            second.token_ids
            == load(model_dir, drafter, chat=False).generate(longer, max_new_tokens=NEW).token_ids
        )
        llm.reset()
        assert llm.generate(longer, max_new_tokens=4).cached_tokens == 0


def test_a_self_heads_cache_follows_the_reused_context(model_dir, tmp_path):
    """A head with a cache of its own (EAGLE-like) drafts, after the cache is reused, exactly
    what a fresh head fed the whole context drafts: the rows of a call's last step, and of a
    stream closed early, were taken in (float64, so prefill chunking does not matter)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from mtp_edge.checkpoints import load_model
    from mtp_edge.mtp import load_heads
    from mtp_edge.runtime.assemble import Generator
    from mtp_edge.runtime.loop import GenerationConfig
    from mtp_edge.runtime.mtp_drafter import mtp_drafter
    from mtp_edge.runtime.sampling import Sampler, SamplingParams
    from mtp_edge.runtime.session import EagerSession

    heads = save_random_heads(model_dir, tmp_path / "self.safetensors", attention="self")
    # Louder attention, so that drafts depend on what the head's cache holds.
    with safe_open(str(heads), framework="pt") as f:
        metadata = f.metadata()
    state = load_file(str(heads))
    state["blocks.0.cache_attn.o_proj.weight"] *= 4.0
    save_file(state, str(heads), metadata=metadata)
    target = load_model(str(model_dir), dtype=torch.float64)
    head = load_heads(str(heads), target.model, target.name).to(torch.float64)
    drafter = mtp_drafter(head, target.model)
    made = []
    propose = drafter.propose

    def recording(context, hidden, k, sampler):
        draft = propose(context, hidden, k, sampler)
        made.append((list(context), k, draft.tokens))
        return draft

    drafter.propose = recording
    session = EagerSession(target.model, 256)
    config = GenerationConfig(k=3, eos_ids=tuple(target.tokenizer.eos_ids))
    llm = Model(Generator("tiny", target.tokenizer, session, drafter, config, False, None))
    encode = target.tokenizer.encode
    ids = encode("the cat sat on the mat")
    first = llm.generate(ids, max_new_tokens=NEW)
    longer = ids + first.token_ids + encode(" then")
    stream = llm.stream(longer, max_new_tokens=NEW)
    streamed = next(stream).token_ids + next(stream).token_ids
    stream.close()
    longest = longer + streamed + encode(" the dog")
    made.clear()
    third = llm.generate(longest, max_new_tokens=NEW)
    assert third.cached_tokens >= len(longer) and made
    fresh_session = EagerSession(load_model(str(model_dir), dtype=torch.float64).model, 256)
    greedy = Sampler(SamplingParams())
    for context, k, tokens in made:
        hidden = fresh_session.forward(context[:-1], 0, return_hidden=True).hidden
        fresh = mtp_drafter(head, target.model).propose(context, hidden, k, greedy)
        assert fresh.tokens == tokens


def test_a_conversation_longer_than_the_context_says_so(model_dir):
    llm = mtp_edge.load(model_dir, drafter="none", max_seq_len=64)
    long = [{"role": "user", "content": "the cat " * 40}]
    with pytest.raises(mtp_edge.ContextFull, match="context holds 64"):
        llm.chat(long)
    result = llm.chat(TURN1, max_new_tokens=100)  # fits, then fills the context
    assert result.finish_reason == "context_full"
    with pytest.raises(UserError, match="context holds 64"):
        llm.chat(second_turn(result.text))
    llm.reset()
    assert llm.chat(TURN1, max_new_tokens=2).cached_tokens == 0


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "conversation is empty"),
        ([{"role": "robot", "content": "hi"}], "role 'robot'"),
        ([{"role": "user"}], "'role' and 'content'"),
        ([{"role": "user", "content": 3}], "must be text"),
        ([{"role": "user", "content": "  "}], "user message is empty"),
        ([{"role": "user", "content": "a"}, SYSTEM], "where assistant belongs"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last"),
        ([SYSTEM], "last message must be the user's"),
    ],
)
def test_bad_conversations_are_user_errors(model_dir, messages, fragment):
    llm = load(model_dir, "none")
    with pytest.raises(UserError, match=fragment):
        llm.chat(messages)


def test_bad_settings_are_user_errors(model_dir):
    llm = load(model_dir, "none")
    for settings, fragment in [
        ({"stop": [""]}, "stop string"),
        ({"temperature": -1}, "temperature"),
        ({"max_new_tokens": 0}, "max-new-tokens"),
    ]:
        with pytest.raises(UserError, match=fragment):
            llm.generate("the cat", **settings)
    with pytest.raises(UserError, match="token ids"):
        llm.generate([1, 10_000])
    with pytest.raises(TypeError, match="unknown options"):
        mtp_edge.load(model_dir, temperature=0.5)


def test_messages_render_with_the_template_and_specials_stay_text(model_dir, tmp_path):
    llm = load(model_dir, "none")
    tokenizer = llm.tokenizer
    conversation = second_turn("it <|im_end|> sat")
    text = tokenizer.render_messages(conversation)
    assert text.startswith("<|im_start|>system\nanswer in one line<|im_end|>\n")
    assert text.endswith("and then the dog ran after it<|im_end|>\n<|im_start|>assistant\n")
    im_end = tokenizer.backend.token_to_id("<|im_end|>")
    typed = tokenizer.encode_messages(conversation)
    parsed = tokenizer.encode_messages(conversation, parse_special=True)
    assert parsed.count(im_end) == typed.count(im_end) + 1 == 5

    # A template without a system role: the system text opens the first user message.
    other = tmp_path / "no-system"
    save_hf_dir(hf_reference("llama", seed=3), other)
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": NO_SYSTEM_TEMPLATE}))
    no_system = mtp_edge.load(other, drafter="none", max_seq_len=256).tokenizer
    assert no_system.render_messages(TURN1).startswith(
        "<|im_start|>user\nanswer in one line\n\nthe cat sat on<|im_end|>"
    )


@pytest.fixture(scope="module")
def mtp_bundle(model_dir, tmp_path_factory):
    """A tiny fp32 ExecuTorch bundle whose target program drafts with the MTP heads."""
    from mtp_edge.cli import export

    out = tmp_path_factory.mktemp("bundle") / "tiny-mtp"
    heads = model_dir.parent / "heads.safetensors"
    args = ["--model", str(model_dir), "--out", str(out), "--quant", "fp32", "--drafter", "mtp",
            "--heads", str(heads), "--max-seq-len", "160", "--quality-tokens", "0"]  # fmt: skip
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    return out


def test_a_stock_runner_decodes_an_mtp_bundle(mtp_bundle):
    """forward has the one output ExecuTorch's TextLLMRunner reads, the drafter's hidden states
    come from the `last_hidden` method: the stock runner decodes the MTP bundle's program."""
    from executorch.runtime import Runtime

    from mtp_edge.devices.peer import textllmrunner_baseline
    from mtp_edge.manifest import Manifest

    pte = mtp_bundle / "target.pte"
    assert Runtime.get().load_program(pte).metadata("forward").num_outputs() == 1
    assert "last_hidden" in Manifest.load(mtp_bundle).models["target"].methods
    result = textllmrunner_baseline(pte, mtp_bundle / "tokenizer.json", [("the cat sat on", 8)])
    assert "error" not in result, result
    assert result["generated_tokens"] >= 2


def test_chat_reuse_on_an_executorch_bundle(mtp_bundle):
    """The same on the bundle's own backend: its drafter (mtp), ngram and none."""

    def make_model(drafter):
        drafter = None if drafter == "mtp" else drafter
        return mtp_edge.load(bundle=mtp_bundle, drafter=drafter, fallback=False)

    check_chat_reuse(make_model, DRAFTERS, new=12)
