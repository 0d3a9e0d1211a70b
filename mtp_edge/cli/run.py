"""mtp-run: generate text from a prompt."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from mtp_edge.cli.common import (
    OneLineErrors,
    drafter_options,
    load_options,
    sampling_options,
    say,
    write_json,
)
from mtp_edge.errors import UserError
from mtp_edge.files import check_output


class StopAwareStream:
    """Prints generated text as it comes, never past what the final text keeps: text that could
    be the start of a stop string waits until the next tokens settle it, and nothing is printed
    from a stop string on (the final text is cut there)."""

    def __init__(self, decode, stop_strings: tuple[str, ...], write):
        self.decode, self.stop_strings, self.write = decode, stop_strings, write
        self.tokens: list[int] = []
        self.printed = 0

    def safe_end(self, text: str) -> int:
        """How much of `text` is sure to be in the final text."""
        end = len(text)
        for stop in self.stop_strings:
            found = text.find(stop)
            if found >= 0:
                end = min(end, found)
            for n in range(min(len(stop) - 1, len(text)), 0, -1):  # a stop string's start
                if text.endswith(stop[:n]):
                    end = min(end, len(text) - n)
                    break
        while end > 0 and text[end - 1] == "\ufffd":  # the rest of a multi-byte character
            end -= 1
        return end

    def __call__(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        end = self.safe_end(text)
        if end > self.printed:
            self.write(text[self.printed : end])
            self.printed = end

    def finish(self, final_text: str) -> None:
        """Print what the final text holds past what was printed."""
        self.write(final_text[self.printed :])
        self.printed = len(final_text)


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """The text before the first stop string in it."""
    cut = min((text.find(s) for s in stop_strings if s in text), default=len(text))
    return text[:cut]


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise UserError("give the prompt with -p TEXT (- reads stdin) or -f FILE, one of them")
    if prompt == "-":
        return sys.stdin.read()
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--file {prompt_file}: cannot read it ({e})") from None
    return prompt


@click.command(cls=OneLineErrors)
@drafter_options
@click.option(
    "-p",
    "--prompt",
    default=None,
    help="The user message (raw text with --no-chat-template); - reads it from stdin.",
)
@click.option("-f", "--file", "prompt_file", default=None, help="Read the prompt from this file.")
@click.option(
    "--system",
    default=None,
    help="A system prompt, rendered by the model's chat template before the user message.",
)
@sampling_options
@click.option(
    "--json",
    "json_out",
    default=None,
    metavar="PATH",
    help="Write {text, token_ids, stop_reason, stats} as JSON to PATH (- for stdout, instead "
    "of the text).",
)
def run(
    prompt,
    prompt_file,
    system,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    stop_strings,
    json_out,
    **opts,
):
    """Generate text with speculative decoding."""
    from mtp_edge.runtime.assemble import assemble
    from mtp_edge.runtime.loop import generate
    from mtp_edge.runtime.sampling import SamplingParams

    check_output(json_out, "--json")
    prompt = read_prompt(prompt, prompt_file)
    if system is not None and opts["no_chat_template"]:
        raise UserError("--system goes into the chat template: drop --no-chat-template")
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    gen = assemble(load_options(opts), sampling, max_new_tokens, stop_strings)
    tokenizer = gen.tokenizer
    prompt_ids = encode(gen, prompt, system)

    stream = None
    if json_out != "-":
        stream = StopAwareStream(tokenizer.decode, stop_strings, lambda t: click.echo(t, nl=False))
    result = generate(gen.session, prompt_ids, gen.drafter, gen.config, tokenizer.decode, stream)
    text = cut_at_stop(tokenizer.decode(result.token_ids), stop_strings)
    if stream is not None:
        stream.finish(text)
        click.echo("")
    write_json(
        json_out,
        {
            "text": text,
            "token_ids": result.token_ids,
            "stop_reason": result.stop_reason,
            "stats": result.stats.to_dict(),
        },
        indent=None,
    )
    s = result.stats
    say(
        f"[{result.stop_reason}] {s.generated_tokens} tokens, "
        f"{s.decode_tokens_per_s:.1f} tok/s, "
        f"tau {s.tau:.2f}, acceptance {s.acceptance_rate:.2f}, ttft {s.ttft_ms:.0f} ms"
    )


def encode(gen, prompt: str, system: str | None) -> list[int]:
    """The prompt's ids; with a system prompt, both rendered by the chat template."""
    if system is None:
        return gen.encode(prompt)
    tokenizer = gen.tokenizer
    if tokenizer.chat_template is None:
        raise UserError("--system needs a chat template, and this model has none")
    typed = system + prompt
    if not gen.parse_special and tokenizer.encode(typed) != tokenizer.encode(typed, False):
        raise UserError(
            "--system with special tokens typed in the text (<|im_end|>...): remove them, or "
            "add --parse-special to read them as such"
        )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    if tokenizer.add_bos and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    return ids
