"""mtp-train: MTP heads for a target, by self-distillation."""

from __future__ import annotations

import click

from mtp_edge.cli.common import OneLineErrors, json_option, say, write_json
from mtp_edge.files import check_output


@click.command(cls=OneLineErrors)
@click.option(
    "-m",
    "--model",
    default="default",
    show_default=True,
    help="The frozen target: HF directory, .gguf file, or 'default'.",
)
@click.option(
    "--data",
    multiple=True,
    help='Text files to train on, or .jsonl[.gz] files of {"prompt", "response"} chat pairs '
    "(repeatable; default: offline text + the target's own responses).",
)
@click.option(
    "--prompts",
    default=None,
    help="Your requests, for heads that draft for them: a .txt file (one per line), a .jsonl "
    'file ("prompt" or OpenAI-style "messages" per line), or a folder of them or of request '
    "logs (mtp-serve --log). The target answers them and the heads train on the answers, "
    "beside the default text; a held-out part gives the report's line \"tau on your "
    'requests". Repeats are dropped.',
)
@click.option(
    "--prompts-share",
    default=0.75,
    show_default=True,
    type=float,
    help="Share of the written response tokens (or, with --minutes, of the writing time) that "
    "answers --prompts; the rest is the default text, which keeps the heads drafting for what "
    "your requests never ask.",
)
@click.option(
    "--answers-per-request",
    default=1,
    show_default=True,
    type=int,
    help="Answers the target writes to each of --prompts: its greedy one, then answers sampled "
    "at temperature 0.7 while --prompts-share has room. More text of your requests' kind from "
    "a few hundred of them (each request's answers stay on one side of the held-out split).",
)
@click.option("--k", default=4, show_default=True, help="Draft steps unrolled in training.")
@click.option(
    "--minutes",
    type=float,
    default=None,
    help="Wall-clock budget for writing, labelling and training together: the run measures "
    "this machine's rates and gives writing the share that buys text for the steps training "
    "can do, then stops each stage on its deadline (what was written and labelled is kept; "
    "training saves a checkpoint). With --resume it counts the time already spent: --minutes "
    "60 after 40 spent trains 20 more. Instead of --steps; one process only.",
)
@click.option(
    "--steps",
    default=None,
    type=int,
    help="Training steps  [default: 3000; with --minutes, as many as fit]",
)
@click.option(
    "--batch-size",
    default=512,
    show_default=True,
    help="Draft origins per step (per process): drawn at random from the whole text, or in "
    "whole sequences for heads with attention.",
)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("-s", "--seed", default=0, show_default=True)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted or finished run next to --out: its written text and labels "
    "are reused and training continues from the last checkpoint (give more --steps or "
    "--minutes to train further).",
)
@click.option(
    "--draft-vocab",
    default="auto",
    show_default=True,
    help="Size of the reduced draft vocabulary, or auto: the fewest tokens (a multiple of 256, "
    "1024-32768) that cover 99% of the target's predictions on the training text.",
)
@click.option(
    "--gen-tokens",
    default=None,
    type=int,
    help="Response tokens the target writes for the default corpus  [default: 100000; with "
    "--minutes, as many as its share of the time allows]",
)
@click.option(
    "--self-prompt-tokens",
    default=None,
    type=int,
    help="More response tokens, to requests the target writes itself (sampled from the start "
    "of a user turn of its chat template): more varied requests than the templates; 0: none  "
    "[default: a quarter of --gen-tokens; with --minutes, 40% of the writing time; none for a "
    "model without a chat template or one that writes no usable request]",
)
@click.option(
    "--init",
    default=None,
    help="Continue training these heads (their design carries over; the draft vocabulary "
    "is chosen on the new text, shared tokens keep their trained rows): a heads file, or a "
    "bundle whose heads are shipped for its model.",
)
@click.option(
    "--raw-tokens",
    default=50_000,
    show_default=True,
    help="Tokens of offline text for the default corpus.",
)
@click.option(
    "--attention",
    type=click.Choice(["none", "target_cache", "self"]),
    default="none",
    show_default=True,
    help="none: an MLP head reading the target's hidden state; target_cache: its first block "
    "also attends to the target's last-layer KV cache; self (EAGLE): to a KV cache of its own "
    "features of the whole context.",
)
@click.option(
    "--labels",
    type=click.Choice(["hard", "soft"]),
    default="hard",
    show_default=True,
    help="Train on the target's distribution over the draft vocabulary, or on its argmax.",
)
@click.option(
    "--feature-loss",
    default=0.0,
    show_default=True,
    help="Weight of a loss that pulls each step's hidden state onto the target's (0: off).",
)
@click.option(
    "--freeze-lm-head",
    is_flag=True,
    help="Keep the draft LM head at the target's rows instead of training it.",
)
@click.option("--weight-decay", default=0.0, show_default=True, help="AdamW weight decay.")
@click.option(
    "-t", "--threads", default=0, type=click.IntRange(0), help="CPU threads (0 = torch's default)."
)
@click.option(
    "--bundle",
    default=None,
    help="An ExecuTorch bundle of the target (exported with --drafter mtp): it writes and labels "
    "the text, so the heads learn the exported, quantized target they will draft for.",
)
@click.option(
    "--writer",
    type=click.Choice(["auto", "int8", "fp32", "bundle"]),
    default=None,
    help="Who writes the training text: the target with int8 linears, batched (fastest on a "
    "CPU that multiplies int8 in hardware), the target as loaded, batched, or --bundle's "
    "exported target one sequence at a time; auto: int8 or fp32, whichever this machine runs "
    "faster, measured in the first seconds (default: the bundle when given, else auto).",
)
@click.option(
    "--labeller",
    type=click.Choice(["auto", "int8", "fp32", "bundle"]),
    default=None,
    help="Who labels the text (hidden state and choice at every position): the target with "
    "int8 linears, the target as loaded, or --bundle's exported target; auto as for --writer "
    "(default: the bundle when given, else auto).",
)
@click.option(
    "--gen-batch",
    default=64,
    show_default=True,
    help="Responses (and requests) written together by an eager writer.",
)
@click.option(
    "--gen-max-new",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Longest response the target writes (tokens): shorter answers to --prompts cost less "
    "to write when the heads will draft only the start of each (answers already cached keep "
    "their length).",
)
@click.option(
    "--write-only",
    is_flag=True,
    help="Write (or extend) the cached training text next to --out, then stop.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the heads train (the target writes and labels on the CPU). cuda is written to "
    "work but tested on CPU only.",
)
@json_option(
    "the run's summary (held-out results, every evaluation; - prints it instead of the report)"
)
@click.option("-o", "--out", required=True, help="Output heads file (.safetensors).")
def train(data, freeze_lm_head, writer, labeller, json_out, **options):
    """Train MTP draft heads for a target by self-distillation (runs under torchrun too).

    The heads written are the run's best on held-out text; the run ends with a report of
    their acceptance, the draft step's cost and the command that exports them."""
    from mtp_edge.train import TrainOptions, train_heads

    check_output(options["out"], "--out")
    check_output(json_out, "--json")  # before the run, not after hours of it
    options = TrainOptions(
        data=tuple(data),
        train_lm_head=not freeze_lm_head,
        writer=writer or "",
        labeller=labeller or "",
        **options,
    )
    summary = train_heads(options, progress=say)
    if json_out:
        write_json(json_out, summary)
    if summary.get("report") and json_out != "-":
        click.echo(summary["report"])
