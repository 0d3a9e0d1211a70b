"""What the commands share: one-line errors and exit codes, signal handling, --version, -v and
-q, the options of the commands that decode, and progress lines on stderr."""

from __future__ import annotations

import errno
import json
import signal
import sys

import click

from mtp_edge import cpu_class, logs
from mtp_edge.errors import Fault, Terminated, UserError
from mtp_edge.limits import LIMITS
from mtp_edge.version import __version__


def _print_version(ctx: click.Context, param, value: bool) -> None:
    if value:
        click.echo(f"mtp-edge {__version__}")
        ctx.exit(0)


def _set_quiet(ctx: click.Context, param, value: bool) -> None:
    logs.set_verbosity(quiet=value)


def _set_verbose(ctx: click.Context, param, value: bool) -> None:
    logs.set_verbosity(verbose=value)


def _asks_verbose(args: list[str]) -> bool:
    """-v or --verbose among the arguments (also grouped with -q: -qv), read before parsing."""
    return any(
        a == "--verbose" or (a.startswith("-") and a[1:] and set(a[1:]) <= {"v", "q"} and "v" in a)
        for a in args
    )


class OneLineErrors(click.Command):
    """A click command whose usage errors, UserErrors and Faults print as one `error: ...` line:
    exit 2 for a user's mistake, 1 for a fault of ours, 128 + N for signal N. SIGTERM and SIGHUP
    unwind like Ctrl-C, so that nothing half-written is left behind. Every command gets
    --version, -v/--verbose and -q/--quiet from here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        eager = {"is_flag": True, "expose_value": False, "is_eager": True}
        self.params += [
            click.Option(
                ["--version"], callback=_print_version, help="Print the version and exit.", **eager
            ),
            click.Option(
                ["-v", "--verbose"],
                callback=_set_verbose,
                help="Keep what the libraries below us print (ExecuTorch, torch, torchao).",
                **eager,
            ),
            click.Option(
                ["-q", "--quiet"],
                callback=_set_quiet,
                help="No progress: only results and errors.",
                **eager,
            ),
        ]

    def main(self, args=None, **kwargs):
        if args is None and not _asks_verbose(sys.argv[1:]):  # a real run, not a test's
            logs.filter_stderr_noise()
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _terminate)
        try:
            cpu_class.check()
            code = super().main(args, standalone_mode=False, **kwargs)
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
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            from mtp_edge.memory import disk_full

            click.echo(f"error: {disk_full(e.filename or 'the output')}", err=True)
            sys.exit(2)
        except (KeyboardInterrupt, click.exceptions.Abort):
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except Terminated as e:
            click.echo(f"error: stopped by {signal.Signals(e.signum).name}", err=True)
            sys.exit(128 + e.signum)
        sys.exit(code if isinstance(code, int) else 0)


def _terminate(signum, frame) -> None:
    raise Terminated(signum)


class InRange(click.ParamType):
    """A number in one of mtp_edge/limits.py's ranges, the Python API's and the server's too:
    refused as the flag is read, before anything loads (NaN and inf included)."""

    def __init__(self, setting: str):
        self.limit = LIMITS[setting]
        self.name = "integer" if self.limit.kind is int else "float"

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            try:
                value = self.limit.kind(value.strip())
            except ValueError:
                self.fail(f"must be {self.limit.describe()}, got {value!r}", param, ctx)
        problem = self.limit.problem(value)
        if problem is not None:
            self.fail(problem, param, ctx)
        return self.limit.convert(value)


def _non_empty(flag: str, values: tuple[str, ...]) -> tuple[str, ...]:
    if any(v == "" for v in values):
        raise click.BadParameter("takes a non-empty text (an empty one would match at once)")
    return values


def say(line: str) -> None:
    """Progress, on stderr: stdout carries only the result; nothing with -q."""
    logs.say(line)


def write_json(path: str | None, body, indent: int | None = 2) -> None:
    """--json PATH: write `body` there atomically; - prints it on stdout; None writes nothing."""
    from mtp_edge.files import write_atomic

    text = json.dumps(body, indent=indent)
    if path == "-":
        click.echo(text)
    else:
        write_atomic(path, text + "\n")


def json_option(what: str):
    """--json PATH, the same on every command: a file, or - for stdout."""
    return click.option(
        "--json",
        "json_out",
        default=None,
        metavar="PATH",
        help=f"Write {what} as JSON to PATH (- for stdout).",
    )


def drafter_options(f):
    """Options shared by the commands that decode: target model, drafter and its settings."""
    options = [
        click.option(
            "-m",
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
            type=InRange("k"),
            help="Most tokens drafted per step, 1..15 (default: 4, or the bundle's; an 8da8w "
            "bundle's at most 3 on a CPU without an int8 dot product, e.g. AVX2; an "
            "8da8w-avx2 or 8da4w-mix-avx2 bundle's at most 5).",
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
            "--fallback/--no-fallback",
            default=False,
            show_default=True,
            help="Draft each step only as many tokens as measured acceptance and costs say "
            "pay, none where drafting does not (output unchanged; when sampling, one seed may "
            "then give other samples from run to run). Off by default: on the default bundle "
            "it helped where drafting loses and cost more elsewhere (benchmarks/README.md).",
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
            type=InRange("draft_confidence"),
            help="Model drafters: stop drafting when the best probability falls below, in [0, 1) "
            "(default 0, or the bundle's).",
        ),
        click.option(
            "-c",
            "--max-seq-len",
            default=2048,
            show_default=True,
            type=InRange("max_seq_len"),
            help="Static KV cache length, >= 2 (a bundle's is fixed at export).",
        ),
        click.option("--no-chat-template", is_flag=True, help="Feed prompts as raw text."),
        click.option(
            "--parse-special",
            is_flag=True,
            help="Read special tokens typed in a prompt (<|im_end|>...) as such, not as text.",
        ),
        click.option(
            "-t",
            "--threads",
            default=0,
            type=InRange("threads"),
            help="CPU threads (0 = all cores).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def log_option(f):
    """--log DIR: the opt-in request log (mtp_edge/request_log.py) of mtp-chat and mtp-serve."""
    return click.option(
        "--log",
        default=None,
        metavar="DIR",
        type=click.Path(file_okay=False),
        help="Append each request (its messages, the answer's token ids, its tau) to a bounded, "
        "rotated JSONL log in DIR, for mtp-train --prompts DIR. Off unless given.",
    )(f)


def adapt_option(f):
    """--adapt and --save-heads PATH: MTP heads that learn while the command serves
    (runtime/adapt.py), and where the adapted heads are written when it ends."""
    f = click.option(
        "--save-heads",
        default=None,
        metavar="PATH",
        help="With --adapt: write the adapted heads to PATH (.safetensors) when the command ends, "
        "for --heads and mtp-export --heads.",
    )(f)
    return click.option(
        "--adapt",
        is_flag=True,
        help="MTP heads learn from what the target verifies, between requests, within 10% of "
        "generation time; the output is unchanged, drafts improve on the text served (Python "
        "runtime; MTP drafters only).",
    )(f)


def check_adapt(adapt: bool, save_heads: str | None) -> None:
    """The --adapt flags, before anything loads."""
    from mtp_edge.files import check_output

    if save_heads is None:
        return
    if not adapt:
        raise UserError("--save-heads writes adapted heads: add --adapt")
    if not save_heads.endswith(".safetensors"):
        raise UserError(f"--save-heads takes a .safetensors path, got {save_heads}")
    check_output(save_heads, "--save-heads")


def sampling_options(f):
    """Options shared by the commands that generate: length, sampling and stop strings (short
    names as llama.cpp's: -n, -s; --temp as MLX-LM's)."""
    options = [
        click.option(
            "-n",
            "--max-new-tokens",
            default=128,
            show_default=True,
            type=InRange("max_new_tokens"),
        ),
        click.option(
            "--temperature",
            "--temp",
            default=0.0,
            show_default=True,
            type=InRange("temperature"),
            help="0 = greedy.",
        ),
        click.option(
            "--top-k", default=0, show_default=True, type=InRange("top_k"), help="0 = off."
        ),
        click.option(
            "--top-p",
            default=1.0,
            show_default=True,
            type=InRange("top_p"),
            help="In (0, 1]; 1 = off.",
        ),
        click.option(
            "-s", "--seed", default=0, show_default=True, type=InRange("seed"), help="0..2^64-1."
        ),
        click.option(
            "--stop",
            "stop_strings",
            multiple=True,
            callback=lambda ctx, param, values: _non_empty("--stop", values),
            help="Stop at this text (repeatable).",
        ),
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
        fallback=opts["fallback"],
        ngram_sizes=opts["ngram_sizes"],
        draft_confidence=opts["draft_confidence"],
        max_seq_len=opts["max_seq_len"],
        chat=not opts["no_chat_template"],
        parse_special=opts["parse_special"],
        threads=opts["threads"],
        adapt=opts.get("adapt", False),
    )
