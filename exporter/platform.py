"""What an export is asked (ExportOptions, and `resolve_options`, which decides and checks it
once), the job a platform module gets (ExportJob, built by exporter/loading.py in whichever
process loads the model: the exporting one, or the child that lowers), and the pieces those
modules share.

A platform module (exporter/executorch.py, onnx.py, coreml.py: one per `mtp-export --target`,
named by its row of the platform table, mtp_edge/platforms.py) provides two functions:

- `check(job: ExportJob) -> None`: the refusals that need no export (drafters it cannot carry),
  run before the slow part;
- `export(job: ExportJob, directory: Path) -> (models, settings)`: write the platform's files
  into `directory`; `models` maps each file's role ("target", and "drafter" / "drafter_vocab"
  when the drafter has them) to its ModelFile (sha256 left empty: the bundle writer hashes), and
  `settings` holds the DrafterSpec fields only this platform knows (how its drafter runs);

and, where its row declares `load_hook`, `load_hook(options, skeleton, draft=False)`: a hook
that quantizes each part of a model as the loader reads it (exporter/loading.py).

A platform whose heads run in a program of their own (not inside the target's) also provides
`check_heads(head, manifest, reexport)` and `export_heads(head, embedding, target, manifest,
directory, progress) -> (models, settings)`, for a heads-only update (exporter/update_heads.py).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from mtp_edge.errors import UserError, require
from mtp_edge.manifest import ModelFile
from mtp_edge.platforms import platform

if TYPE_CHECKING:
    from mtp_edge.checkpoints import LoadedModel
    from mtp_edge.mtp import MTPHead


@dataclass
class ExportOptions:
    platform: str = "android"  # a row of mtp_edge/platforms.py (`--target` on the command line)
    model: str = "default"
    drafter: str = "auto"  # auto | none | ngram | mtp | path to a draft model
    heads: str | None = None  # MTP heads file (default: the heads shipped for the model)
    # None: DEFAULT_K, or with quant "auto" the k measured fastest here (exporter/choose.py)
    k: int | None = None
    # None: decided by resolve_options (the platform's default scheme; its group size); "auto":
    # each scheme of the platform exported and timed on this machine (exporter/choose.py)
    quant: str | None = None
    # quant "auto"'s candidates (None: every scheme of the platform's row)
    auto_schemes: tuple[str, ...] | None = None
    group_size: int | None = None
    embedding_quant: str = "8w"
    # android: the target's LM head in a scheme of its own (None: the scheme's own head), e.g.
    # "8da6w-avx2", 6-bit weights as llama.cpp's Q4_K_M keeps its output tensor
    head_quant: str | None = None
    draft_quant: str | None = None  # None: as `quant`
    # the drafter's group size, decided by resolve_options: `group_size` where the drafter's
    # scheme groups its weights as the target's does (both in blocks, or both per channel),
    # else the drafter scheme's own default (an 8-bit per-channel drafter beside a 4-bit target
    # in groups, and the reverse)
    draft_group_size: int | None = None
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
    # so that what lowering leaves allocated is gone before the quality checks (pipeline.py).
    # None: a child for a model of any size that matters, this process for a model so small
    # that what lowering leaves is noise (pipeline.lowers_in_child); False keeps everything in
    # this process (a debugger sees it all); True always uses a child.
    isolate: bool | None = None


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


class PlatformModule(Protocol):
    """A platform's exporter module, as loading.py, pipeline.py and lowering_child.py call it
    (module doc)."""

    def check(self, job: ExportJob) -> None: ...

    def export(self, job: ExportJob, directory: Path) -> tuple[dict[str, ModelFile], dict]: ...


def platform_module(name: str) -> PlatformModule:
    """The exporter module of platform `name` (imported on first use: each brings its own
    toolchain, ExecuTorch, onnxruntime or coremltools)."""
    return cast(PlatformModule, importlib.import_module(platform(name).exporter))


def load_hook(name: str):
    """Platform `name`'s quantize-on-load hook maker, where its row declares one; else None."""
    return platform_module(name).load_hook if platform(name).load_hook else None  # type: ignore[attr-defined]


DEFAULT_K = 4  # --k when not given (and not measured: --quant auto)
AUTO_KS = (2, 3, 4, 5)  # the k --quant auto measures when --k is not given


