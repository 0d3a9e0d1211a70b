"""Command-line entry points (click only: the work is done by the modules they call). User
errors print one line and exit 2; nothing prints a traceback."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from mtp_edge.errors import Fault, Terminated, UserError
from mtp_edge.files import check_output, write_atomic
from mtp_edge.logs import quiet_library_noise


class OneLineErrors(click.Command):
    """A click command whose usage errors, UserErrors and Faults print as one `error: ...` line:
    exit 2 for a user's mistake, 1 for a fault of ours, 128 + N for signal N. SIGTERM and SIGHUP
    unwind like Ctrl-C, so that nothing half-written is left behind."""

    def main(self, *args, **kwargs):
        quiet_library_noise()
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _terminate)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"error: {e.format_message()} (see --help)", err=True)
            sys.exit(2)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except Fault as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except (KeyboardInterrupt, click.exceptions.Abort):
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except Terminated as e:
            click.echo(f"error: stopped by {signal.Signals(e.signum).name}", err=True)
            sys.exit(128 + e.signum)
        sys.exit(code if isinstance(code, int) else 0)


def _terminate(signum, frame) -> None:
    raise Terminated(signum)


def _non_empty(flag: str, values: tuple[str, ...]) -> tuple[str, ...]:
    if any(v == "" for v in values):
        raise click.BadParameter("takes a non-empty text (an empty one would match at once)")
    return values


def say(line: str) -> None:
    """Progress, on stderr: stdout carries only the result."""
    click.echo(line, err=True)


def drafter_options(f):
    """Options shared by the commands that decode: target model, drafter and its settings."""
    options = [
        click.option(
            "--model",
            "model_spec",
            default="default",
            show_default=True,
            help="HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct).",
        ),
        click.option(
            "--bundle", default=None, help="Run an exported bundle (mtp-export) instead of --model."
        ),
        click.option(
            "--drafter",
            default=None,
            help="none | ngram | mtp | path to a draft model with the target's vocabulary | "
            "any of these +ngram (e.g. mtp+ngram: prompt lookup where the context repeats "
            "itself, the model elsewhere) (default: the bundle's drafter, else ngram).",
        ),
        click.option(
            "--k",
            default=None,
            type=click.IntRange(1, 15),
            help="Most tokens drafted per step, 1..15 (default: 4, or the bundle's).",
        ),
        click.option(
            "--heads", default=None, help="MTP heads file for --drafter mtp (default: shipped)."
        ),
        click.option(
            "--adaptive-k",
            is_flag=True,
            help="Grow k after a fully accepted step, shrink it after a miss.",
        ),
        click.option(
            "--ngram-sizes",
            default=None,
            help="n-gram drafter (and the lookup of X+ngram): MIN-MAX n (default 1-3, or the "
            "bundle's lookup sizes).",
        ),
        click.option(
            "--draft-confidence",
            default=None,
            type=float,
            help="Model drafters: stop drafting when the best probability falls below (default "
            "0, or the bundle's).",
        ),
        click.option(
            "--max-seq-len", default=2048, show_default=True, help="Static KV cache length."
        ),
        click.option("--no-chat-template", is_flag=True, help="Feed prompts as raw text."),
        click.option(
            "--parse-special",
            is_flag=True,
            help="Read special tokens typed in a prompt (<|im_end|>...) as such, not as text.",
        ),
        click.option("--threads", default=0, help="CPU threads (0 = all cores)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def load_options(opts: dict):
    """The `drafter_options` flags as runtime/assemble.py's LoadOptions."""
    from mtp_edge.runtime.assemble import LoadOptions

    return LoadOptions(
        model=opts["model_spec"],
        bundle=opts["bundle"],
        drafter=opts["drafter"],
        k=opts["k"],
        heads=opts["heads"],
        adaptive_k=opts["adaptive_k"],
        ngram_sizes=opts["ngram_sizes"],
        draft_confidence=opts["draft_confidence"],
        max_seq_len=opts["max_seq_len"],
        chat=not opts["no_chat_template"],
        parse_special=opts["parse_special"],
        threads=opts["threads"],
    )


