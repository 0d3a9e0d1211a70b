"""An OpenAI-compatible HTTP server for one loaded model: what `mtp-serve` runs.

The model is not thread-safe and keeps one KV cache (a chat that extends the previous one reuses
its prefix), so one worker thread runs the requests one at a time, in arrival order. At most
`max_queue` wait behind the running one; any more are refused at once with 503, so that a burst
cannot pile up minutes of waiting. The event loop only parses, queues and streams, so /health
answers during a generation. A client that goes away stops its generation at the next chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from mtp_edge.errors import Fault, UserError
from mtp_edge.limits import check, check_stop

log = logging.getLogger("mtp_edge.server")

# Fields of OpenAI's API this server does not implement. Each is refused with 400, unless sent
# with a value that means "not used" (which some clients send by default).
UNSUPPORTED = {
    "n": "several choices per request (n > 1)",
    "best_of": "best_of > 1",
    "logprobs": "logprobs",
    "top_logprobs": "logprobs",
    "echo": "echo",
    "suffix": "suffix (insertion)",
    "tools": "tools",
    "tool_choice": "tools",
    "functions": "functions",
    "function_call": "functions",
    "logit_bias": "logit_bias",
    "response_format": "response_format other than text",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def _unused(name: str, value: Any) -> bool:
    """Whether `value` of the unsupported field `name` asks for nothing."""
    if value is None or value is False or (isinstance(value, list | dict | str) and not value):
        return True
    if name in ("n", "best_of"):
        return type(value) is int and value == 1
    if name in ("presence_penalty", "frequency_penalty", "top_logprobs"):
        return type(value) in (int, float) and value == 0
    if name == "tool_choice":
        return value == "none"
    if name == "response_format":
        return value == {"type": "text"}
    return False


@dataclass
class Defaults:
    """What a request that does not say gets (mtp-serve's sampling flags)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        kind = {404: "not_found_error", 503: "unavailable_error"}.get(self.status, kind)
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _api_error(exc: BaseException) -> ApiError:
    """What the client is told when the model's call raised `exc`."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UserError):
        return ApiError(400, str(exc))
    if isinstance(exc, Fault):
        return ApiError(500, str(exc))
    log.error("generation failed", exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}): see the server's log")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Sampling(_Strict):
    """The sampling fields: their types checked by pydantic, their ranges by `settings` with
    mtp_edge/limits.py (the commands' and the Python API's ranges), naming the field."""

    model: str | None = None  # accepted: the server has one model
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension, as llama.cpp's and vLLM's
    seed: int | None = None
    stop: Any = None  # a text or a list of texts
    stream: bool = False
    stream_options: dict | None = None

    def settings(self, defaults: Defaults) -> dict:
        """The keyword arguments of the model's generate/stream calls, every field checked."""

        def field(name: str, setting: str, default):
            value = getattr(self, name)
            if value is None:
                return default
            try:
                return check(setting, value, name)
            except UserError as e:
                raise ApiError(400, str(e), name) from None

        try:
            stop = defaults.stop if self.stop is None else check_stop(self.stop)
        except UserError as e:
            raise ApiError(400, str(e), "stop") from None
        max_tokens = field("max_tokens", "max_new_tokens", defaults.max_tokens)
        return dict(
            max_new_tokens=field("max_completion_tokens", "max_new_tokens", max_tokens),
            temperature=field("temperature", "temperature", defaults.temperature),
            top_k=field("top_k", "top_k", defaults.top_k),
            top_p=field("top_p", "top_p", defaults.top_p),
            seed=field("seed", "seed", defaults.seed),
            stop=tuple(stop),
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None  # a text or a list of text parts; checked in `text`

    def text(self, index: int) -> str:
        param = f"messages.{index}.content"
        if isinstance(self.content, str):
            return self.content
        if isinstance(self.content, list):
            if all(isinstance(p, dict) and p.get("type") == "text" for p in self.content):
                if all(isinstance(p.get("text"), str) for p in self.content):
                    return "".join(p["text"] for p in self.content)
            raise ApiError(400, f"{param}: only text parts are supported", param)
        raise ApiError(400, f"{param} must be a text or a list of text parts", param)


class _ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)

    def conversation(self) -> list[dict]:
        # "developer" is the newer name OpenAI gives the system role
        roles = {"developer": "system"}
        return [
            {"role": roles.get(m.role, m.role), "content": m.text(i)}
            for i, m in enumerate(self.messages)
        ]


class _CompletionRequest(_Sampling):
    prompt: Any  # a text, a list of token ids, or a list of one text

    def prompt_value(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt is empty: give at least one character", "prompt")
            return prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        raise ApiError(
            400, "prompt must be a non-empty text or list of token ids (one prompt only)", "prompt"
        )


async def _read(request: Request, model: type[_Sampling]) -> _Sampling:
    """The request's JSON body as `model`, or an ApiError that says what is wrong."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for name, feature in UNSUPPORTED.items():
        if not _unused(name, body.get(name)):
            raise ApiError(400, f"{feature} is not supported by this server", name)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(p) for p in first["loc"])
        where = f"{path}: " if path else ""
        raise ApiError(
            400, f"{where}{first['msg']}", str(first["loc"][0]) if path else None
        ) from None


class ModelQueue:
    """Runs calls on the model on one thread, in arrival order; refuses more than `max_queue`
    waiting behind the running one."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.stopping = threading.Event()  # the server shuts down: end generations now
        self.cancelled = 0  # generations stopped because their client went away
        self.generated_tokens = 0  # by all generations so far
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mtp-serve-model")
        self._lock = threading.Lock()
        self._admitted = 0  # running + waiting

    @property
    def admitted(self) -> int:
        return self._admitted

    def submit(self, job: Callable[[], Any]) -> asyncio.Future:
        with self._lock:
            if self._admitted > self.max_queue:
                raise ApiError(
                    503,
                    f"the server is busy: {self.max_queue} requests already wait for the model; "
                    "retry shortly",
                    headers={"Retry-After": "1"},
                )
            self._admitted += 1

        def run():
            try:
                if self.stopping.is_set():
                    raise ApiError(503, "the server is shutting down")
                return job()
            finally:
                with self._lock:
                    self._admitted -= 1

        return asyncio.wrap_future(self._thread.submit(run))

    def shutdown(self) -> None:
        self.stopping.set()
        self._thread.shutdown(wait=False, cancel_futures=True)


_END = object()


class _Generation:
    """One generation: the worker thread runs the model's chunk iterator and hands each chunk to
    the event loop; `cancel()` makes the worker close the iterator at the next chunk, which stops
    the generation at once."""

    def __init__(self, queue: ModelQueue, start: Callable[[], Iterator]):
        self.queue = queue
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False  # its last chunk, an error or _END was read
        loop = asyncio.get_running_loop()

        def post(event) -> None:
            loop.call_soon_threadsafe(self.events.put_nowait, event)

        def job():
            chunks = None
            try:
                if self.cancelled.is_set():  # the client left while waiting
                    return
                chunks = start()
                for chunk in chunks:
                    queue.generated_tokens += len(chunk.token_ids)
                    post(chunk)
                    if self.cancelled.is_set() or queue.stopping.is_set():
                        break
            except Exception as e:  # handed to the client as an error
                post(e)
            finally:
                if chunks is not None:
                    chunks.close()
                post(_END)

        queue.submit(job).add_done_callback(self._refused)

    def _refused(self, future: asyncio.Future) -> None:
        """The queue did not run the job (the server stops): say so to the reader."""
        if future.cancelled() or future.exception() is not None:
            error = None if future.cancelled() else future.exception()
            self.events.put_nowait(error or ApiError(503, "the server is shutting down"))
            self.events.put_nowait(_END)

    def cancel(self) -> None:
        """Stop the generation if it still runs (its client has left)."""
        if not self.finished and not self.cancelled.is_set():
            self.cancelled.set()
            self.queue.cancelled += 1

    async def next(self):
        """The next chunk, an exception, or _END."""
        event = await self.events.get()
        # after the last chunk or an error the worker only closes the iterator
        self.finished = getattr(event, "finish_reason", "ended") is not None
        return event


async def _cancel_when_gone(request: Request, generation: _Generation) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()


def _stats(stats) -> dict:
    """The speculative decoding figures of a generation (tau, acceptance, tokens/s), in an extra
    field that OpenAI's clients ignore."""
    return {} if stats is None else stats.to_dict()


def _finish_reason(reason: str) -> str:
    return "length" if reason in ("max_tokens", "context_full") else "stop"


def _usage(last, completion_tokens: int) -> dict:
    """OpenAI's usage of a generation whose last chunk is `last`; cached tokens are the prompt's
    start whose KV cache a previous request left (not computed again)."""
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": last.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
    }


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(llm, max_queue: int = 8, model_name: str | None = None, defaults=None) -> FastAPI:
    """The FastAPI app serving `llm` (a loaded model of mtp_edge's API)."""
    defaults = defaults or Defaults()
    name = model_name or llm.name
    created = int(time.time())
    queue = ModelQueue(max_queue)
    app = FastAPI(title="mtp-serve")
    app.state.queue = queue  # the command stops it first when the server shuts down

    def raw(prompt: str | list[int]) -> list[int]:
        """A completion's prompt is plain text, never in the chat template."""
        if isinstance(prompt, list):
            return prompt
        parse_special = llm.generator.parse_special
        return llm.tokenizer.encode_prompt(prompt, chat=False, parse_special=parse_special)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return ApiError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"
        ).response()

    @app.get("/health")
    async def health():
        busy = queue.admitted
        return {
            "status": "ok",
            "model": name,
            "generating": busy > 0,
            "waiting": max(busy - 1, 0),
            "cancelled": queue.cancelled,
            "generated_tokens": queue.generated_tokens,
        }

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "mtp-edge"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _read(request, _ChatRequest)
        messages, settings = req.conversation(), req.settings(defaults)
        reply = _Reply(name, "chat", req)
        return await _answer(queue, request, lambda: llm.stream_chat(messages, **settings), reply)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _read(request, _CompletionRequest)
        prompt, settings = req.prompt_value(), req.settings(defaults)
        reply = _Reply(name, "text", req)
        return await _answer(queue, request, lambda: llm.stream(raw(prompt), **settings), reply)

    return app


