"""mtp-chat: a conversation in the terminal, its KV cache kept across turns.

Each answer streams as it is verified. Ctrl-C stops the answer, not the program: what was shown
of it stays in the conversation (the cache holds it, so the next turn goes on from there).

Everything the conversation shows (answers, replies to commands, notes such as "[stopped]") goes
to stdout, written and flushed before the next "> " prompt is drawn; stderr, which passes through
the noise filter's process and so may arrive late, carries only errors.
"""

from __future__ import annotations

import signal

import click

from mtp_edge import logs
from mtp_edge.cli.common import (
    OneLineErrors,
    adapt_option,
    check_adapt,
    drafter_options,
    load_options,
    log_option,
    sampling_options,
)
from mtp_edge.errors import UserError
from mtp_edge.request_log import RequestLog
from mtp_edge.tokenizer import _check_utf8 as check_utf8

HELP = """commands:
  /reset   start a new conversation (the system prompt stays)
  /stats   speed and drafting of the last answer
  /save P  write the adapted MTP heads to P (.safetensors; needs --adapt)
  /help    this list
  /exit    quit (also Ctrl-D); Ctrl-C stops an answer"""


@click.command(cls=OneLineErrors)
@drafter_options
@sampling_options
@click.option("--system", default=None, help="System prompt that opens the conversation.")
@log_option
@adapt_option
def chat(
    system, log, max_new_tokens, temperature, top_k, top_p, seed, stop_strings, save_heads, **opts
):
    """Chat with a model or bundle in the terminal (multi-turn, streaming, KV cache reused)."""
    if opts["no_chat_template"]:
        raise UserError("mtp-chat renders the conversation with the chat template: drop "
                        "--no-chat-template (mtp-run takes raw text)")  # fmt: skip
    for text, what in [(system or "", "--system"), *((s, "--stop") for s in stop_strings)]:
        check_utf8(text, what)
    check_adapt(opts["adapt"], save_heads)
    # Every check of the flags comes before the imports (torch, the backends) and the load.
    from mtp_edge.api import Model
    from mtp_edge.runtime.assemble import assemble

    request_log = RequestLog(log) if log else None  # an unwritable folder fails before the load
    llm = Model(assemble(load_options(opts)), log=request_log)
    if llm.tokenizer.chat_template is None:
        raise UserError(
            f"{llm.name} has no chat template, so it cannot hold a conversation: use a chat "
            "model, or mtp-run for plain text"
        )
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    top_p=top_p, seed=seed, stop=stop_strings)  # fmt: skip
    opening = [{"role": "system", "content": system}] if system else []
    llm.tokenizer.template_messages([*opening, {"role": "user", "content": "hi"}])  # checks
    _line_editing()
    drafter = llm.generator.drafter
    drafting = f"drafter {drafter.name}, k={llm.generator.config.k}" if drafter else "no drafter"
    if not logs.is_quiet():
        show(f"mtp-chat: {llm.name} ({drafting}, context {llm.max_seq_len}); /help for commands")

    interrupts = Interrupts()
    signal.signal(signal.SIGINT, interrupts)
    conversation = Conversation(llm, opening, sampling, interrupts)
    _converse(conversation, interrupts)
    if save_heads:  # the conversation ended (/exit, Ctrl-D)
        show(f"adapted heads written to {llm.save_heads(save_heads)}")


def _converse(conversation, interrupts) -> None:
    while True:
        try:
            interrupts.at_prompt = True
            line = input("> ")
        except EOFError:  # Ctrl-D
            show("")
            return
        except KeyboardInterrupt:
            show("")
            show("(Ctrl-D or /exit quits)")
            continue
        finally:
            interrupts.at_prompt = False
        interrupts.requested = False  # a Ctrl-C before the line was typed asks for nothing
        if conversation.take(line):
            return


class Interrupts:
    """Ctrl-C at the prompt abandons the line (input() gets a KeyboardInterrupt); anywhere else
    it asks the answer to stop, which the stream checks between steps: never an exception in the
    middle of a library call, which could leave a lock held or the cache half-written."""

    def __init__(self):
        self.at_prompt = False
        self.requested = False

    def __call__(self, signum, frame) -> None:
        if self.at_prompt:
            raise KeyboardInterrupt
        self.requested = True


