"""The tokenizer: a `tokenizers.Tokenizer` plus the few facts generation needs.

(One file past 600 lines: the chat rendering of prompts and conversations shares the special-token
rules with the encoders, and the GGUF rebuilding the backend's construction.)

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

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, none added. Special tokens written in it (e.g. <|im_end|>) are
        recognised, or with parse_special=False encoded as the plain text they are."""
        _check_utf8(text, "the text")
        if parse_special:
            return self.backend.encode(text, add_special_tokens=False).ids
        return self._encode_plain(text)

    def _encode_plain(self, text: str) -> list[int]:
        """Special tokens as plain text; added tokens that are not special still match whole,
        as llama.cpp treats user-defined tokens. (The flag is the backend's: set for this call,
        as transformers does for split_special_tokens.)"""
        backend = self.backend
        previous = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            return backend.encode(text, add_special_tokens=False).ids
        finally:
            backend.encode_special_tokens = previous

    def _special_tokens(self) -> dict[int, str]:
        return {
            i: t.content for i, t in self.backend.get_added_tokens_decoder().items() if t.special
        }

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

    def encode_prompt(
        self, prompt: str, chat: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Ids of a prompt ready for prefill: one user turn when there is a template, bos first.

        Special tokens typed in the prompt (<|im_end|>, <|im_start|>...) are encoded as plain
        text, so that user text cannot end its turn or speak as another role; the template's own
        markers stay special. parse_special=True recognises them in the prompt too (as llama.cpp
        does on request).
        """
        _check_utf8(prompt, "the prompt")
        if chat and self.chat_template is not None:
            return self._encode_chat([{"role": "user", "content": prompt}], parse_special)
        return self._with_bos(self.encode(prompt, parse_special=parse_special))

    def encode_messages(self, messages: list[dict], parse_special: bool = False) -> list[int]:
        """Ids of a conversation ready for prefill: an optional system message, then user and
        assistant turns alternating, the user's last; the template's prompt for the answer
        follows. Special tokens typed in messages are text, as in `encode_prompt`.

        A template without a system role gets the system text at the head of the first user
        message (as templates that refuse a system role advise)."""
        return self._encode_chat(self.template_messages(messages), parse_special)

    def render_messages(self, messages: list[dict]) -> str:
        """The conversation as text, as a runner that tokenizes by itself must receive it."""
        return self.apply_chat_template(self.template_messages(messages))

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """`messages` checked (roles, order, text), with a system message folded into the first
        user message when the template has no system role."""
        if self.chat_template is None:
            raise UserError(
                "this model has no chat template, so a conversation cannot be rendered: give a "
                "plain prompt instead (generate), or use a chat model"
            )
        messages = check_messages(messages)
        if messages[0]["role"] == "system" and not self._has_system_role():
            system, first, *rest = messages
            folded = f"{system['content']}\n\n{first['content']}" if system["content"] else first
            messages = [{"role": "user", "content": folded}, *rest]
        return messages

    def _has_system_role(self) -> bool:
        """Whether the template writes a system message (some refuse it or drop it)."""
        marker = "\x00mtp-system-text\x00"
        conversation = [{"role": "system", "content": marker}, {"role": "user", "content": "hi"}]
        try:
            return marker in self.apply_chat_template(conversation)
        except UserError:  # the template raised, e.g. "System role not supported"
            return False

    def _encode_chat(self, messages: list[dict], parse_special: bool) -> list[int]:
        text = self.apply_chat_template(messages)
        contents = [m["content"] for m in messages]
        if parse_special or not any(self._holds_special(c) for c in contents):
            ids = self.encode(text)
        else:
            ids = self._encode_template_specials_only(text, self._message_spans(text, messages))
        return self._with_bos(ids)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def _holds_special(self, text: str) -> bool:
        return any(token in text for token in self._special_tokens().values())

    def _encode_template_specials_only(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """`text`, the template rendered around messages that lie at `spans`, with the special
        tokens the template wrote kept and those inside the messages encoded as text.

        Runs of text between special tokens are encoded apart, as `tokenizers` does anyway, so
        everything outside the messages' special tokens encodes as in `encode(text)`.
        """
        special = self._special_tokens()
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        done = 0
        for token, (begin, stop) in zip(encoding.ids, encoding.offsets, strict=True):
            inside = any(begin < end and stop > start for start, end in spans)
            if token in special and not inside:  # the template's own
                ids += self._encode_plain(text[done:begin]) + [token]
                done = stop
        return ids + self._encode_plain(text[done:])

    def _message_spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]]:
        """Where each message's text lies in `text`, the chat template rendered around them."""
        markers = [f"\x00mtp-message-{i}\x00" for i in range(len(messages))]
        framed = self.apply_chat_template(
            [{**m, "content": marker} for m, marker in zip(messages, markers, strict=True)]
        )
        pieces, rest = [], framed
        for marker in markers:
            piece, found, rest = rest.partition(marker)
            if not found or marker in rest:
                pieces = None
                break
            pieces.append(piece)
        spans, at = [], 0
        for i, message in enumerate(messages if pieces is not None else []):
            after = pieces[i + 1] if i + 1 < len(pieces) else rest
            if not text.startswith(pieces[i], at):
                break
            at += len(pieces[i])
            for content in (message["content"], message["content"].strip()):  # may be trimmed
                if text.startswith(content, at) and text.startswith(after, at + len(content)):
                    spans.append((at, at + len(content)))
                    at += len(content)
                    break
            else:
                break
        if pieces is not None and len(spans) == len(messages) and text[at:] == rest:
            return spans
        typed = next(
            t for m in messages for t in self._special_tokens().values() if t in m["content"]
        )
        raise UserError(
            f"the prompt holds special tokens such as {typed!r} and the chat template changes "
            "the message, so they cannot be kept as text: remove them, or parse them as special "
            "tokens (--parse-special)"
        )

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
        """Read back what `save` wrote (a bundle's tokenizer)."""
        directory = Path(directory)
        meta_file, backend_file = directory / META_FILE, directory / "tokenizer.json"
        for file in (meta_file, backend_file):
            if not file.is_file():
                raise UserError(
                    f"{file} is missing: the bundle is incomplete; re-export it with mtp-export"
                )
        try:
            meta = json.loads(meta_file.read_text())
        except (ValueError, OSError) as e:
            raise UserError(f"{meta_file} is not valid json ({e}): re-export the bundle") from None
        try:
            backend = Backend.from_file(str(backend_file))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise UserError(
                f"cannot read {backend_file} ({_one_line(e)}): re-export the bundle"
            ) from None
        try:
            return cls(
                backend,
                vocab_size=int(meta["vocab_size"]),
                bos_id=meta["bos_id"],
                eos_ids=[int(i) for i in meta["eos_ids"]],
                add_bos=bool(meta["add_bos"]),
                chat_template=meta["chat_template"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"{meta_file} is incomplete or damaged ({type(e).__name__}: {e}): re-export the "
                "bundle"
            ) from None

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
            raise UserError(f"cannot read {path / 'tokenizer.json'}: {_one_line(e)}") from None
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

        def field(key: str, kind: type | tuple, default=None, array: bool = False):
            return gguf_field(reader, key, kind, default, array)

        kind = field("tokenizer.ggml.model", str)
        tokens = field("tokenizer.ggml.tokens", str, array=True)
        if kind is None or not tokens:
            raise UserError("the GGUF file has no tokenizer: it needs tokenizer.ggml.* metadata")
        types = field("tokenizer.ggml.token_type", int, array=True) or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise UserError(
                f"the GGUF file has {len(tokens)} tokens but {len(types)} token types: it is "
                "corrupt"
            )

        def token_id(key: str, default=None) -> int | None:
            value = field(key, int, default)
            if value is not None and not 0 <= value < len(tokens):
                raise UserError(
                    f"the GGUF field {key} is {value}, outside the {len(tokens)} tokens: the "
                    "file is corrupt"
                )
            return value

        pre = field("tokenizer.ggml.pre", str) or "default"
        try:
            if kind == "gpt2":
                merges = field("tokenizer.ggml.merges", str, array=True) or []
                backend = _byte_level_bpe(tokens, merges, pre)
            elif kind == "llama":
                scores = field("tokenizer.ggml.scores", (float, int), array=True)
                if scores is not None and len(scores) != len(tokens):
                    raise UserError(
                        f"the GGUF file has {len(tokens)} tokens but {len(scores)} scores: it is "
                        "corrupt"
                    )
                backend = _sentencepiece_bpe(
                    tokens,
                    scores,
                    types,
                    unk_token=tokens[token_id("tokenizer.ggml.unknown_token_id", 0)],
                    add_space_prefix=field("tokenizer.ggml.add_space_prefix", bool, True),
                )
            else:
                raise UserError(
                    f"GGUF tokenizer model '{kind}' is not supported: supported are gpt2 "
                    "(byte-level BPE) and llama (SentencePiece BPE)"
                )
            _add_gguf_special_tokens(backend, tokens, types)
        except Exception as e:
            if type(e) is not Exception:  # tokenizers' own errors are bare Exceptions
                raise
            raise UserError(
                f"the GGUF tokenizer cannot be built ({_one_line(e)}): the file is corrupt"
            ) from None

        eos_ids = [
            token_id("tokenizer.ggml.eos_token_id"),
            token_id("tokenizer.ggml.eot_token_id"),
            token_id("tokenizer.ggml.eom_token_id"),
        ]
        eos_ids += [
            i for i, t in enumerate(tokens) if types[i] == _CONTROL and t in _END_OF_TURN_TOKENS
        ]
        # Without the flag llama.cpp adds bos for SentencePiece and Llama-3 vocabularies.
        bos_by_default = kind == "llama" or _GGUF_PRE_TOKENIZERS.get(pre) == "llama3"
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_ids=[i for i in eos_ids if i is not None],
            add_bos=bool(field("tokenizer.ggml.add_bos_token", bool, bos_by_default)),
            chat_template=field("tokenizer.chat_template", str),
        )


ROLES = ("system", "user", "assistant")


def check_messages(messages) -> list[dict]:
    """A conversation as chat templates expect it, or a UserError saying what is wrong: an
    optional system message first, then user and assistant turns alternating, the user's last
    (the model answers it); every content a text, the user's not empty."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("the conversation is empty: give at least one user message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise UserError(f"message {i} must be a dict with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise UserError(f"message {i} has role {role!r}: the roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise UserError(f"message {i}: the content must be text, got {type(content).__name__}")
        _check_utf8(content, f"message {i}")
        checked.append({"role": role, "content": content})
    first_turn = 1 if checked[0]["role"] == "system" else 0
    for i, message in enumerate(checked[first_turn:], first_turn):
        expected = "user" if (i - first_turn) % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise UserError(
                f"message {i} has role {message['role']} where {expected} belongs: a system "
                "message may come first, then user and assistant messages alternate"
            )
        if expected == "user" and not message["content"].strip():
            raise UserError(f"message {i}: the user message is empty")
    if checked[-1]["role"] != "user":
        raise UserError("the last message must be the user's: the model answers it")
    return checked


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path} is not valid json ({e}): fix or delete it") from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _check_utf8(text: str, what: str) -> None:
    """Refuse text that is not Unicode throughout: argv bytes that are not UTF-8 reach Python
    as lone surrogates (U+DC80..U+DCFF stand for the bytes 0x80..0xFF), which no tokenizer
    takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what_is_wrong = (
            f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        )
        raise UserError(
            f"{what} is not valid UTF-8 text ({what_is_wrong} at character {e.start}): give it "
            "as UTF-8 (check the encoding of the terminal or file it came from)"
        ) from None


def gguf_field(reader, key: str, kind: type | tuple, default=None, array: bool = False):
    """A GGUF metadata value, checked to be `kind` (or a list of `kind` with array=True): a
    damaged file can hold anything, and that must fail here, not deep in a parser."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except (ValueError, IndexError) as e:  # e.g. a string that is not UTF-8
        raise UserError(f"the GGUF field {key} cannot be read ({e}): the file is corrupt") from None
    if array:
        ok = isinstance(value, list) and all(isinstance(v, kind) for v in value)
    else:
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if not ok:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        expected = " or ".join(k.__name__ for k in kinds)
        raise UserError(
            f"the GGUF field {key} holds {type(value).__name__}, not "
            f"{'a list of ' if array else ''}{expected}: the file is corrupt"
        )
    return value


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
