"""What export_bundle (export.py) hands a platform module, and the pieces they share.

A platform module (exporter/executorch.py, onnx.py, coreml.py: one per `mtp-export --target`,
found through export.PLATFORM_MODULES) provides two functions and is called through nothing
else:

- `check(job: ExportJob) -> None`: the refusals that need no export (the platform's weight
  schemes, drafters it cannot carry), run before the slow part;
- `export(job: ExportJob, directory: Path) -> (models, settings)`: write the platform's files
  into `directory`; `models` maps each file's role ("target", and "drafter" / "drafter_vocab"
  when the drafter has them) to its ModelFile (sha256 left empty: the bundle writer hashes), and
  `settings` holds the DrafterSpec fields only this platform knows (how its drafter runs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mtp_edge.errors import UserError
from mtp_edge.manifest import ModelFile

if TYPE_CHECKING:
    from mtp_edge.checkpoints import LoadedModel
    from mtp_edge.mtp import MTPHead


@dataclass
class ExportOptions:
    platform: str = "android"  # android | onnx | coreml (`--target` on the command line)
    model: str = "default"
    drafter: str = "auto"  # auto | none | ngram | mtp | path to a draft model
    heads: str | None = None  # MTP heads file (default: the heads shipped for the model)
    k: int = 4
    quant: str = "8da8w"  # quantize.schemes.DEFAULT_SCHEME["android"]
    group_size: int = 0
    embedding_quant: str = "8w"
    draft_quant: str = "8da8w"
    max_seq_len: int = 2048
    max_chunk: int = 128  # most tokens per call: prefill chunk, and the verify width limit
    quality_tokens: int = 1024  # held-out tokens for the perplexity check (0 = skip)
    # How the runtime drafts with a model drafter unless told otherwise (stored in the
    # manifest): prompt lookup first where the context's last MIN..MAX tokens occurred before
    # ("none": the model alone), and no draft below this first-token confidence. Measured best
    # on the default bundle (benchmarks/README.md, "Drafting policy").
    lookup: str = "2-3"
    draft_confidence: float = 0.5
    # android: the attention kernel the programs call (exporter/executorch.py): "mtp", ours,
    # row-exact, so that a verification is one call; "executorch", llama.custom_sdpa, which
    # ExecuTorch's stock runners carry, with a verify method that calls it once per row.
    attention_kernel: str = "mtp"
    # A platform that quantizes while loading (android) loads and lowers in a child process,
    # so that what lowering leaves allocated is gone before the quality checks (export.py).
    # False keeps everything in this process (a debugger sees it all).
    isolate: bool = True


@dataclass
class ExportJob:
    """What a platform exports: the loaded target and drafter, and the bundle's limits."""

    options: ExportOptions
    target: LoadedModel
    drafter_kind: str  # none | ngram | mtp | draft-lm
    draft: MTPHead | LoadedModel | None  # mtp: the heads; draft-lm: the draft model
    max_seq_len: int  # positions the cache holds
    max_chunk: int  # most tokens one target call takes
    progress: Callable[[str], None]

    @property
    def head(self) -> MTPHead | None:
        return self.draft if self.drafter_kind == "mtp" else None

    @property
    def draft_model(self) -> LoadedModel | None:
        return self.draft if self.drafter_kind == "draft-lm" else None


class Platform(Protocol):
    """A platform module, as export_bundle calls it (module doc)."""

    def check(self, job: ExportJob) -> None: ...

    def export(self, job: ExportJob, directory: Path) -> tuple[dict[str, ModelFile], dict]: ...


def refuse_self_heads(job: ExportJob) -> None:
    """Only ExecuTorch runs heads with a cache of their own (EAGLE's self attention) so far."""
    if job.head is not None and job.head.has_own_cache:
        platform = job.options.platform
        raise UserError(
            f"--target {platform} does not run self-attending (EAGLE) MTP heads yet: "
            "export them with --target android, or pass heads trained with --attention none"
        )


def draft_vocabulary(head: MTPHead, directory: Path) -> ModelFile:
    """Write drafter_vocab.json, the head's draft index -> target token id, so that the runtime
    maps draft logits back without running the model."""
    ids = head.draft_ids.tolist()
    (directory / "drafter_vocab.json").write_text(json.dumps({"draft_ids": ids}))
    return ModelFile("drafter_vocab.json", "", {}, {})


def head_settings(head: MTPHead) -> dict:
    """The DrafterSpec fields every platform records for an MTP head."""
    c = head.config
    return {"draft_vocab_size": c.draft_vocab_size, "hidden_size": c.hidden_size}