class _Reply:
    """OpenAI's response bodies and stream chunks, for chat or text completions."""

    def __init__(self, model: str, kind: Literal["chat", "text"], request: _Sampling):
        self.model, self.kind = model, kind
        self.stream, self.include_usage = request.stream, request.include_usage
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict, stats) -> dict:
        if self.kind == "chat":
            body = self._head("chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=_finish_reason(finish))
        return {**body, "choices": [choice], "usage": usage, "mtp_edge": _stats(stats)}

    def chunk(self, text: str | None, finish: str | None = None, stats=None, role=False) -> dict:
        """One stream chunk; `role` marks the first chunk of a chat."""
        finish_reason = None if finish is None else _finish_reason(finish)
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        body["choices"] = [choice]
        if stats is not None:
            body["mtp_edge"] = _stats(stats)
        return body

    def usage_chunk(self, usage: dict) -> dict:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(name), "choices": [], "usage": usage}


async def _answer(queue: ModelQueue, request: Request, start: Callable[[], Iterator], reply):
    """Run the generation in the worker; answer with one body or a stream of chunks."""
    generation = _Generation(queue, start)
    # Until the stream starts (Starlette watches it then), a client that leaves, waiting in the
    # queue or for its whole answer, cancels its generation.
    watcher = asyncio.ensure_future(_cancel_when_gone(request, generation))
    try:
        first = await generation.next()
        if generation.cancelled.is_set():  # nobody reads an answer
            return Response(status_code=499)
        if isinstance(first, BaseException):  # nothing sent yet: an error status can still be set
            raise _api_error(first)
        if reply.stream:
            stream = _events(generation, first, reply)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await _collect(generation, first, reply)
    finally:
        watcher.cancel()


