"""Opening a bundle: check its manifest, then open its target and drafter on its backend."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_edge.manifest import Manifest
from mtp_edge.runtime.backends import backend
from mtp_edge.runtime.drafters import DraftModelDrafter
from mtp_edge.runtime.mtp_drafter import MtpDrafter
from mtp_edge.runtime.session import Session
from mtp_edge.tokenizer import Tokenizer


@dataclass
class Bundle:
    path: Path
    manifest: Manifest
    tokenizer: Tokenizer
    session: Session | None = None  # the target's, once opened: a drafter method may share it


def open_bundle(path: str | Path) -> Bundle:
    path = Path(path)
    manifest = Manifest.load(path)
    return Bundle(path, manifest, Tokenizer.load(path))


def target_session(bundle: Bundle) -> Session:
    """The bundle's target session (opened once: a drafter that is a method of the target's
    program runs on the same loaded program and cache)."""
    if bundle.session is None:
        bundle.session = backend(bundle.manifest.backend).open_target(bundle)
    return bundle.session


def bundle_drafter(bundle: Bundle, min_confidence: float = 0.0):
    """The drafter a bundle carries as a program (mtp or draft-lm); None for none/ngram."""
    m = bundle.manifest
    if m.drafter.kind == "mtp":
        step, cache_len = backend(m.backend).open_mtp_step(bundle, lambda: target_session(bundle))
        vocab = json.loads((bundle.path / m.models["drafter_vocab"].file).read_text())
        ids = torch.tensor(vocab["draft_ids"])
        limit = None if cache_len is None else (lambda: cache_len)
        return MtpDrafter(
            step, ids, m.vocab_size, min_confidence, limit, feeds_context=m.drafter.own_cache
        )
    if m.drafter.kind == "draft-lm":
        return DraftModelDrafter(backend(m.backend).open_draft_model(bundle), min_confidence)
    return None
