"""mtp-export: quantize a model and its drafter into a bundle."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mtp_edge.cli.common import OneLineErrors, say
from mtp_edge.errors import require

# Every --quant scheme of every target (quantize.schemes.TARGET_SCHEMES, which imports torch:
# too slow for --help); which of them a target takes is checked once the target is known.
QUANT_SCHEMES = ("8da8w", "8da4w", "int4", "int8", "fp16", "fp32")
EMBEDDING_SCHEMES = ("8w", "4w", "none")  # quantize.schemes.EMBEDDING_SCHEMES
# The modules each target's exporter needs beyond the required dependencies, and their extra.
TARGET_EXTRAS = {
    "onnx": (("onnx", "onnxruntime", "onnxscript"), "onnx"),
    "coreml": (("coremltools",), "coreml"),
}


@click.command(cls=OneLineErrors)
@click.option(
    "--target",
    "platform",
    type=click.Choice(["android", "onnx", "coreml"]),
    default="android",
    show_default=True,
    help="android (ExecuTorch .pte, XNNPACK) | onnx (ONNX Runtime) | coreml (.mlpackage).",
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
    "--k", default=4, show_default=True, type=click.IntRange(1, 15), help="Tokens drafted per step."
)
@click.option(
    "--quant",
    type=click.Choice(QUANT_SCHEMES),
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
    "--embedding-quant",
    type=click.Choice(EMBEDDING_SCHEMES),
    default="8w",
    show_default=True,
    help="Embedding table weights (android only).",
)
@click.option(
    "--draft-quant",
    type=click.Choice(QUANT_SCHEMES),
    default=None,
    help="Drafter weights (default: as --quant).",
)
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
@click.option(
    "-c",
    "--max-seq-len",
    default=2048,
    show_default=True,
    type=click.IntRange(1),
    help="Static KV cache length.",
)
@click.option(
    "-o", "--out", default=None, help="Bundle directory (default: bundles/<model>-<target>)."
)
@click.option(
    "--quality-tokens",
    default=1024,
    show_default=True,
    help="Held-out tokens for the perplexity check (0 = skip).",
)
def export(quant, group_size, draft_quant, **options):
    """Quantize a target (and its drafter) and export them as one bundle."""
    platform, out = options["platform"], options.pop("out")
    modules, extra = TARGET_EXTRAS.get(platform, ((), ""))
    for module in modules:
        require(module, extra, f"mtp-export --target {platform}")

    from mtp_edge.api import ExportOptions
    from mtp_edge.api import export as export_bundle
    from mtp_edge.quantize.schemes import (
        DEFAULT_REASON,
        DEFAULT_SCHEME,
        check_target_scheme,
        default_group_size,
    )

    if out is not None:  # the default (bundles/<model>-<target>) is checked once it is known
        from mtp_edge.exporter.bundle import check_writable

        check_writable(Path(out))
    if quant is None and platform in DEFAULT_REASON:
        say(f"[quantize] default {DEFAULT_REASON[platform]}")
    quant = quant or DEFAULT_SCHEME[platform]
    if group_size is None:
        group_size = default_group_size(quant, platform)
    check_target_scheme(platform, quant, group_size)
    if draft_quant is not None:
        check_target_scheme(platform, draft_quant, group_size)
    options = ExportOptions(
        quant=quant, group_size=group_size, draft_quant=draft_quant or quant, **options
    )
    bundle, manifest = export_bundle(options, out, progress=say)
    click.echo(json.dumps({"bundle": str(bundle), "quality": manifest.quality}))
