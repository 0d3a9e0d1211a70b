"""Opening a bundle: check its manifest, then build the session for its backend and its drafter."""

from __future__ import annotations

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
    session: Session | None = None  # the target's, once opened: a drafter method may share it


def open_bundle(path: str | Path) -> Bundle:
    path = Path(path)
    manifest = Manifest.load(path)
    return Bundle(path, manifest, Tokenizer.load(path))


def target_session(bundle: Bundle) -> Session:
    """The bundle's target session (opened once: a drafter that is a method of the target's
    program runs on the same loaded program and cache)."""
    if bundle.session is None:
        bundle.session = _open_target(bundle)
    return bundle.session


def _open_target(bundle: Bundle) -> Session:
    m = bundle.manifest
    file = bundle.path / m.models["target"].file
    if m.backend == "executorch":
        from mtp_edge.runtime.executorch_session import ExecuTorchSession

        row_exact = m.models["target"].quant.get("attention") == "mtp"
        return ExecuTorchSession(file, m.max_seq_len, m.vocab_size, m.max_chunk, row_exact)
    if m.backend == "onnxruntime":
        from mtp_edge.runtime.onnx_session import OnnxSession

        method = m.models["target"].methods["forward"]
        return OnnxSession(file, method, m.max_seq_len, m.vocab_size, m.max_chunk)
    if m.backend == "coreml":
        from mtp_edge.runtime.coreml_session import CoreMLSession

        methods = m.models["target"].methods
        return CoreMLSession(file, methods, m.max_seq_len, m.vocab_size, m.max_chunk)
    raise UserError(f"bundle backend '{m.backend}' is not supported by this runtime")


def bundle_drafter(bundle: Bundle, min_confidence: float = 0.0):
    """The drafter a bundle carries as a program (mtp or draft-lm); None for none/ngram."""
    import json

    m = bundle.manifest
    kind = m.drafter.get("kind", "none")
    if kind == "mtp":
        from mtp_edge.runtime.mtp_drafter import MtpDrafter

        cache_len = None  # set for a head that writes a cache: drafting stops at its end
        own = bool(m.drafter.get("own_cache"))  # a self (EAGLE) head, fed the verified rows
        if own and m.backend != "executorch":
            raise UserError(
                f"this bundle's self-attending MTP heads run on ExecuTorch only, not on "
                f"{m.backend}: re-export it with --target android"
            )
        if m.backend == "onnxruntime":
            from mtp_edge.runtime.onnx_session import OnnxStep

            drafter = m.models["drafter"]
            # A head that reads the target's cache is bound to the target session's buffers.
            shared = target_session(bundle) if m.drafter.get("reads_target_cache") else None
            step = OnnxStep(bundle.path / drafter.file, drafter.methods["forward"], shared)
            cache_len = None if shared is None else shared.max_seq_len
        elif m.backend == "coreml":
            from mtp_edge.runtime.coreml_session import CoreMLStep

            shared = target_session(bundle) if m.drafter.get("reads_target_cache") else None
            step = CoreMLStep(bundle.path / m.models["target"].file, shared)
            cache_len = None if shared is None else shared.max_seq_len
        elif "method" in m.drafter:  # a method of the target's program, on its cache
            from mtp_edge.runtime.executorch_session import ExecuTorchStep

            session = target_session(bundle)
            step = ExecuTorchStep(program=session.program, method=m.drafter["method"])
            cache_len = session.max_seq_len
        else:  # a program of its own (a self head's with its own cache)
            from mtp_edge.runtime.executorch_session import ExecuTorchStep

            chunk = m.drafter.get("max_chunk", 0) if own else 0
            step = ExecuTorchStep(bundle.path / m.models["drafter"].file, max_chunk=chunk)
            cache_len = m.max_seq_len if own else None
        vocab = json.loads((bundle.path / m.models["drafter_vocab"].file).read_text())
        ids = torch.tensor(vocab["draft_ids"])
        limit = None if cache_len is None else (lambda: cache_len)
        return MtpDrafter(step, ids, m.vocab_size, min_confidence, limit, feeds_context=own)
    if kind == "draft-lm":
        from mtp_edge.runtime.drafters import DraftModelDrafter

        drafter = m.models["drafter"]
        file = bundle.path / drafter.file
        if m.backend == "onnxruntime":
            from mtp_edge.runtime.onnx_session import OnnxSession

            method = drafter.methods["forward"]
            session = OnnxSession(file, method, m.max_seq_len, m.vocab_size, m.max_chunk)
        else:
            from mtp_edge.runtime.executorch_session import ExecuTorchSession

            session = ExecuTorchSession(file, m.max_seq_len, m.vocab_size, m.max_chunk)
        return DraftModelDrafter(session, min_confidence)
    return None
