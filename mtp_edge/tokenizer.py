"""The tokenizer: a `tokenizers.Tokenizer` plus the few facts generation needs.

Those facts (bos/eos ids, whether to prepend bos, the chat template) live in different places
in a Hugging Face directory and in a GGUF file; both constructors gather them here, and `save`
writes them next to `tokenizer.json` so that a bundle needs neither source at run time.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from mtp_edge.errors import UserError

META_FILE = "tokenizer_meta.json"

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Split regexes of llama.cpp's pre-tokenizer types (src/llama-vocab.cpp), as written in the
# models' own tokenizer.json files.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the family whose pre-tokenizer it uses.
_GGUF_PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}

# Markers llama.cpp also stops at when a GGUF marks them as control tokens; a GGUF has no
# generation_config.json to list them.
_END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        vocab_size: int,
        bos_id: int | None,
        eos_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
    ):
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_ids = list(dict.fromkeys(eos_ids))  # unique, primary eos first
        self.add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it are recognised, none are added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the chat template the way transformers does, so prompts match the reference."""
        if self.chat_template is None:
            raise UserError("this tokenizer has no chat template: use a plain prompt instead")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            message = " ".join(str(e).split())  # syntax errors quote the line on a new line
            raise UserError(f"the chat template failed: {message}") from None

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Ids of a prompt ready for prefill: one user turn when there is a template, bos first."""
        if chat and self.chat_template is not None:
            prompt = self.apply_chat_template([{"role": "user", "content": prompt}])
        ids = self.encode(prompt)
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        meta = {
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "bos_token": self.bos_token,
            "eos_ids": self.eos_ids,
            "eos_token": self.eos_token,
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
        }
        (directory / META_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read back what `save` wrote."""
        directory = Path(directory)
        try:
            meta = json.loads((directory / META_FILE).read_text())
            return cls(
                Backend.from_file(str(directory / "tokenizer.json")),
                vocab_size=meta["vocab_size"],
                bos_id=meta["bos_id"],
                eos_ids=meta["eos_ids"],
                add_bos=meta["add_bos"],
                chat_template=meta["chat_template"],
            )
        except Exception as e:  # tokenizers raises a bare Exception on bad json
            raise UserError(f"cannot read the tokenizer in {directory}: {e!r}") from None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a transformers model directory: tokenizer.json and the json files around it."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise UserError(
                f"{path} has no tokenizer.json: save the tokenizer there with transformers "
                "(AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
            )
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on bad json
            raise UserError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
        tok_config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        def token_id(name: str) -> int | None:
            token = tok_config.get(name) or special_map.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos_id = token_id("bos_token")
        eos_ids = [token_id("eos_token")] + _id_list(generation.get("eos_token_id"))
        if not any(i is not None for i in eos_ids):
            eos_ids = _id_list(model_config.get("eos_token_id"))
        add_bos = tok_config.get("add_bos_token")
        if add_bos is None:  # no flag: see whether the post-processor prepends bos
            add_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]

        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text()
        else:
            chat_template = _pick_template(tok_config.get("chat_template"))
        vocab_size = model_config.get("vocab_size") or backend.get_vocab_size(True)
        return cls(
            backend,
            vocab_size=int(vocab_size),
            bos_id=bos_id,
            eos_ids=[i for i in eos_ids if i is not None],
            add_bos=bool(add_bos),
            chat_template=chat_template,
        )

    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""

        def field(key: str, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        tokens = field("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise UserError("the GGUF file has no tokenizer: it needs tokenizer.ggml.* metadata")
        types = field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        pre = field("tokenizer.ggml.pre") or "default"
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, field("tokenizer.ggml.merges") or [], pre)
        elif kind == "llama":
            unk_id = field("tokenizer.ggml.unknown_token_id", 0)
            backend = _sentencepiece_bpe(
                tokens,
                field("tokenizer.ggml.scores"),
                types,
                unk_token=tokens[unk_id],
                add_space_prefix=field("tokenizer.ggml.add_space_prefix", True),
            )
        else:
            raise UserError(
                f"GGUF tokenizer model '{kind}' is not supported: supported are gpt2 "
                "(byte-level BPE) and llama (SentencePiece BPE)"
            )
        _add_gguf_special_tokens(backend, tokens, types)

        eos_ids = [
            field("tokenizer.ggml.eos_token_id"),
            field("tokenizer.ggml.eot_token_id"),
            field("tokenizer.ggml.eom_token_id"),
        ]
        eos_ids += [
            i for i, t in enumerate(tokens) if types[i] == _CONTROL and t in _END_OF_TURN_TOKENS
        ]
        # Without the flag llama.cpp adds bos for SentencePiece and Llama-3 vocabularies.
        bos_by_default = kind == "llama" or _GGUF_PRE_TOKENIZERS.get(pre) == "llama3"
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_id=field("tokenizer.ggml.bos_token_id"),
            eos_ids=[i for i in eos_ids if i is not None],
            add_bos=bool(field("tokenizer.ggml.add_bos_token", bos_by_default)),
            chat_template=field("tokenizer.chat_template"),
        )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path} is not valid json ({e}): fix or delete it") from None


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _pick_template(value) -> str | None:
    """tokenizer_config may hold one template or a list of named ones; use the default."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value}
        return named.get("default") or next(iter(named.values()), None)
    return value


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, > and & for HTML, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=4)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> Backend:
    """GGUF `gpt2` vocabularies are stored in the byte-level alphabet, as in tokenizer.json."""
    family = _GGUF_PRE_TOKENIZERS.get(pre)
    if family is None:
        raise UserError(
            f"GGUF pre-tokenizer '{pre}' is not supported: supported are "
            f"{', '.join(sorted(_GGUF_PRE_TOKENIZERS))}"
        )
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3 takes a whole word from the vocabulary before trying merges, as llama.cpp does.
    model = models.BPE(vocab, pairs, ignore_merges=family == "llama3")
    backend = Backend(model)
    if family == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "digits":  # llama.cpp splits every digit before the GPT-2 regex
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if family == "qwen2":
            backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str],
    scores: list[float] | None,
    types: list[int],
    unk_token: str,
    add_space_prefix: bool,
) -> Backend:
    """SentencePiece BPE (Llama 2, TinyLlama): merges follow the scores of the merged pieces."""
    if scores is None:
        raise UserError("the GGUF SentencePiece tokenizer has no tokenizer.ggml.scores")
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    ranked = []
    for i, token in enumerate(tokens):
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    model = models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    backend = Backend(model)
    # llama.cpp prefixes a space to every run of text, including after special tokens; a
    # normalizer does the same because tokenizers normalizes each run between added tokens.
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _add_gguf_special_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    """Match control tokens (e.g. <|im_end|>) and user-defined ones (e.g. <think>) whole.

    Control tokens are special (dropped when decoding); user-defined ones are ordinary text, as
    in the tokenizer.json llama.cpp converted them from.
    """
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
