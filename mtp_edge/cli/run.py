"""mtp-run: generate text from a prompt."""

from __future__ import annotations

import json

import click

from mtp_edge.cli.common import OneLineErrors, drafter_options, load_options, sampling_options, say


@click.command(cls=OneLineErrors)
@drafter_options
@click.option(
    "--prompt", required=True, help="The user message (raw text with --no-chat-template)."
)
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def run(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_strings, as_json, **opts):
    """Generate text with speculative decoding."""
    from mtp_edge.runtime.assemble import assemble
    from mtp_edge.runtime.loop import generate
    from mtp_edge.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    gen = assemble(load_options(opts), sampling, max_new_tokens, stop_strings)
    tokenizer = gen.tokenizer
    prompt_ids = gen.encode(prompt)

    stream = None
    if not as_json:
        printed = [0]
        streamed: list[int] = []

        def stream(tokens):
            streamed.extend(tokens)
            text = tokenizer.decode(streamed)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                click.echo(text[printed[0] :], nl=False)
                printed[0] = len(text)

    result = generate(gen.session, prompt_ids, gen.drafter, gen.config, tokenizer.decode, stream)
    text = tokenizer.decode(result.token_ids)
    for s in stop_strings:
        if s in text:
            text = text[: text.index(s)]
    if as_json:
        out = {
            "text": text,
            "token_ids": result.token_ids,
            "stop_reason": result.stop_reason,
            "stats": result.stats.to_dict(),
        }
        click.echo(json.dumps(out))
    else:
        s = result.stats
        click.echo("")
        say(
            f"[{result.stop_reason}] {s.generated_tokens} tokens, "
            f"{s.decode_tokens_per_s:.1f} tok/s, "
            f"tau {s.tau:.2f}, acceptance {s.acceptance_rate:.2f}, ttft {s.ttft_ms:.0f} ms"
        )