async def _collect(generation: _Generation, first, reply: _Reply) -> dict | Response:
    """Gather the chunks into one answer."""
    chunk, texts, tokens, last = first, [], 0, None
    while chunk is not _END:
        if isinstance(chunk, BaseException):
            raise _api_error(chunk)
        texts.append(chunk.text)
        tokens += len(chunk.token_ids)
        last = chunk
        chunk = await generation.next()
    if last is None or last.finish_reason is None:  # closed early: the client left or we stop
        return Response(status_code=499 if generation.cancelled.is_set() else 503)
    usage = _usage(last, tokens)
    return reply.whole("".join(texts), last.finish_reason, usage, last.stats)


async def _events(generation: _Generation, first, reply: _Reply):
    """The stream's server-sent events; if the client leaves, Starlette cancels this generator
    and the generation stops at its next chunk."""
    try:
        if reply.kind == "chat":
            yield _sse(reply.chunk(None, role=True))
        chunk, tokens = first, 0
        while chunk is not _END:
            if isinstance(chunk, BaseException):
                yield _sse(_api_error(chunk).body())
                return
            tokens += len(chunk.token_ids)
            if chunk.finish_reason is None:
                if chunk.text:
                    yield _sse(reply.chunk(chunk.text))
            else:
                yield _sse(reply.chunk(chunk.text, chunk.finish_reason, chunk.stats))
                if reply.include_usage:
                    yield _sse(reply.usage_chunk(_usage(chunk, tokens)))
                yield _sse("[DONE]")
                return
            chunk = await generation.next()
        yield _sse(ApiError(503, "the server is shutting down").body())
    finally:
        generation.cancel()


class Server(uvicorn.Server):
    """uvicorn's server for `app`, which says when it accepts requests, and ends generations as
    soon as it starts shutting down (not after its grace period). SIGINT, SIGTERM and SIGHUP
    each start a clean shutdown; `stopped_by` then says which came first, for the command to
    exit with 128 + its number (uvicorn would raise it again, and a handler turn it into 0)."""

    STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, app: FastAPI, on_ready: Callable[[], None]):
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
        super().__init__(config)
        self.queue, self.on_ready = app.state.queue, on_ready
        self.stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            self.on_ready()

    async def shutdown(self, sockets=None):
        self.queue.shutdown()
        await super().shutdown(sockets)
