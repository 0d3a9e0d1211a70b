"""The Python API: what the commands do, as functions a program can call.

    import mtp_edge
    llm = mtp_edge.load("default")          # a HF directory, a .gguf file, or bundle="DIR"
    print(llm.generate("Write a haiku.", max_new_tokens=64).text)
    for chunk in llm.stream_chat([{"role": "user", "content": "Hello!"}]):
        print(chunk.text, end="", flush=True)

A `Model` remembers which tokens its target's static KV cache holds. Every call (generate,
stream, chat) prefills only what follows the longest prefix the new prompt shares with them, so
the next turn of a conversation costs in proportion to the new turn, not to the conversation.
Output is what a fresh model would give (the cache holds exactly those tokens' K/V).

One call at a time: calls from several threads wait for each other, a stream for as long as it
is open (until its last chunk, or until it is closed or dropped). Starting a call ends a stream
the same thread left open. `close()`, or leaving a `with mtp_edge.load(...) as llm:` block,
frees the model. Every argument is checked before any work, with the commands' ranges
(mtp_edge/limits.py).

Lower level: `assemble(LoadOptions(...))` returns a ready `Generator` (runtime/assemble.py) and
`generate` / `decode` (runtime/loop.py) run the loop on it; `export(ExportOptions(...))` writes a
bundle, checking the exported programs through the runtime of their platform.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtp_edge.devices.acceptance import measure_bundle_acceptance
from mtp_edge.errors import ContextFull, UserError
from mtp_edge.exporter.pipeline import ExportOptions, export_bundle
from mtp_edge.limits import check, check_stop
from mtp_edge.manifest import Manifest
from mtp_edge.platforms import platform
from mtp_edge.request_log import RequestLog, raw_message, raw_prompt_ids
from mtp_edge.runtime.assemble import Generator, LoadOptions, assemble, parse_ngram_sizes
from mtp_edge.runtime.backends import backend
from mtp_edge.runtime.loop import (
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    check_prompt,
    decode,
    generate,
)
from mtp_edge.runtime.sampling import SamplingParams
from mtp_edge.texts import heldout_text

__all__ = [
    "Chunk",
    "Completion",
    "ContextFull",
    "ExportOptions",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "LoadOptions",
    "Model",
    "assemble",
    "decode",
    "export",
    "generate",
    "load",
]


@dataclass
class Completion:
    text: str  # cut before a stop string
    token_ids: list[int]  # generated (an eos left out; the tokens of a stop string kept)
    finish_reason: str  # eos | stop_string | max_tokens | context_full
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V were still in the cache (not prefilled)
    stats: GenerationStats

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "stats": self.stats.to_dict(),
        }


@dataclass
class Chunk:
    """A piece of a stream: the text that became final since the previous chunk."""

    text: str  # never a partial UTF-8 character, never text a stop string may still cut
    token_ids: list[int]  # the tokens generated since the previous chunk
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None = None  # set on the last chunk
    stats: GenerationStats | None = None  # set on the last chunk


def load(model: str | Path = "default", *, bundle: str | Path | None = None, **options) -> Model:
    """A model ready to generate: `model` (HF directory, .gguf file or "default", on the eager
    backend) or an exported `bundle` (with its own drafter unless `drafter=` says otherwise).
    Keyword options are LoadOptions' fields: drafter, k, heads, adaptive_k, fallback, ngram_sizes,
    draft_confidence, max_seq_len, chat, threads, parse_special, adapt. Each is checked before
    anything loads (a UserError saying what is wrong).

    `adapt=True` (MTP heads only) lets the heads learn from what the target verifies, between
    requests, within 10% of generation time (runtime/adapt.py); output is unchanged, drafts
    improve on the traffic served. `Model.save_heads(PATH)` writes the adapted heads.

    `log=DIR` appends every request to a local request log (mtp_edge/request_log.py: its
    messages, the answer's token ids and its tau), the text `mtp-train --prompts DIR` trains
    heads on; nothing is written without it."""
    log = options.pop("log", None)
    if log is not None and not isinstance(log, _PATH):
        raise UserError(f"log takes a folder path, got {type(log).__name__}")
    request_log = RequestLog(log) if log is not None else None
    return Model(assemble(load_options(model, bundle, options)), log=request_log)


_PATH = (str, Path)
# The load options that are not numbers (those are in mtp_edge/limits.py): their types, and
# whether None (the bundle's choice, or the default) is allowed.
_LOAD_TYPES = {
    "drafter": (str, True),
    "heads": (_PATH, True),
    "adaptive_k": (bool, False),
    "adapt": (bool, False),
    "fallback": (bool, True),
    "ngram_sizes": (str, True),
    "chat": (bool, False),
    "parse_special": (bool, False),
}
_LOAD_NONE = {"k", "draft_confidence"}  # numbers that may be None (the bundle's, or default)


def load_options(model, bundle, options: dict) -> LoadOptions:
    """`load()`'s arguments as LoadOptions, every one checked (nothing is loaded yet)."""
    allowed = {f.name for f in dataclasses.fields(LoadOptions)} - {"model", "bundle"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"load() got unknown options {unknown}; it takes {sorted(allowed)}")
    if not isinstance(model, _PATH) or not str(model):
        raise UserError(f'model must be a path or "default", got {model!r}')
    if bundle is not None and (not isinstance(bundle, _PATH) or not str(bundle)):
        raise UserError(f"bundle must be a path (a bundle directory), got {bundle!r}")
    checked = {}
    for name, value in options.items():
        if name in _LOAD_TYPES:
            kind, optional = _LOAD_TYPES[name]
            if not (isinstance(value, kind) or (optional and value is None)):
                names = kind.__name__ if isinstance(kind, type) else "a path"
                names += " or None" if optional else ""
                raise UserError(f"{name} must be {names}, got {value!r}")
            checked[name] = str(value) if name == "heads" and value is not None else value
        elif value is None and name in _LOAD_NONE:
            checked[name] = None
        else:
            checked[name] = check(name, value)
    if checked.get("ngram_sizes") is not None:
        try:
            parse_ngram_sizes(checked["ngram_sizes"])
        except UserError:
            raise UserError(
                f"ngram_sizes takes 'MIN-MAX' such as '1-3', got {checked['ngram_sizes']!r}"
            ) from None
    path = None if bundle is None else str(bundle)
    return LoadOptions(model=str(model), bundle=path, **checked)


def check_sampling(
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: str | Sequence[str] = (),
) -> dict:
    """The sampling keywords of generate/stream/chat, checked and converted (the ranges are the
    commands'), as keyword arguments."""
    return dict(
        max_new_tokens=check("max_new_tokens", max_new_tokens),
        temperature=check("temperature", temperature),
        top_k=check("top_k", top_k),
        top_p=check("top_p", top_p),
        seed=check("seed", seed),
        stop=check_stop(stop),
    )


class Model:
    """A loaded target with its drafter, and the tokens its KV cache holds. It serves one call
    at a time: calls from other threads wait for the running one, a stream until it is finished,
    closed or dropped. A context manager: `with mtp_edge.load(...) as llm:` closes it."""

    def __init__(self, generator: Generator, log: RequestLog | None = None):
        self._generator: Generator | None = generator
        self._log = log  # where each request is appended (opt-in)
        self._cache: list[int] = []  # the tokens whose K/V the target's cache holds, in order
        self._open: weakref.ref[Stream] | None = None  # a stream not yet finished
        self._lock = threading.RLock()  # held by a call, or by a stream computing a chunk
        self._stream_ends = threading.Condition(self._lock)
        if log is not None and generator.adapter is not None:
            self._seed_store(log)

    def _seed_store(self, log: RequestLog) -> None:
        """An adapting model drafts from the answers its request log kept (the newest that fit
        the store): a restarted server keeps what it learned of its requests."""
        from mtp_edge.request_log import read_log

        vocab = self._generator.session.vocab_size
        store = self._generator.adapter.store
        for record in read_log(log.directory):
            if not record.answer_ids or max(record.answer_ids) >= vocab:
                continue  # nothing answered, or another model's tokens
            prompt = self._logged_prompt_ids(record.messages)
            store.add(prompt + record.answer_ids, len(prompt))

    def _logged_prompt_ids(self, messages: list[dict]) -> list[int]:
        """A logged request's prompt as it was encoded (a raw prompt as its ids, or plain text,
        else through the chat template); nothing where it cannot be encoded here."""
        tokenizer = self.tokenizer
        try:
            if len(messages) == 1 and messages[0].get("raw"):
                ids = raw_prompt_ids(tokenizer, messages[0])
                vocab = self._generator.session.vocab_size
                return ids if all(i < vocab for i in ids) else []  # another model's ids
            if tokenizer.chat_template is not None:
                return tokenizer.encode_messages(messages)
        except UserError:
            pass
        return []

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End an open stream and free the model (its weights, sessions and cache); a call
        afterwards is an error. Closing twice is fine."""
        with self._lock:
            self._take_turn()
            self._generator = None
            self._cache = []

    @property
    def closed(self) -> bool:
        return self._generator is None

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            raise UserError("this model is closed: load it again (mtp_edge.load)")
        return self._generator

    @property
    def name(self) -> str:
        return self.generator.name

    @property
    def tokenizer(self):
        return self.generator.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self.generator.session.max_seq_len

    @property
    def eos_ids(self) -> list[int]:
        return list(self.tokenizer.eos_ids)

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens whose K/V the cache holds now (the next call reuses their shared start)."""
        return list(self._cache)

    def reset(self) -> None:
        """Forget the cached conversation: the next call prefills its whole prompt."""
        with self._lock:
            self._take_turn()
            self._cache = []

    def generate(self, prompt: str | Sequence[int], **sampling) -> Completion:
        """Generate from `prompt` (text, in the chat template unless loaded with chat=False,
        or token ids). Sampling: max_new_tokens=128, temperature=0.0 (greedy), top_k=0,
        top_p=1.0, seed=0, stop=() (strings that end the text, left out of it)."""
        settings = check_sampling(**sampling)
        with self._lock:
            ids = self._prompt_ids(prompt)
            return self._complete(self._chunks(ids, settings, self._logged(prompt, ids)))

    def stream(self, prompt: str | Sequence[int], **sampling) -> Iterator[Chunk]:
        """`generate`, as chunks of text as soon as they are final; stop it by closing the
        iterator (or leaving the loop over it)."""
        settings = check_sampling(**sampling)
        with self._lock:
            ids = self._prompt_ids(prompt)
            return self._chunks(ids, settings, self._logged(prompt, ids))

    def chat(self, messages: list[dict], **sampling) -> Completion:
        """The assistant's answer to `messages` ({"role": system|user|assistant, "content"}),
        rendered with the model's chat template; the conversation's cached start is reused."""
        settings = check_sampling(**sampling)
        with self._lock:
            return self._complete(self._chunks(self._message_ids(messages), settings, messages))

    def stream_chat(self, messages: list[dict], **sampling) -> Iterator[Chunk]:
        """`chat`, as a stream of chunks."""
        settings = check_sampling(**sampling)
        with self._lock:
            return self._chunks(self._message_ids(messages), settings, messages)

    @property
    def adaptation(self) -> dict | None:
        """With adapt=True: pairs learned from, optimizer steps, their time and its share of
        generation time; else None."""
        adapter = self.generator.adapter
        return None if adapter is None else adapter.report()

    def save_heads(self, path: str | Path) -> Path:
        """Write the adapted MTP heads to `path` (.safetensors): the correction folded into the
        heads' output layer, a heads file that `--heads` and `mtp-export --heads` take."""
        with self._lock:
            self._take_turn()
            adapter = self.generator.adapter
            if adapter is None:
                raise UserError("save_heads needs a model loaded with adapt=True")
            return adapter.save(path)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.generator.encode(prompt)
        if isinstance(prompt, bytes | bytearray | memoryview):
            raise UserError(
                "the prompt is bytes: give text (prompt.decode('utf-8')) or a list of token ids"
            )
        vocab = self.generator.session.vocab_size
        try:
            ids = [operator.index(i) for i in prompt]  # ints, numpy's and torch's included
        except TypeError:
            ids = [-1]
        if not all(0 <= i < vocab for i in ids):
            raise UserError(f"a prompt of token ids takes ints in 0..{vocab - 1}")
        return ids

    def _logged(self, prompt, ids: list[int]) -> list[dict] | None:
        """What the request log keeps of a prompt: one user message (marked raw where the chat
        template was not applied, or the prompt came as token ids, and then read back as the
        same ids: raw_message)."""
        if self._log is None:
            return None
        if isinstance(prompt, str) and self.generator.chat:
            return [{"role": "user", "content": prompt}]
        return [raw_message(self.tokenizer, ids, prompt if isinstance(prompt, str) else None)]

    def _message_ids(self, messages) -> list[int]:
        return self.tokenizer.encode_messages(messages, self.generator.parse_special)

    def _config(
        self, max_new_tokens, temperature, top_k, top_p, seed, stop: tuple[str, ...]
    ) -> GenerationConfig:
        """The generator's config with the call's settings (checked by check_sampling)."""
        return dataclasses.replace(
            self.generator.config,
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature, top_k, top_p, seed),
            stop_strings=stop,
        )

    def _chunks(
        self, ids: list[int], sampling: dict, messages: list[dict] | None = None
    ) -> Iterator[Chunk]:
        """Check everything now (errors belong to the call, not to the first chunk), then
        return the stream. `messages`: the request as the log keeps it."""
        config = self._config(**sampling)
        check_prompt(ids, self.max_seq_len)  # the loop's own check, now rather than at a step
        self._take_turn()
        logged = list(messages) if self._log is not None and messages is not None else None
        stream = Stream(self._stream(ids, config, logged), self._lock)
        self._open = weakref.ref(stream)  # a stream its reader drops closes itself
        return stream

    def _stream(
        self, ids: list[int], config: GenerationConfig, logged: list[dict] | None = None
    ) -> Iterator[Chunk]:
        gen = self.generator
        keep = shared_prefix(self._cache, ids[:-1])  # the last prompt token is always fed
        self._cache = self._cache[:keep]  # the call writes from `keep` on
        text = StreamText(gen.tokenizer.decode, config.stop_strings)
        steps = decode(gen.session, ids, gen.drafter, config, gen.tokenizer.decode, cached=keep)
        generated: list[int] = []
        stats = None
        try:
            for step in steps:
                generated += step.tokens
                self._cache = (ids + generated)[: step.cache_len]
                last = step.stop_reason is not None
                piece = text.finish(generated) if last else text.feed(generated)
                stats = step.stats
                if last and logged is not None and self._log is not None:
                    self._log.append(logged, generated, step.stats.tau, step.stop_reason, gen.name)
                yield Chunk(
                    piece, step.tokens, len(ids), keep, step.stop_reason, stats if last else None
                )
        except GeneratorExit:
            raise  # closed by its reader: the cache record is that of the last step
        except BaseException:
            self._cache = []  # stopped inside a step: trust nothing the step may have written
            raise
        finally:
            steps.close()  # lets the drafter take in the last verified step
            if gen.adapter is not None and stats is not None:  # learn, within its time share
                seconds = stats.ttft_ms / 1e3 + stats.decode_seconds
                gen.adapter.after_request(seconds, ids + generated, len(ids))
            with self._lock:
                self._open = None
                self._stream_ends.notify_all()

    def _take_turn(self) -> None:
        """Called holding the lock, before a call starts: end this thread's open stream (a new
        call ends it), or wait until another thread's has ended (or been closed or dropped)."""
        while self._open is not None:
            stream = self._open()
            if stream is None:  # dropped, and already closed by its finalizer
                self._open = None
            elif stream.thread == threading.get_ident():
                stream.close()
            else:
                del stream  # waiting must not keep it alive: dropped, it closes itself
                self._stream_ends.wait()

    @staticmethod
    def _complete(chunks: Iterator[Chunk]) -> Completion:
        text, tokens = [], []
        for chunk in chunks:
            text.append(chunk.text)
            tokens += chunk.token_ids
        return Completion(
            "".join(text),
            tokens,
            chunk.finish_reason,
            chunk.prompt_tokens,
            chunk.cached_tokens,
            chunk.stats,
        )


