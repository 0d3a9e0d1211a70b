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

Which module is which backend's, and what it needs beyond the required dependencies, is the
platform table's (mtp_edge/platforms.py). Modules are imported on first use: each pulls in its
runtime (ExecuTorch, onnxruntime, coremltools), which the others do not need.
"""

from __future__ import annotations

import importlib
import types

from mtp_edge.errors import UserError, require
from mtp_edge.platforms import PLATFORMS, by_backend


def backend(name: str) -> types.ModuleType:
    """The module of the backend called `name` (the manifest's `backend`)."""
    row = by_backend(name)
    if row is None:
        known = ", ".join(p.backend for p in PLATFORMS.values())
        raise UserError(
            f"bundle backend '{name}' is not supported by this runtime (it runs "
            f"{known}): re-export the bundle"
        )
    modules, extra = row.run_needs
    for module in modules:
        require(module, extra, f"a bundle for {name}")
    return importlib.import_module(row.session)


def decoding_threads(name: str) -> int:
    """The threads backend `name` decodes with: its own count where its row declares one
    (ExecuTorch's pool), else torch's."""
    import torch

    row = by_backend(name)
    if row is not None and row.threads is not None:
        return getattr(backend(name), row.threads)() or torch.get_num_threads()
    return torch.get_num_threads()


def refuse_self_heads(manifest, name: str) -> None:
    """Self-attending (EAGLE) heads, with a cache of their own, run on ExecuTorch only."""
    if manifest.drafter.own_cache:
        raise UserError(
            f"this bundle's self-attending MTP heads run on ExecuTorch only, not on {name}: "
            "re-export it with --target android"
        )
