"""Opening a bundle: check its manifest, then build the session for its backend and its drafter."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_edge.errors import UserError
from mtp_edge.manifest import Manifest
from mtp_edge.runtime.session import Session
from mtp_edge.tokenizer import Tokenizer


@dataclass
class Bundle:
    path: Path
    manifest: Manifest
    tokenizer: Tokenizer


def open_bundle(path: str | Path) -> Bundle:
    path = Path(path)
    manifest = Manifest.load(path)
    return Bundle(path, manifest, Tokenizer.load(path))


def target_session(bundle: Bundle) -> Session:
    m = bundle.manifest
    file = bundle.path / m.models["target"].file
    if m.backend == "executorch":
        from mtp_edge.runtime.executorch_session import ExecuTorchSession

        return ExecuTorchSession(file, m.max_seq_len, m.vocab_size, m.max_chunk)
    if m.backend == "coreml" and sys.platform != "darwin":
        raise UserError("Core ML bundles run only on macOS/iOS: use an android or onnx bundle here")
    raise UserError(f"bundle backend '{m.backend}' is not supported by this runtime")


def bundle_drafter(bundle: Bundle, min_confidence: float = 0.0):
    """The drafter a bundle carries as a program (mtp or draft-lm); None for none/ngram."""
    import json

    m = bundle.manifest
    kind = m.drafter.get("kind", "none")
    if kind == "mtp":
        from mtp_edge.runtime.executorch_session import ExecuTorchStep
        from mtp_edge.runtime.mtp_drafter import MtpDrafter

        step = ExecuTorchStep(bundle.path / m.models["drafter"].file)
        vocab = json.loads((bundle.path / m.models["drafter_vocab"].file).read_text())
        ids = torch.tensor(vocab["draft_ids"])
        return MtpDrafter(step, ids, m.vocab_size, min_confidence)
    if kind == "draft-lm":
        from mtp_edge.runtime.drafters import DraftModelDrafter
        from mtp_edge.runtime.executorch_session import ExecuTorchSession

        file = bundle.path / m.models["drafter"].file
        session = ExecuTorchSession(file, m.max_seq_len, m.vocab_size, m.max_chunk)
        return DraftModelDrafter(session, min_confidence)
    return None