class Stream(Iterator[Chunk]):
    """A model's stream of chunks: computing a chunk, or closing, holds the model's lock, so that
    another thread's call waits for the chunk instead of breaking into it."""

    def __init__(self, chunks: Iterator[Chunk], lock: threading.RLock):
        self._chunks, self._lock = chunks, lock
        self.thread = threading.get_ident()  # a new call from this thread ends the stream

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        with self._lock:
            chunk = next(self._chunks)
            if chunk.finish_reason is not None:  # the last: the model is free for other calls
                self._chunks.close()
            return chunk

    def close(self) -> None:
        """Stop generating (the model keeps what the steps so far wrote in its cache)."""
        with self._lock:
            self._chunks.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the lock may be gone
            pass


class StreamText:
    """Turns the tokens generated so far into the text that is final: a trailing incomplete
    UTF-8 character waits for its other bytes, and text that may be the start of a stop string
    waits until it is not (the stop string and what follows it are never shown)."""

    def __init__(self, detokenize: Callable[[list[int]], str], stop_strings: tuple[str, ...]):
        self.detokenize = detokenize
        self.stop_strings = stop_strings
        self.sent = 0  # characters already given out

    def feed(self, tokens: list[int]) -> str:
        text = cut_at_stop(self.detokenize(tokens), self.stop_strings)
        ready = len(text.rstrip("\ufffd")) - held_back(text, self.stop_strings)
        piece = text[self.sent : ready]
        self.sent = max(self.sent, ready)
        return piece

    def finish(self, tokens: list[int]) -> str:
        """The rest of the final text."""
        return cut_at_stop(self.detokenize(tokens), self.stop_strings)[self.sent :]


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """`text` up to the earliest stop string in it."""
    cuts = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return text[: min(cuts)] if cuts else text


