"""The Python API: what the commands do, as functions a program can call.

- `assemble(LoadOptions(...))` loads a bundle or a model with its drafter and returns a ready
  `Generator` (runtime/assemble.py); `generate(gen.session, gen.encode(prompt), gen.drafter,
  gen.config)` decodes with it (runtime/loop.py).
- `export(ExportOptions(...))` writes a bundle, checking the exported programs through the
  runtime of their platform (exporter/ itself never imports the runtime).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mtp_edge.devices.acceptance import measure_bundle_acceptance
from mtp_edge.exporter.export import ExportOptions, export_bundle
from mtp_edge.manifest import PLATFORMS, Manifest
from mtp_edge.runtime.assemble import Generator, LoadOptions, assemble
from mtp_edge.runtime.backends import backend
from mtp_edge.runtime.loop import GenerationConfig, GenerationResult, generate
from mtp_edge.texts import heldout_text

__all__ = [
    "ExportOptions",
    "GenerationConfig",
    "GenerationResult",
    "Generator",
    "LoadOptions",
    "assemble",
    "export",
    "generate",
]


def export(
    options: ExportOptions, out: str | Path | None = None, progress: Callable[[str], None] = print
) -> tuple[Path, Manifest]:
    """Quantize and export `options.model` (and its drafter) into a bundle directory."""

    def open_program(path: Path, max_seq_len: int):
        """The exported target's forward -> logits, for the quality report (None: cannot run
        here)."""
        session = backend(PLATFORMS[options.platform]).open_program(
            path, max_seq_len, options.max_chunk
        )
        if session is None:
            return None
        return lambda tokens, start: session.forward(tokens, start).logits

    def measure(directory: Path, target, draft) -> dict:
        heldout = target.tokenizer.encode(heldout_text())
        return measure_bundle_acceptance(directory, target, draft, heldout, progress)

    return export_bundle(
        options, Path(out) if out else None, open_program, progress=progress, measure=measure
    )
