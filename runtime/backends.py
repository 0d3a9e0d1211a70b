"""Backends by name. Each backend is one module with the same five entry points:

- `available() -> bool`: whether it runs on this machine (Core ML: Apple platforms only);
- `open_target(bundle) -> Session`: the bundle's target model on its static KV cache;
- `open_program(path, max_seq_len, max_chunk) -> Session | None`: an exported target file alone,
  before there is a bundle (the exporter's quality checks; None where it cannot run here);
- `open_mtp_step(bundle, target) -> (step, cache_len)`: the bundle's MTP head as a draft step
  `step(h, tokens, position) -> (draft_logits, next_h)`, and the cache length that bounds
  drafting (None: the head has no cache); `target()` opens the target session (once) for a
  head that runs on the target's cache;
- `open_draft_model(bundle) -> Session`: the bundle's separate draft model.

Modules are imported on first use: each pulls in its runtime (ExecuTorch, onnxruntime,
coremltools), which the others do not need.
"""

from __future__ import annotations

import importlib
import types

from mtp_edge.errors import UserError, require

MODULES = {
    "executorch": "mtp_edge.runtime.executorch_session",
    "onnxruntime": "mtp_edge.runtime.onnx_session",
    "coreml": "mtp_edge.runtime.coreml_session",
}
# The pip extra whose package a backend needs (ExecuTorch is a required dependency; Core ML
# runs on Apple platforms only, where its module says so before it imports coremltools).
EXTRAS = {"onnxruntime": ("onnxruntime", "onnx")}


def backend(name: str) -> types.ModuleType:
    """The module of the backend called `name` (the manifest's `backend`)."""
    if name not in MODULES:
        raise UserError(
            f"bundle backend '{name}' is not supported by this runtime (it runs "
            f"{', '.join(MODULES)}): re-export the bundle"
        )
    if name in EXTRAS:
        module, extra = EXTRAS[name]
        require(module, extra, f"a bundle for {name}")
    return importlib.import_module(MODULES[name])


def refuse_self_heads(manifest, name: str) -> None:
    """Self-attending (EAGLE) heads, with a cache of their own, run on ExecuTorch only."""
    if manifest.drafter.own_cache:
        raise UserError(
            f"this bundle's self-attending MTP heads run on ExecuTorch only, not on {name}: "
            "re-export it with --target android"
        )
