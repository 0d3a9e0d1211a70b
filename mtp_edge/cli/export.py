"""mtp-export: quantize a model and its drafter into a bundle."""

from __future__ import annotations

import json

import click

from mtp_edge.cli.common import OneLineErrors, say
from mtp_edge.platforms import PLATFORMS, every_scheme

EMBEDDING_SCHEMES = ("8w", "4w", "none")  # quantize.schemes.EMBEDDING_SCHEMES (imports torch)
# quantize.schemes.HEAD_SCHEMES, likewise
HEAD_SCHEMES = ("8da8w", "8da8w-avx2", "8da6w-avx2", "8da4w", "fp32")


class TableChoice(click.Choice):
    """A choice among what the platform table holds when the command runs (its rows, or every
    scheme of every row), so that a row added to the table is a choice here too."""

    def __init__(self, read) -> None:
        self.read = read
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self.read())

    @choices.setter
    def choices(self, _value) -> None:
        pass


def _schemes_help() -> str:
    return "Target weights. " + "; ".join(
        f"{p.name}: {' | '.join(p.schemes)} (default {p.default_scheme})"
        for p in PLATFORMS.values()
    )


@click.command(cls=OneLineErrors)
@click.option(
    "--target",
    "platform",
    type=TableChoice(lambda: PLATFORMS),
    default="android",
    show_default=True,
    help=" | ".join(f"{p.name} ({p.summary})" for p in PLATFORMS.values()) + ".",
)
@click.option(
    "-m",
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
@click.option(
    "--k",
    default=None,
    type=int,
    help="Tokens drafted per step (1-15; default 4, or with --quant auto the k timed fastest).",
)
@click.option(
    "--quant",
    type=TableChoice(lambda: (*every_scheme(), "auto")),
    default=None,
    help=_schemes_help() + "; 8da8w-avx2: 8da8w in mtp-edge's own int8 kernel, for CPUs "
    "without an int8 dot product (AVX2 laptops); 8da4w-mix-avx2: 8da4w-mix in mtp-edge's own "
    "4-bit and int8 kernels, likewise; auto: each scheme exported and timed here, "
    "the fastest speculative one within +3% perplexity kept (and k, unless --k is given).",
)
@click.option(
    "--group-size",
    default=None,
    type=int,
    help="Quantization group size (0 = one scale per output channel).",
)
@click.option(
    "--embedding-quant",
    type=click.Choice(EMBEDDING_SCHEMES),
    default="8w",
    show_default=True,
    help="Embedding table weights (android only).",
)
@click.option(
    "--head-quant",
    type=click.Choice(HEAD_SCHEMES),
    default=None,
    help="android: the target's LM head in a scheme of its own (default: the --quant scheme's "
    "head, 8-bit in the mixed schemes); 8da6w-avx2: 6-bit weights in groups of 32 in "
    "mtp-edge's own kernel, as llama.cpp's Q4_K_M keeps its output tensor (0.81 of an 8-bit "
    "head's bytes).",
)
@click.option(
    "--draft-quant",
    type=TableChoice(every_scheme),
    default=None,
    help="Drafter weights (default: as --quant); its group size is --group-size where both "
    "schemes group weights alike, else its scheme's default (8da8w beside 8da4w: per channel).",
)
@click.option(
    "--ngram-sizes",
    "--lookup",  # its older name
    "lookup",
    default="2-3",
    show_default=True,
    help="Runtime default for a model drafter: prompt lookup first where the context's last "
    "MIN-MAX tokens occurred before, as mtp-run --ngram-sizes (none: the model alone).",
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
@click.option(
    "-c",
    "--max-seq-len",
    default=2048,
    show_default=True,
    type=click.IntRange(1),
    help="Static KV cache length.",
)
@click.option(
    "-o", "--out", default=None, help="Bundle directory (default: bundles/<model>-<platform>)."
)
@click.option(
    "--quality-tokens",
    default=1024,
    show_default=True,
    help="Held-out tokens for the perplexity check (0 = skip).",
)
@click.option(
    "--update-heads",
    "update",
    metavar="BUNDLE",
    default=None,
    help="Swap the MTP heads of --heads into BUNDLE without exporting its target again: "
    "in place, or into --out.",
)
def export(out, update, **options):
    """Quantize a target (and its drafter) and export them as one bundle."""
    if update is not None:
        _update_heads(update, options["heads"], out)
        return
    from mtp_edge.api import ExportOptions
    from mtp_edge.api import export as export_bundle

    # Every option is decided and checked below the command (exporter/platform.py's
    # resolve_options), so that the API and this command agree.
    bundle, manifest = export_bundle(ExportOptions(**options), out, progress=say)
    click.echo(json.dumps({"bundle": str(bundle), "quality": manifest.quality}))


def _update_heads(bundle: str, heads: str | None, out: str | None) -> None:
    """--update-heads: only --heads and --out apply; any other option set would be ignored,
    so it is refused."""
    context = click.get_current_context()
    given = [
        p.opts[-1]
        for p in context.command.params
        if p.name not in ("update", "heads", "out")
        and p.expose_value
        and context.get_parameter_source(p.name) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        raise click.UsageError(
            f"--update-heads takes only --heads and --out, not {given[0]}: the bundle's other "
            "settings stay as exported"
        )
    if heads is None:
        raise click.UsageError("--update-heads needs --heads FILE: the heads to put in the bundle")
    from mtp_edge.exporter.update_heads import update_heads

    path, manifest = update_heads(bundle, heads, out, progress=say)
    drafter = manifest.drafter.to_json()
    recipe = drafter.pop("recipe")
    drafter["heads_sha256"] = recipe["heads_sha256"]
    click.echo(json.dumps({"bundle": str(path), "drafter": drafter}))
