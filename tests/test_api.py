"""The Python API: generate, stream, chat with the KV cache kept across calls.

The promise checked here: a call that reuses the cache gives the tokens a fresh model gives for
the same prompt (greedy; plain, n-gram and MTP drafting), while prefilling only what follows the
cached prefix; a stream shows the text generate returns, never a stop string; closing a stream
early leaves the model as good as new.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import hf_reference, save_hf_dir, save_random_heads

import mtp_edge
from mtp_edge import api
from mtp_edge.api import (
    LoadOptions,
    Model,
    StreamText,
    check_sampling,
    held_back,
    load_options,
    shared_prefix,
)
from mtp_edge.errors import UserError
from mtp_edge.limits import LIMITS, SAMPLING

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
    for bad, fragment in [
        ({"stop": [""]}, "stop string"),
        ({"temperature": -1}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ]:
        with pytest.raises(UserError, match=fragment):
            llm.generate("the cat", **bad)
    with pytest.raises(UserError, match="token ids"):
        llm.generate([1, 10_000])
    with pytest.raises(TypeError, match="unknown options"):
        mtp_edge.load(model_dir, temperature=0.5)


# Values of the wrong type or out of range for every numeric setting; None where it is not
# "the default". Each must be refused with one line naming the setting, before anything loads.
BAD_VALUES = st.one_of(
    st.text(max_size=3),
    st.binary(max_size=3),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e400, -1, 2.5, 2**64]),
    st.integers(),
    st.floats(),
)


def one_line_user_error(call, name: str) -> str:
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(name), message
    return message


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(LIMITS.keys() - set(SAMPLING))), value=BAD_VALUES)
def test_load_checks_every_option_before_loading(name, value, monkeypatch):
    """Whatever `load()` gets, it is a range of mtp_edge/limits.py (the CLI's too) or refused at
    once: assembling (loading) is never reached with a value out of it."""
    monkeypatch.setattr(api, "assemble", lambda options: pytest.fail(f"loaded with {options}"))
    if LIMITS[name].convert(value) is not None:
        return  # a valid value (hypothesis found one in range)
    one_line_user_error(lambda: mtp_edge.load(bundle="b", **{name: value}), name)


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"k": "4"}, "k must be an integer in 1..15"),
        ({"k": 0}, "k must be an integer in 1..15"),
        ({"k": 200}, "k must be an integer in 1..15"),
        ({"threads": -1}, "threads must be an integer >= 0"),
        ({"max_seq_len": 1}, "max_seq_len must be an integer >= 2"),
        ({"draft_confidence": 1.0}, "draft_confidence must be a finite number in [0, 1)"),
        ({"drafter": 3}, "drafter must be str"),
        ({"heads": 3}, "heads must be a path"),
        ({"chat": "yes"}, "chat must be bool"),
        ({"fallback": 1}, "fallback must be bool or None"),
        ({"ngram_sizes": "x"}, "ngram_sizes takes 'MIN-MAX'"),
    ],
)
def test_load_names_the_bad_option(options, fragment, monkeypatch):
    monkeypatch.setattr(api, "assemble", lambda options: pytest.fail(f"loaded with {options}"))
    assert fragment in one_line_user_error(lambda: mtp_edge.load(bundle="b", **options), "")
    with pytest.raises(UserError, match="model must be a path"):
        mtp_edge.load(3)


def test_the_limits_keep_good_values():
    """The other side of the property: values in range pass, converted to their kind."""
    good = {"k": [1, 15], "threads": [0, 4], "max_seq_len": [2, 4096],
            "draft_confidence": [0, 0.5, 0.99]}  # fmt: skip
    for name, values in good.items():
        for value in values:
            assert LIMITS[name].convert(value) == value
    assert load_options("default", None, {"k": None, "draft_confidence": None}).k is None
    options = {"k": 3, "threads": 2, "heads": Path("h"), "ngram_sizes": "2-3", "fallback": None}
    assert load_options("m.gguf", Path("b"), options) == LoadOptions(
        model="m.gguf", bundle="b", k=3, threads=2, heads="h", ngram_sizes="2-3", fallback=None
    )
    assert check_sampling(max_new_tokens=5, temperature=1, top_p=0.5, seed=2**64 - 1, stop="x") == {
        "max_new_tokens": 5, "temperature": 1.0, "top_k": 0, "top_p": 0.5, "seed": 2**64 - 1,
        "stop": ("x",),
    }  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(SAMPLING + ("stop",)), value=BAD_VALUES)
def test_sampling_settings_are_checked_before_any_work(model_dir, name, value):
    """A call with a bad setting is refused in one line naming it, and the model is untouched:
    nothing prefilled, no stream opened, the cache as it was."""
    llm = sampling_model(model_dir)
    before = llm.cached_tokens
    if name == "stop":
        if isinstance(value, str) and value or isinstance(value, list) and not value:
            return  # a text, or no stop strings: valid
    elif LIMITS[name].convert(value) is not None:
        return
    for call in (llm.generate, llm.stream):
        one_line_user_error(lambda call=call: call("the cat", **{name: value}), name)
    one_line_user_error(lambda: llm.chat(TURN1, **{name: value}), name)
    assert llm.cached_tokens == before and llm._open is None


_SAMPLING_MODEL = {}


def sampling_model(model_dir) -> Model:
    """One model for every example of the property above (loading takes a while)."""
    if "llm" not in _SAMPLING_MODEL:
        _SAMPLING_MODEL["llm"] = load(model_dir, "none")
        _SAMPLING_MODEL["llm"].generate("the cat", max_new_tokens=2)
    return _SAMPLING_MODEL["llm"]


def test_a_prompt_of_bytes_or_of_no_kind_is_refused(model_dir):
    llm = sampling_model(model_dir)
    for prompt in (b"hi", bytearray(b"hi"), memoryview(b"hi")):
        with pytest.raises(UserError, match="the prompt is bytes: give text"):
            llm.generate(prompt)
    for prompt in (None, 5, ["a"], [1.5]):
        with pytest.raises(UserError, match="token ids"):
            llm.generate(prompt)


def test_two_threads_on_one_model_take_turns(model_dir):
    """Calls from four threads wait for each other (a stream until its last chunk): every
    answer is the one a single thread gets, and no call breaks into another."""
    llm = load(model_dir, "ngram")
    prompts = ["the cat sat on", "a dog ran", "the sun is", "in the house"]
    expected = {p: llm.generate(p, max_new_tokens=NEW).token_ids for p in prompts}
    errors, answers = [], []
    start = threading.Barrier(4)

    def calls(mine: list[str], streaming: bool):
        start.wait()
        try:
            for _ in range(3):
                for p in mine:
                    if streaming:  # other threads wait while it is read, chunk by chunk
                        chunks = list(llm.stream(p, max_new_tokens=NEW))
                        assert chunks[-1].finish_reason is not None
                        answers.append((p, [t for c in chunks for t in c.token_ids]))
                    else:
                        answers.append((p, llm.generate(p, max_new_tokens=NEW).token_ids))
        except BaseException as e:  # noqa: B036 (any error fails the test below)
            errors.append(e)

    threads = [
        threading.Thread(target=calls, args=(prompts[i : i + 2], i == 2)) for i in (0, 2, 0, 2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    assert len(answers) == 24 and all(ids == expected[p] for p, ids in answers)
    # A stream another thread leaves open holds the model until it is closed or dropped.
    held = llm.stream(prompts[0], max_new_tokens=NEW)
    next(held)
    waiter = threading.Thread(
        target=lambda: answers.append(llm.generate(prompts[1], max_new_tokens=NEW))
    )
    waiter.start()
    waiter.join(2)
    assert waiter.is_alive()  # waiting for the stream
    del held
    waiter.join(120)
    assert answers[-1].token_ids == expected[prompts[1]]


def test_close_and_with(model_dir):
    with load(model_dir, "none") as llm:
        answer = llm.generate("the cat", max_new_tokens=4)
        stream = llm.stream("the cat", max_new_tokens=4)
        next(stream)
    assert llm.closed and answer.token_ids
    assert list(stream) == []  # closing the model ended its stream
    for call in (lambda: llm.generate("the cat"), lambda: llm.name, lambda: llm.stream([1])):
        with pytest.raises(UserError, match="this model is closed"):
            call()
    llm.close()  # twice is fine


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
def mtp_bundle(mtp_bundle_of):
    """A tiny ExecuTorch bundle whose target program drafts with MTP heads that read its cache
    (a `draft` method): conftest.py's, shared."""
    return mtp_bundle_of("target_cache")


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
