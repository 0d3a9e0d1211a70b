"""Opening a bundle: check its manifest, then open its target and drafter on its backend."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_edge.errors import UserError
from mtp_edge.manifest import MANIFEST, TOKENIZER_FILES, Manifest
from mtp_edge.platforms import by_backend
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
    """The bundle at `path`, its manifest checked against its hashed files. The manifest names
    every other file's sha256, so an edit to a program or the tokenizer is refused; an edit to
    the manifest's own numbers is caught here against the tokenizer's metadata (vocabulary,
    bos/eos), and when the target opens against the program's own constants (cache length,
    chunk, vocabulary: `check_manifest`)."""
    path = Path(path)
    manifest = Manifest.load(path)
    tokenizer = Tokenizer.load(path)
    facts = {
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_ids": tokenizer.eos_ids,
        "chat_template": tokenizer.chat_template,
    }
    check_manifest(path, manifest, facts, TOKENIZER_FILES["tokenizer_meta"])
    return Bundle(path, manifest, tokenizer)


def check_manifest(path: Path, manifest: Manifest, facts: dict, source: str) -> None:
    """Refuse a manifest whose values differ from what a hashed file of the bundle (`source`)
    says: `facts` maps manifest keys ("drafter.k" for the drafter's) to the file's values. A
    wrong cache length or vocabulary would otherwise reach a kernel as an out-of-range index."""
    for key, truth in facts.items():
        section, _, name = key.rpartition(".")
        said = getattr(manifest.drafter if section == "drafter" else manifest, name)
        if key == "eos_ids" and isinstance(said, list):
            said = list(dict.fromkeys(said))  # the order kept, repeats dropped, as the tokenizer
        if said != truth:
            raise UserError(
                f"bundle {path}: {MANIFEST} says {key} is {_short(said)} but {source} was "
                f"exported with {_short(truth)} (the manifest was edited): restore its "
                f"{MANIFEST} or re-export the bundle"
            )


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def target_session(bundle: Bundle) -> Session:
    """The bundle's target session (opened once: a drafter that is a method of the target's
    program runs on the same loaded program and cache)."""
    if bundle.session is None:
        bundle.session = backend(bundle.manifest.backend).open_target(bundle)
    return bundle.session


def bundle_drafter(bundle: Bundle, min_confidence: float = 0.0):
    """The drafter a bundle carries as a program (mtp or draft-lm); None for none/ngram."""
    m = bundle.manifest
    needs = {"mtp": ["drafter_vocab"], "draft-lm": ["drafter"]}.get(m.drafter.kind, [])
    row = by_backend(m.backend)
    in_target = m.drafter.method is not None or (row is not None and row.head_in_target)
    if m.drafter.kind == "mtp" and not in_target:
        needs.append("drafter")  # a head in a program of its own
    for role in needs:
        if role not in m.models:
            raise UserError(
                f"bundle {bundle.path}: {MANIFEST} says drafter.kind is '{m.drafter.kind}' but "
                f"names no models.{role} file (the manifest was edited): restore its {MANIFEST} "
                "or re-export the bundle"
            )
    if m.drafter.kind == "mtp":
        step, cache_len = backend(m.backend).open_mtp_step(bundle, lambda: target_session(bundle))
        entry = m.models["drafter_vocab"]
        vocab = json.loads((bundle.path / entry.file).read_text())
        ids = torch.tensor(vocab["draft_ids"])
        if m.drafter.draft_vocab_size is not None:
            facts = {"drafter.draft_vocab_size": len(ids)}
            check_manifest(bundle.path, m, facts, entry.file)
        limit = None if cache_len is None else (lambda: cache_len)
        return MtpDrafter(
            step, ids, m.vocab_size, min_confidence, limit, feeds_context=m.drafter.own_cache
        )
    if m.drafter.kind == "draft-lm":
        return DraftModelDrafter(backend(m.backend).open_draft_model(bundle), min_confidence)
    return None