class Conversation:
    """The messages so far and the last answer's numbers; a line typed is a command or a turn."""

    def __init__(self, llm, opening: list[dict], sampling: dict, interrupts: Interrupts):
        self.llm, self.opening, self.sampling = llm, opening, sampling
        self.interrupts = interrupts
        self.messages = list(opening)
        self.last: dict | None = None  # the last answer's record, for /stats

    def take(self, line: str) -> bool:
        """Act on one line; True means quit."""
        from mtp_edge.api import ContextFull

        text = line.strip()
        if not text:
            return False
        if text.startswith("/"):
            command = text.split()[0]
            if command in ("/exit", "/quit"):
                return True
            if command == "/reset":
                self.messages = list(self.opening)
                self.llm.reset()
                show("new conversation")
            elif command == "/stats":
                show(_stats_line(self.last) if self.last else "no answer yet")
            elif command == "/save":
                self.save(text.split(maxsplit=1)[1:])
            elif command == "/help":
                show(HELP)
            else:
                show(f"unknown command {command}; /help lists them")
            return False
        turn = [*self.messages, {"role": "user", "content": line}]
        try:
            answer = _answer(self.llm, turn, self.sampling, self.interrupts)
        except ContextFull as e:
            show(f"{e}\n(type /reset to start a new conversation)")
            return False
        self.messages = [*turn, {"role": "assistant", "content": answer["text"]}]
        self.last = answer
        if answer["finish_reason"] == "context_full":
            show("[the context is full: /reset starts a new conversation]")
        return False


    def save(self, args: list[str]) -> None:
        """/save PATH: the adapted heads, now (a bad path is a reply, not the end of the chat)."""
        from mtp_edge.files import check_output

        if self.llm.generator.adapter is None:
            show("/save writes adapted heads: start mtp-chat with --adapt")
            return
        if not args or not args[0].endswith(".safetensors"):
            show("/save takes a path ending in .safetensors, e.g. /save heads.safetensors")
            return
        try:
            check_output(args[0], "/save")
            path = self.llm.save_heads(args[0])
        except UserError as e:
            show(f"error: {e}")
            return
        a = self.llm.adaptation
        show(f"adapted heads written to {path} ({a['steps']} steps on {a['pairs']} pairs)")


def _answer(llm, messages: list[dict], sampling: dict, interrupts: Interrupts) -> dict:
    """Stream the answer to stdout; Ctrl-C stops it after the current step."""
    shown, chunk = [], None
    stream = llm.stream_chat(messages, **sampling)
    try:
        for chunk in stream:
            shown.append(chunk.text)
            click.echo(chunk.text, nl=False)
            if interrupts.requested:
                break
    finally:
        stream.close()
    show("")
    if chunk is None or chunk.finish_reason is None:
        show("[stopped]")
        reason, stats = "interrupted", None
    else:
        reason, stats = chunk.finish_reason, chunk.stats
    prompt, cached = (chunk.prompt_tokens, chunk.cached_tokens) if chunk else (0, 0)
    return {"text": "".join(shown), "finish_reason": reason, "stats": stats,
            "prompt_tokens": prompt, "cached_tokens": cached}  # fmt: skip


def show(text: str) -> None:
    """A line of the conversation, on stdout, flushed: it is on the screen before the next
    prompt is drawn (stderr would pass through the noise filter's process, and could come
    after it)."""
    click.echo(text)  # click flushes stdout after each echo


def _stats_line(last: dict) -> str:
    reuse = (
        f"prompt {last['prompt_tokens']} tokens: {last['cached_tokens']} cached, "
        f"{last['prompt_tokens'] - last['cached_tokens']} prefilled"
    )
    s = last["stats"]
    if s is None:
        return f"[{last['finish_reason']}] {reuse}"
    return (
        f"[{last['finish_reason']}] {s.generated_tokens} tokens, tau {s.tau:.2f}, acceptance "
        f"{s.acceptance_rate:.2f}, {s.decode_tokens_per_s:.1f} tok/s, ttft {s.ttft_ms:.0f} ms; "
        f"{reuse}"
    )


def _line_editing() -> None:
    """Arrow keys and history in `input()` where the readline module exists."""
    try:
        import readline  # noqa: F401
    except ImportError:
        pass
