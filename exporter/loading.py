"""Loading for an export, shared by the exporting process and the child that lowers
(exporter/lowering_parent.py, lowering_child.py): the target (quantized as it is read where the
platform declares a load hook) and its drafter, the fp32 reference perplexity, and the drafter
as the manifest records it. Neither side imports the other; both import this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mtp_edge.checkpoints import (
    Checkpoint,
    LoadedModel,
    load_model,
    model_vocabulary,
    open_checkpoint,
)
from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import ExportJob, ExportOptions, PlatformModule, load_hook
from mtp_edge.logs import progress_bar
from mtp_edge.manifest import DrafterSpec
from mtp_edge.memory import StageClock, return_freed_memory
from mtp_edge.quantize.quality import StreamedPerplexity, perplexity

# forward(tokens, start) -> logits [T, V]: how the exporter runs what it exported. The API
# passes the runtime's session for the target's backend, so exporter/ never imports runtime/.
Forward = Callable[[list[int], int], torch.Tensor]


@contextmanager
def counting_tokens(forward: Forward, desc: str, total: int) -> Iterator[Forward]:
    """`forward` with a progress bar of the tokens it is fed (a quality check's work)."""
    with progress_bar(total, desc, unit="tok") as bar:

        def counted(tokens: list[int], start: int) -> torch.Tensor:
            logits = forward(tokens, start)
            bar.update(len(tokens))
            return logits

        yield counted
        bar.update(max(0, total - bar.n))


def eager_forward(model, max_seq_len: int) -> Forward:
    model.setup_cache(max_seq_len)

    @torch.inference_mode()
    def forward(tokens: list[int], start: int) -> torch.Tensor:
        ids = torch.tensor([tokens])
        return model(ids, torch.tensor([start]), kv_len=start + len(tokens))[0]

    return forward


def load_drafter(options: ExportOptions, target: LoadedModel, make_hook=None):
    """(kind, what to export): ("none"|"ngram", None), ("mtp", MTPHead), ("draft-lm", model).
    `make_hook(options, skeleton, draft=True)`: the platform's quantize-on-load hook, if any."""
    from mtp_edge.mtp import auto_drafter, heads_file, load_heads

    kind = options.drafter
    if kind == "auto":
        kind = auto_drafter(target.name, options.heads)
    if kind in ("none", "ngram"):
        return kind, None
    if kind == "mtp":
        heads = heads_file(target.name, options.heads)
        if heads is None:
            raise UserError(
                f"no MTP heads ship for {target.name}: train them with "
                f"mtp-train --model {options.model} --out heads.safetensors, then pass --heads"
            )
        return "mtp", load_heads(heads, target.model, target.name, target.fingerprint)
    # Compare vocabularies from the draft's tokenizer and config alone, before its weights load
    # (gigabytes, most of a minute).
    draft_tokenizer, draft_vocab_size = model_vocabulary(kind)
    if (
        draft_vocab_size != target.config.vocab_size
        or draft_tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab()
    ):
        raise UserError(
            "the draft model's vocabulary differs from the target's: use a draft model with "
            "the target's tokenizer, or --drafter ngram"
        )
    hook = make_hook(options, open_checkpoint(kind).skeleton(), draft=True) if make_hook else None
    return "draft-lm", load_model(kind, on_part=counted_parts(hook, "loading draft model"))


@dataclass
class Loaded:
    """The target and drafter as a platform exports them (load_for_export)."""

    job: ExportJob
    quality: dict  # the fp32 reference perplexity and how it was taken
    quantized: bool  # the target was quantized as it was read (the platform's load_hook)


def load_for_export(
    options: ExportOptions,
    platform: PlatformModule,
    checkpoint: Checkpoint,
    heldout: list[int],
    max_seq_len: int,
    max_chunk: int,
    clock: StageClock,
    progress: Callable[[str], None],
) -> Loaded:
    """Load the target (quantizing each part as it is read where the platform has a
    `load_hook`) and its drafter, check the platform takes them, and take the fp32 reference
    perplexity on `heldout` (streamed a layer at a time while loading, or on the loaded model)."""
    # A platform that quantizes with torchao does it as each part of the model is read, so the
    # export never holds the float model (its row's `load_hook`); the others convert floats.
    make_hook = load_hook(options.platform)
    hook = make_hook(options, checkpoint.skeleton()) if make_hook else None
    quality: dict = {}
    stream = StreamedPerplexity(checkpoint.config, heldout) if heldout and hook else None

    def on_part(model, name, module) -> None:
        if stream is not None:  # the float part, before the hook quantizes it
            stream.feed(name, module)
        if hook is not None:
            hook(model, name, module)
            return_freed_memory()

    steps = ["load"] + (["quantize"] if hook else []) + (["fp32 perplexity"] if stream else [])
    progress(
        f"[load] {options.model}"
        + (f" ({', '.join(steps[1:])}, a layer at a time)" if hook else "")
    )
    fp32 = math.nan
    with clock.stage(", ".join(steps)):
        target = load_model(options.model, on_part=counted_parts(on_part, "loading target"))
        if stream is not None:
            tied = None if "lm_head.weight" in checkpoint.readers else "embed_tokens.weight"
            fp32 = stream.finish(checkpoint.tensor(tied) if tied else None)
            quality["perplexity_fp32_method"] = "streamed while loading, a layer at a time"
    with clock.stage("load drafter"):
        drafter_kind, draft = load_drafter(options, target, make_hook)
    job = ExportJob(options, target, drafter_kind, draft, max_seq_len, max_chunk, progress)
    platform.check(job)
    if heldout and stream is None:
        progress(f"[quality] fp32 perplexity on {len(heldout)} held-out tokens")
        with (
            clock.stage("fp32 perplexity"),
            counting_tokens(
                eager_forward(target.model, max_seq_len), "fp32 perplexity", len(heldout)
            ) as forward,
        ):
            fp32 = perplexity(forward, heldout, max_chunk)
    if heldout:
        if not math.isfinite(fp32):  # nothing quantized from it could be judged, or be right
            raise UserError(
                f"the fp32 perplexity of {target.name} on the held-out text is {fp32}: the model "
                "computes non-finite values, so it is corrupt; re-download or re-convert it"
            )
        quality["perplexity_fp32"] = round(fp32, 4)
    return Loaded(job, quality, hook is not None)


def counted_parts(hook, desc: str):
    """`hook` (a load_model on_part hook, or None) with a progress bar over the model's parts."""
    bar = None

    def on_part(model, name, module) -> None:
        nonlocal bar
        if bar is None:
            bar = progress_bar(len(model.parts()), desc, unit="part")
        if hook is not None:
            hook(model, name, module)
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()

    return on_part


def drafter_spec(options: ExportOptions, kind: str, draft, settings: dict) -> DrafterSpec:
    """The manifest's drafter: its kind, k, the runtime's default policy for a model drafter,
    and the platform's `settings` (how its exported drafter runs)."""
    fields: dict = {}
    if kind in ("mtp", "draft-lm"):  # the runtime's defaults for this drafter
        if options.lookup != "none":
            fields["lookup"] = options.lookup
        fields["draft_confidence"] = options.draft_confidence
    if kind == "draft-lm":
        fields["model_name"] = draft.name
    if kind == "mtp":
        fields["recipe"] = draft.config.recipe
    return DrafterSpec(kind=kind, k=options.k, **fields, **settings)