@click.command(cls=OneLineErrors)
@drafter_options
@click.option(
    "--prompt", required=True, help="The user message (raw text with --no-chat-template)."
)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, help="1 = off.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--stop",
    "stop_strings",
    multiple=True,
    callback=lambda ctx, param, values: _non_empty("--stop", values),
    help="Stop at this text (repeatable).",
)
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


@click.command(cls=OneLineErrors)
@drafter_options
@click.option(
    "--prompts",
    "prompts_path",
    default=None,
    help="JSONL prompts file (default: the built-in suite).",
)
@click.option(
    "--repeat", default=1, show_default=True, help="Passes over the suite (medians and spread)."
)
@click.option(
    "--max-new-tokens", default=None, type=int, help="Override every prompt's max_new_tokens."
)
@click.option("--json", "json_out", default=None, help="Write the JSON report here.")
@click.option("--markdown", "markdown_out", default=None, help="Write a Markdown summary here.")
@click.option(
    "--report",
    "report_dir",
    default=None,
    help="Write a Markdown report with PNG plots and the machine's description here.",
)
@click.option(
    "--compare",
    multiple=True,
    help="Another bundle to measure side by side with --bundle (repeatable; prompts "
    "interleaved). DIR[,k=N][,drafter=NAME][,confidence=P] also compares k values, drafters "
    "or --draft-confidence floors of one bundle.",
)
def bench(
    prompts_path, repeat, max_new_tokens, json_out, markdown_out, report_dir, compare, **opts
):
    """Plain vs speculative greedy decoding on the same backend, over a prompt suite."""
    import dataclasses

    from mtp_edge.devices.bench import bench as measure
    from mtp_edge.devices.harness import load_prompts, to_markdown
    from mtp_edge.devices.isolated import compare_spec

    if repeat < 1:
        raise UserError(f"--repeat must be >= 1, got {repeat}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if compare and opts["bundle"] is None:
        raise UserError("--compare puts bundles side by side: give the first one with --bundle")
    check_output(json_out, "--json")
    check_output(markdown_out, "--markdown")
    check_output(report_dir, "--report", directory=True)
    prompts = load_prompts(prompts_path)
    first = load_options(opts)
    setups = [first] + [dataclasses.replace(first, **compare_spec(c)) for c in compare]
    machine = None
    if report_dir is not None:
        from mtp_edge.devices.report import machine_description

        say("[machine] measuring memory bandwidth and matmul throughput")
        machine = machine_description()  # before ExecuTorch takes the cores
    command = " ".join(["mtp-bench", *sys.argv[1:]])
    reports = measure(setups, prompts, repeat, max_new_tokens, command, say)
    markdown = "\n".join(to_markdown(r) for r in reports)
    body = reports[0] if len(reports) == 1 else {"command": command, "runs": reports}
    write_atomic(json_out, json.dumps(body, indent=2) + "\n")
    write_atomic(markdown_out, markdown)
    if report_dir is not None:
        from mtp_edge.devices.report import write_report

        say(f"[report] {write_report(report_dir, reports, command, machine)}")
    click.echo(markdown)
    if not all(r["summary"]["lossless"] for r in reports):
        raise Fault(
            "speculative output diverged from plain output beyond a near-tie: a bug in "
            "mtp-edge; please report it with the JSON report"
        )


@click.command(cls=OneLineErrors)
@click.option(
    "--target",
    "platform",
    default="android",
    show_default=True,
    help="android (ExecuTorch .pte, XNNPACK) | onnx (ONNX Runtime) | coreml (.mlpackage).",
)
@click.option(
    "--model",
    default="default",
    show_default=True,
    help="HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct).",
)
@click.option(
    "--drafter",
    default="auto",
    show_default=True,
    help="auto (MTP heads if they ship for the model, else ngram) | none | ngram | mtp | "
    "path to a draft model with the target's vocabulary.",
)
@click.option("--heads", default=None, help="MTP heads for --drafter mtp (default: shipped).")
@click.option("--k", default=4, show_default=True, help="Tokens drafted per step.")
@click.option(
    "--quant",
    default=None,
    help="Target weights. android: 8da8w | 8da4w | fp32 (default 8da8w); onnx: int4 | int8 | "
    "fp32 (default int4); coreml: int4 | int8 | fp16 (default int4).",
)
@click.option(
    "--group-size",
    default=None,
    type=int,
    help="Quantization group size (0 = one scale per output channel).",
)
@click.option(
    "--embedding-quant", default="8w", show_default=True, help="8w | 4w | none (android only)."
)
@click.option("--draft-quant", default=None, help="Drafter weights (default: as --quant).")
@click.option(
    "--lookup",
    default="2-3",
    show_default=True,
    help="Runtime default for a model drafter: prompt lookup first where the context's last "
    "MIN-MAX tokens occurred before (none: the model alone).",
)
@click.option(
    "--draft-confidence",
    default=0.5,
    show_default=True,
    help="Runtime default for a model drafter: no draft below this first-token probability.",
)
@click.option(
    "--attention-kernel",
    type=click.Choice(["mtp", "executorch"]),
    default="mtp",
    show_default=True,
    help="android: attention op of the programs. mtp: ours, row-exact, so a k+1-token "
    "verification is one call (mtp-edge's runtimes carry it); executorch: llama.custom_sdpa, "
    "which ExecuTorch's stock runners carry (verification then calls it once per row).",
)
@click.option("--max-seq-len", default=2048, show_default=True, help="Static KV cache length.")
@click.option("--out", default=None, help="Bundle directory (default: bundles/<model>-<target>).")
@click.option(
    "--quality-tokens",
    default=1024,
    show_default=True,
    help="Held-out tokens for the perplexity check (0 = skip).",
)
def export(quant, group_size, draft_quant, **options):
    """Quantize a target (and its drafter) and export them as one bundle."""
    from mtp_edge.api import ExportOptions
    from mtp_edge.api import export as export_bundle
    from mtp_edge.quantize.schemes import DEFAULT_SCHEME, default_group_size

    platform, out = options["platform"], options.pop("out")
    if out is not None:  # the default (bundles/<model>-<target>) is checked once it is known
        from mtp_edge.exporter.bundle import check_writable

        check_writable(Path(out))
    quant = quant or DEFAULT_SCHEME.get(platform, DEFAULT_SCHEME["android"])
    if group_size is None:
        group_size = default_group_size(quant, platform)
    options = ExportOptions(
        quant=quant, group_size=group_size, draft_quant=draft_quant or quant, **options
    )
    bundle, manifest = export_bundle(options, out, progress=say)
    click.echo(json.dumps({"bundle": str(bundle), "quality": manifest.quality}))


@click.command(cls=OneLineErrors)
@click.option(
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
@click.option("--k", default=4, show_default=True, help="Draft steps unrolled in training.")
@click.option("--steps", default=3000, show_default=True)
@click.option(
    "--batch-size",
    default=512,
    show_default=True,
    help="Draft origins per step (per process): drawn at random from the whole text, or in "
    "whole sequences for heads with attention.",
)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint next to --out.")
@click.option(
    "--draft-vocab", default=8192, show_default=True, help="Size of the reduced draft vocabulary."
)
@click.option(
    "--gen-tokens",
    default=100_000,
    show_default=True,
    help="Response tokens the target writes for the default corpus.",
)
@click.option(
    "--self-prompt-tokens",
    default=0,
    show_default=True,
    help="More response tokens, to requests the target writes itself (sampled from the start "
    "of a user turn of its chat template): more varied requests than the templates.",
)
@click.option(
    "--init",
    default=None,
    help="Continue training these heads (their design carries over; the draft vocabulary "
    "is chosen on the new text, shared tokens keep their trained rows).",
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
@click.option("--threads", default=0, help="CPU threads (0 = torch's default).")
@click.option(
    "--bundle",
    default=None,
    help="An ExecuTorch bundle of the target (exported with --drafter mtp): it writes and labels "
    "the text, so the heads learn the exported, quantized target they will draft for.",
)
@click.option(
    "--writer",
    type=click.Choice(["int8", "fp32", "bundle"]),
    default=None,
    help="Who writes the training text: the target with int8 linears, batched (fastest on a "
    "CPU), the target as loaded, batched, or --bundle's exported target one sequence at a time "
    "(default: the bundle when given, else int8). Labels always come from the target "
    "(--bundle's when given).",
)
@click.option(
    "--gen-batch",
    default=64,
    show_default=True,
    help="Responses (and requests) written together by an eager writer.",
)
@click.option(
    "--write-only",
    is_flag=True,
    help="Write (or extend) the cached training text next to --out, then stop.",
)
@click.option("--out", required=True, help="Output heads file (.safetensors).")
def train(data, freeze_lm_head, writer, **options):
    """Train MTP draft heads for a target by self-distillation (runs under torchrun too)."""
    from mtp_edge.train import TrainOptions, train_heads

    check_output(options["out"], "--out")
    options = TrainOptions(
        data=tuple(data), train_lm_head=not freeze_lm_head, writer=writer or "", **options
    )
    summary = train_heads(options, progress=say)
    if summary:
        click.echo(json.dumps(summary))


@click.command(cls=OneLineErrors)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (with every figure's source).")
@click.option("--sources", is_flag=True, help="List where each figure comes from.")
def devices(as_json, sources):
    """The device catalog, and this machine measured live."""
    from dataclasses import asdict

    from mtp_edge.devices.catalog import catalog, devices_table, host_device

    say("[host] measuring memory bandwidth and matmul throughput")
    entries = [host_device(), *catalog()]
    if as_json:
        click.echo(json.dumps([asdict(d) for d in entries], indent=2))
        return
    click.echo(devices_table(entries))
    if sources:
        for d in entries:
            click.echo(f"{d.name}:")
            for figure, source in d.sources.items():
                click.echo(f"  {figure}: {source}")


@click.command(cls=OneLineErrors)
@click.option("--bundle", required=True, help="The bundle to predict for (ExecuTorch).")
@click.option(
    "--device",
    "device_names",
    multiple=True,
    default=("host",),
    show_default=True,
    help="host (measured live) | a catalog name (mtp-devices) | all (repeatable).",
)
@click.option(
    "--from-bench",
    default=None,
    help="mtp-bench JSON of this bundle: its tau and acceptance (and, for host, the measured "
    "tokens/s to compare with).",
)
@click.option("--json", "json_out", default=None, help="Write the predictions as JSON here.")
@click.option("--markdown", "markdown_out", default=None, help="Write the table here.")
def predict(bundle, device_names, from_bench, json_out, markdown_out):
    """Roofline prediction of plain and speculative tokens/s and the speedup on a device."""
    from mtp_edge.devices.predict import predict_bundle

    check_output(json_out, "--json")
    check_output(markdown_out, "--markdown")
    command = " ".join(["mtp-predict", *sys.argv[1:]])
    out, markdown = predict_bundle(bundle, device_names, from_bench, command, say)
    write_atomic(json_out, json.dumps(out, indent=2) + "\n")
    write_atomic(markdown_out, markdown)
    click.echo(markdown)


@click.command(cls=OneLineErrors)
@click.option("--device", required=True, help="host, or the serial of an adb device.")
@click.option("--bundle", required=True, help="The bundle to measure.")
@click.option("--prompts", "prompts_path", default=None, help="JSONL prompts (default: built in).")
@click.option(
    "--max-new-tokens", default=None, type=int, help="Override every prompt's max_new_tokens."
)
@click.option("--repeat", default=1, show_default=True, help="Runs per prompt (medians).")
@click.option("--json", "json_out", default=None, help="Write the report (mtp-bench format).")
@click.option(
    "--runner",
    default=None,
    help="The native mtp-runner for the device (default: runtime/native/build-android/mtp-runner).",
)
@click.option(
    "--as",
    "catalog_name",
    default=None,
    help="Catalog device to predict with (default: matched from the device's SoC).",
)
def profile(device, bundle, prompts_path, max_new_tokens, repeat, json_out, runner, catalog_name):
    """Measure plain vs speculative decoding on the host or an adb device, next to the
    roofline prediction for that device."""
    from mtp_edge.devices.harness import load_prompts
    from mtp_edge.devices.profile import profile_device

    if repeat < 1:
        raise UserError(f"--repeat must be >= 1, got {repeat}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_output(json_out, "--json")
    report = profile_device(
        device,
        bundle,
        load_prompts(prompts_path),
        max_new_tokens,
        repeat,
        runner,
        catalog_name,
        json_out,
        progress=say,
    )
    click.echo(report["markdown"])
