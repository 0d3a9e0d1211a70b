"""mtp-run: generate text from a prompt."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from mtp_edge.cli.common import (
    OneLineErrors,
    adapt_option,
    check_adapt,
    drafter_options,
    load_options,
    sampling_options,
    say,
    write_json,
)
from mtp_edge.errors import UserError
from mtp_edge.files import check_output
from mtp_edge.tokenizer import _check_utf8 as check_utf8


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise UserError("give the prompt with -p TEXT (- reads stdin) or -f FILE, one of them")
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"the prompt on stdin is not valid UTF-8 text (byte 0x{data[e.start]:02x} at "
                f"offset {e.start}): give it as UTF-8 (check the encoding of its source)"
            ) from None
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--file {prompt_file}: cannot read it ({e})") from None
    return prompt


def check_prompt(prompt: str, system: str | None, chat: bool) -> None:
    """What can be known of the prompt before the model loads: UTF-8 text, and not empty."""
    check_utf8(prompt, "the prompt")
    if system is not None:
        check_utf8(system, "--system")
        if not chat:
            raise UserError("--system goes into the chat template: drop --no-chat-template")
    if (not prompt.strip()) if chat else prompt == "":
        raise UserError("the prompt is empty: give some text (-p TEXT, -p - or -f FILE)")


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
@adapt_option
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
    save_heads,
    **opts,
):
    """Generate text with speculative decoding."""
    check_output(json_out, "--json")
    check_adapt(opts["adapt"], save_heads)
    prompt = read_prompt(prompt, prompt_file)
    check_prompt(prompt, system, chat=not opts["no_chat_template"])
    for stop in stop_strings:
        check_utf8(stop, "--stop")
    # Every check above comes before the imports (torch, the backends) and the load.
    from mtp_edge.api import Model
    from mtp_edge.runtime.assemble import assemble

    model = Model(assemble(load_options(opts)))
    sampling = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=stop_strings,
    )
    if system is None:
        ids = model.generator.encode(prompt)
    else:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        ids = model.tokenizer.encode_messages(messages, model.generator.parse_special)
    chunks = model.stream(ids, **sampling)
    text, token_ids = [], []
    for chunk in chunks:  # text never past what a stop string may still cut
        text.append(chunk.text)
        token_ids += chunk.token_ids
        if json_out != "-":
            click.echo(chunk.text, nl=False)
    if json_out != "-":
        click.echo("")
    s = chunk.stats
    write_json(
        json_out,
        {
            "text": "".join(text),
            "token_ids": token_ids,
            "stop_reason": chunk.finish_reason,
            "stats": s.to_dict(),
        },
        indent=None,
    )
    say(
        f"[{chunk.finish_reason}] {s.generated_tokens} tokens, "
        f"{s.decode_tokens_per_s:.1f} tok/s, "
        f"tau {s.tau:.2f}, acceptance {s.acceptance_rate:.2f}, ttft {s.ttft_ms:.0f} ms"
    )
    if save_heads:
        say(f"adapted heads written to {model.save_heads(save_heads)}")