def resolve_options(
    options: ExportOptions, progress: Callable[[str], None] = print
) -> ExportOptions:
    """`options` with every choice left open decided (the platform's default scheme, the
    scheme's group size, the drafter's scheme, k), after checking each: the one place an
    export's options are checked, so that the API and mtp-export agree. Raises UserError, before
    anything loads. `progress` hears why the default scheme is the default.

    `quant="auto"` stays "auto" (exporter/choose.py measures the candidates, auto_candidates)
    unless there is nothing to measure: one scheme and a given k."""
    from mtp_edge.quantize.schemes import check_platform_scheme, default_group_size

    row = platform(options.platform)
    modules, extra = row.export_needs
    for module in modules:
        require(module, extra, f"mtp-export --target {row.name}")
    if options.k is not None and not 1 <= options.k <= 15:
        raise UserError(f"--k must be in 1..15, got {options.k}")
    check_lookup(options.lookup)
    if not 0 <= options.draft_confidence < 1:
        raise UserError(f"--draft-confidence must be in [0, 1), got {options.draft_confidence}")
    if options.head_quant is not None:
        check_head_quant(row, options)
    if options.quant == "auto":
        schemes, ks = auto_candidates(options)
        if len(schemes) > 1 or len(ks) > 1:
            return options
        progress(
            f"[quantize] auto: --target {row.name} has one scheme, {schemes[0]}, and k is "
            f"{ks[0]}: nothing to measure"
        )
        options = replace(options, quant=schemes[0], k=ks[0])
    elif options.auto_schemes is not None:
        raise UserError("auto_schemes lists the candidates of quant='auto' only")
    if options.k is None:
        options = replace(options, k=DEFAULT_K)
    quant = options.quant
    if quant is None:
        progress(f"[quantize] default {row.why_default}")
        quant = row.default_scheme
    group_size = options.group_size
    if group_size is None:
        group_size = default_group_size(quant, row.name)
    check_platform_scheme(row.name, quant, group_size)
    draft_quant = options.draft_quant or quant
    draft_group = options.draft_group_size
    if draft_group is None:
        draft_default = default_group_size(draft_quant, row.name)
        alike = (draft_default > 0) == (default_group_size(quant, row.name) > 0)
        draft_group = group_size if alike else draft_default
    check_platform_scheme(row.name, draft_quant, draft_group)
    return replace(
        options,
        quant=quant,
        group_size=group_size,
        draft_quant=draft_quant,
        draft_group_size=draft_group,
    )


def check_head_quant(row, options: ExportOptions) -> None:
    """--head-quant: android's, a scheme an LM head takes there, with a scheme chosen."""
    from mtp_edge.quantize.schemes import HEAD_SCHEMES

    if row.name != "android":
        raise UserError(
            f"--head-quant is for --target android (ExecuTorch programs), not {row.name}: "
            "drop --head-quant"
        )
    if options.quant == "auto":
        raise UserError(
            "--head-quant cannot be combined with --quant auto, which measures whole schemes: "
            "choose the scheme with --quant, or drop --head-quant"
        )
    if options.head_quant not in HEAD_SCHEMES:
        raise UserError(
            f"--head-quant {options.head_quant} is not a head scheme: choose one of "
            + ", ".join(HEAD_SCHEMES)
        )


def auto_candidates(options: ExportOptions) -> tuple[list[str], list[int]]:
    """--quant auto's candidate schemes (each at its default group size) and k values, checked:
    every scheme of the platform (or `auto_schemes`; 8da8w-avx2 and 8da4w-mix-avx2 only where
    this CPU's int8 path
    is AVX2's: its kernel is for CPUs without an int8 dot product), and AUTO_KS unless --k is
    given (or there is no drafter: k means nothing then). k is a runtime setting of the bundle
    (the manifest's DrafterSpec.k) wherever the target's forward verifies at any width, so its
    candidates need no export of their own; where the verify method's width is baked into the
    program (the row's `verify_width_in_program`, or android's --attention-kernel executorch),
    k stays DEFAULT_K unless given."""
    from mtp_edge.machine import int8_path
    from mtp_edge.platforms import OWN_KERNEL_SCHEMES
    from mtp_edge.quantize.schemes import check_platform_scheme, default_group_size

    row = platform(options.platform)
    if options.group_size is not None:
        raise UserError(
            "--group-size cannot be combined with --quant auto, which measures each scheme at "
            "its default group size: drop --group-size, or choose the scheme with --quant"
        )
    schemes = list(options.auto_schemes or row.schemes)
    if not options.auto_schemes and int8_path().name != "avx2":
        schemes = [s for s in schemes if s not in OWN_KERNEL_SCHEMES]
    if not schemes:
        raise UserError("auto_schemes is empty: name at least one scheme, or leave it None")
    for scheme in schemes:
        check_platform_scheme(row.name, scheme, default_group_size(scheme, row.name))
    if options.draft_quant is not None:
        check_platform_scheme(
            row.name, options.draft_quant, default_group_size(options.draft_quant, row.name)
        )
    if options.quality_tokens <= 0:
        raise UserError(
            "--quant auto keeps schemes within its perplexity bound, so it needs the perplexity "
            "check: leave --quality-tokens above 0"
        )
    if options.k is not None:
        ks = [options.k]
    elif (
        options.drafter == "none"
        or row.verify_width_in_program
        or options.attention_kernel != "mtp"  # android's verify method, when not our op
    ):
        ks = [DEFAULT_K]
    else:
        ks = list(AUTO_KS)
    return schemes, ks


def check_lookup(text: str) -> None:
    """--ngram-sizes (mtp-export's) takes none or MIN-MAX n-gram sizes, 1 <= MIN <= MAX."""
    if text == "none":
        return
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise UserError(
            f"--ngram-sizes takes none or MIN-MAX n-gram sizes such as 2-3, got {text!r}"
        )


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