def held_back(text: str, stop_strings: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin a stop string."""
    longest = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def export(
    options: ExportOptions, out: str | Path | None = None, progress: Callable[[str], None] = print
) -> tuple[Path, Manifest]:
    """Quantize and export `options.model` (and its drafter) into a bundle directory."""

    def open_program(path: Path, max_seq_len: int):
        """The exported target's forward -> logits, for the quality report (None: cannot run
        here)."""
        session = backend(platform(options.platform).backend).open_program(
            path, max_seq_len, options.max_chunk
        )
        if session is None:
            return None
        return lambda tokens, start: session.forward(tokens, start).logits

    def measure(directory: Path, target, draft) -> dict:
        heldout = target.tokenizer.encode(heldout_text())
        return measure_bundle_acceptance(directory, target, draft, heldout, progress)

    out_path = Path(out) if out else None
    if options.quant == "auto":  # each scheme exported, then timed here (exporter/choose.py)
        from mtp_edge.exporter.choose import export_auto

        runs_here = backend(platform(options.platform).backend).available()
        timer = auto_timer(progress) if runs_here else None
        return export_auto(options, out_path, open_program, progress, measure, timer)
    return export_bundle(options, out_path, open_program, progress=progress, measure=measure)


def auto_timer(progress: Callable[[str], None]):
    """--quant auto's timer (exporter/choose.py's Timer): plain and speculative decoding of
    each (bundle, k) setup over a short part of the built-in suite (the first prompts of each
    category that fit the bundles' context with their answers), as `mtp-bench --compare`
    measures them (a worker process per setup, prompts in turn), without peer baselines."""

    def time_setups(setups: list[tuple[Path, int]], plan) -> tuple[list[dict], int]:
        from mtp_edge.devices.bench_setups import Stopped, bench
        from mtp_edge.devices.harness import load_prompts
        from mtp_edge.runtime.bundle import open_bundle

        first = open_bundle(setups[0][0])  # the candidates share tokenizer and context
        room = first.manifest.max_seq_len - plan.max_new_tokens - max(k for _, k in setups) - 1
        taken: dict[str, int] = {}
        prompts = []
        for p in load_prompts():
            fits = len(first.tokenizer.encode_prompt(p.prompt)) <= room
            if fits and taken.get(p.category, 0) < plan.per_category:
                taken[p.category] = taken.get(p.category, 0) + 1
                prompts.append(p)
        if not prompts:
            raise UserError(
                f"--quant auto times the candidates on the built-in prompts, and none fits a "
                f"context of {first.manifest.max_seq_len} with its answer: export with a "
                "longer -c, or choose the scheme with --quant"
            )
        loads = [LoadOptions(bundle=str(directory), k=k) for directory, k in setups]
        command = "mtp-export --quant auto (timing its candidates)"
        try:
            reports = bench(
                loads, prompts, plan.repeat, plan.max_new_tokens, command, progress, peer=False
            )
        except Stopped as stop:  # an export stopped midway keeps nothing
            raise stop.cause from None
        return [r["summary"] for r in reports], len(prompts)

    return time_setups
