"""`mtp-export`: load a target (and drafter), quantize, export, measure quality, write a bundle."""

from __future__ import annotations

import gc
import importlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from mtp_edge.checkpoints import (
    Checkpoint,
    LoadedModel,
    load_model,
    model_vocabulary,
    open_checkpoint,
)
from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import ExportJob, ExportOptions, Platform
from mtp_edge.logs import progress_bar
from mtp_edge.manifest import PLATFORMS, TOKENIZER_FILES, DrafterSpec, Manifest, ModelFile
from mtp_edge.memory import StageClock, return_freed_memory
from mtp_edge.quantize.quality import StreamedPerplexity, perplexity, verify_step_discrepancy
from mtp_edge.texts import heldout_text

# forward(tokens, start) -> logits [T, V]: how the exporter runs what it exported. The CLI passes
# the runtime's session for the target's backend, so exporter/ never imports runtime/.
Forward = Callable[[list[int], int], torch.Tensor]

# `--target NAME` -> the module that exports for it (its check and export: platform.py).
# Imported on first use: each brings its own toolchain (ExecuTorch, onnxruntime, coremltools).
PLATFORM_MODULES = {
    "android": "mtp_edge.exporter.executorch",
    "onnx": "mtp_edge.exporter.onnx",
    "coreml": "mtp_edge.exporter.coreml",
}
assert PLATFORM_MODULES.keys() == PLATFORMS.keys()


def platform_module(name: str) -> Platform:
    """The module that exports for platform `name` (a key of manifest.PLATFORMS)."""
    return cast(Platform, importlib.import_module(PLATFORM_MODULES[name]))


def check_lookup(text: str) -> None:
    """--lookup takes none or MIN-MAX n-gram sizes with 1 <= MIN <= MAX."""
    if text == "none":
        return
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise UserError(f"--lookup takes none or MIN-MAX n-gram sizes such as 2-3, got {text!r}")


def chat_format(tokenizer) -> dict | None:
    """The chat template rendered around a placeholder user message and split there, so that a
    runtime without jinja (the native core) forms the same prompt text by concatenation; with
    the frames of later turns and of a system prompt where the template renders them so."""
    if tokenizer.chat_template is None:
        return None
    marker = "\x00mtp-message\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    prefix, found, suffix = text.partition(marker)
    if not found:
        return None
    return {"prefix": prefix, "suffix": suffix, **_turn_frames(tokenizer, prefix, suffix)}


def _turn_frames(tokenizer, prefix: str, suffix: str) -> dict:
    """next_turn: the text between an assistant's answer and the next user message;
    system_prefix/system_suffix: the frame of a system prompt before the first user message.
    Each only if rendering a conversation is concatenating these pieces (checked on two turns);
    a runtime without them holds one turn per conversation (and no system prompt)."""
    marks = [f"\x00mtp-message-{i}\x00" for i in range(4)]

    def pieces(messages: list[dict]) -> list[str] | None:
        try:
            text = tokenizer.apply_chat_template(messages)
        except UserError:  # templates may refuse a role (no system prompt, say)
            return None
        out = []
        for message in messages:
            before, found, text = text.partition(message["content"])
            if not found:
                return None
            out.append(before)
        return [*out, text]

    turns = [("user", marks[0]), ("assistant", marks[1]), ("user", marks[2])]
    turns = [{"role": role, "content": content} for role, content in turns]
    two = pieces(turns)
    if two is None or two != [prefix, suffix, two[2], suffix] or not two[2]:
        return {}
    frames = {"next_turn": two[2]}
    system = pieces([{"role": "system", "content": marks[3]}, *turns])
    if system is not None and system[2:] == two[1:]:
        frames.update(system_prefix=system[0], system_suffix=system[1])
    return frames


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


def source_of(path: Path | str) -> dict:
    """What the manifest keeps of the checkpoint exported: its absolute path and format."""
    path = Path(path).resolve()
    return {"path": str(path), "format": "gguf" if path.suffix.lower() == ".gguf" else "hf"}


def default_out(options: ExportOptions, model_name: str) -> Path:
    return Path("bundles") / f"{model_name}-{options.platform}"


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
    from mtp_edge.mtp import load_heads, shipped_heads

    kind = options.drafter
    if kind == "auto":  # the best available: shipped heads for this model, else n-gram lookup
        kind = "mtp" if options.heads or shipped_heads(target.name) else "ngram"
    if kind in ("none", "ngram"):
        return kind, None
    if kind == "mtp":
        heads = options.heads or shipped_heads(target.name)
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


def export_bundle(
    options: ExportOptions,
    out: Path | None,
    open_program: Callable[[Path, int], Forward],
    progress: Callable[[str], None] = print,
    measure: Callable[[Path, LoadedModel, object], dict] | None = None,
) -> tuple[Path, Manifest]:
    """Export `options.model` for `options.platform` into the bundle directory `out`.

    `open_program(path, max_seq_len)` runs an exported file (for the quality report);
    `measure(bundle_dir, target, drafter)` measures the finished bundle through the runtime (the
    drafter's acceptance) and returns entries for the quality report.

    A platform that quantizes while loading (`load_hook`) loads and lowers in a process of its
    own (exporter/isolated.py): what lowering leaves allocated dies with that process, before
    the quality checks load the program. The others load and convert here.
    """
    from mtp_edge.exporter.bundle import check_writable, write_bundle

    if options.platform not in PLATFORMS:
        raise UserError(
            f"unknown target '{options.platform}': choose one of {', '.join(PLATFORMS)}"
        )
    platform = platform_module(options.platform)
    if not 1 <= options.k <= 15:
        raise UserError(f"--k must be in 1..15, got {options.k}")
    check_lookup(options.lookup)
    if not 0 <= options.draft_confidence < 1:
        raise UserError(f"--draft-confidence must be in [0, 1), got {options.draft_confidence}")
    clock = StageClock()
    return_freed_memory()  # the float parts read and dropped below must leave the process
    checkpoint = open_checkpoint(options.model)  # its tensors stay on disk for now
    tokenizer, config = checkpoint.tokenizer, checkpoint.config
    max_seq_len = min(options.max_seq_len, config.max_position_embeddings)
    max_chunk = min(options.max_chunk, max_seq_len)
    out = Path(out) if out is not None else default_out(options, checkpoint.name)
    check_writable(out)  # fail before the slow part, not after
    if options.platform == "android":
        forecast_memory(options, config, max_seq_len, progress)
    forecast_disk(options, config, out)
    quality: dict = {}
    heldout: list[int] = []
    if options.quality_tokens:
        heldout = tokenizer.encode(heldout_text())[: min(options.quality_tokens, max_seq_len)]
        quality["heldout_tokens"] = len(heldout)
    isolated = options.isolate and getattr(platform, "load_hook", None) is not None

    if isolated:
        from mtp_edge.exporter.isolated import export_in_child

        # Nothing of the model is loaded here: the child process loads, quantizes and lowers.
        target = LoadedModel(None, tokenizer, config, checkpoint.name, checkpoint.path)  # type: ignore[arg-type]
        draft = None
        del checkpoint

        def make(tmp: Path) -> tuple[dict, DrafterSpec]:
            lowered = export_in_child(options, tmp, heldout, max_seq_len, max_chunk, progress)
            clock.add(lowered.stages)
            quality.update(lowered.quality)
            return lowered.models, lowered.drafter

    else:
        loaded = load_for_export(
            options, platform, checkpoint, heldout, max_seq_len, max_chunk, clock, progress
        )
        del checkpoint
        target, draft = loaded.job.target, loaded.job.draft
        quality.update(loaded.quality)

        def make(tmp: Path) -> tuple[dict, DrafterSpec]:
            with clock.stage("export"):
                models, settings = platform.export(loaded.job, tmp)
                spec = drafter_spec(options, loaded.job.drafter_kind, draft, settings)
                if loaded.quantized:  # nothing below runs it, the exported program does
                    target.model = None
                loaded.job = None  # type: ignore[assignment]
                gc.collect()  # the exported graphs are cycles of many small objects
                return_freed_memory()
            return models, spec

    def build(tmp: Path) -> Manifest:
        models, spec = make(tmp)
        with clock.stage("quality checks"):
            manifest = checked(tmp, models, spec)
        manifest.export_log = clock.report()
        return manifest

    def checked(tmp: Path, models: dict, spec: DrafterSpec) -> Manifest:
        forward = open_program(tmp / models["target"].file, max_seq_len) if heldout else None
        if forward is None and heldout:
            progress(f"[quality] the exported {options.platform} model cannot run here: skipped")
        if forward is not None:
            progress("[quality] exported target perplexity")
            with counting_tokens(forward, "exported perplexity", len(heldout)) as counted:
                quality["perplexity_exported"] = round(perplexity(counted, heldout, max_chunk), 4)
            quality["perplexity_ratio"] = round(
                quality["perplexity_exported"] / quality["perplexity_fp32"], 4
            )
            progress(f"[quality] {options.k + 1}-token verify vs one-token steps")
            tokens = heldout[: max_chunk + 320]  # each fed twice: in steps, then k+1 wide
            with counting_tokens(forward, "verify vs steps", 2 * len(tokens)) as counted:
                quality["verify_vs_step"] = verify_step_discrepancy(
                    counted, tokens, options.k + 1, max_chunk
                )
        progress("[write] tokenizer and manifest")
        tokenizer.save(tmp)
        for role, file in TOKENIZER_FILES.items():  # hashed and checked like the programs
            models[role] = ModelFile(file, "", {}, {})
        return Manifest(
            target=options.platform,
            backend=PLATFORMS[options.platform],
            model_name=target.name,
            max_seq_len=max_seq_len,
            max_chunk=max_chunk,
            vocab_size=config.vocab_size,
            bos_id=tokenizer.bos_id,
            eos_ids=list(tokenizer.eos_ids),
            chat_template=tokenizer.chat_template,
            chat_format=chat_format(tokenizer),
            models=models,
            drafter=spec,
            quality=quality,
            source=source_of(target.path),
        )

    finish = None
    if measure is not None:

        def finish(directory: Path, manifest: Manifest) -> None:
            with clock.stage("drafter acceptance"):
                manifest.quality.update(measure(directory, target, draft))
            manifest.export_log = clock.report()

    manifest = write_bundle(out, build, finish)
    log = manifest.export_log
    for row in log["stages"]:
        where = f" (+{row['other_mb']} MB in the parent)" if row.get("other_mb") else ""
        progress(
            f"[time] {row['stage']}: {row['seconds']:.0f} s, "
            f"peak RSS {row['peak_rss_mb']} MB{where}"
        )
    progress(f"[done] {out} in {log['seconds']:.0f} s, peak RSS {log['peak_rss_mb']} MB")
    return out, manifest


@dataclass
class Loaded:
    """The target and drafter as a platform exports them (load_for_export)."""

    job: ExportJob
    quality: dict  # the fp32 reference perplexity and how it was taken
    quantized: bool  # the target was quantized as it was read (the platform's load_hook)


def forecast_disk(options: ExportOptions, config, out: Path) -> None:
    """Refuse, before the slow part, an export whose target program alone will not fit on the
    filesystem of `out` (the bundle is written whole beside it, then renamed)."""
    from mtp_edge.memory import disk_forecast, program_gb

    program = program_gb(config, options.quant, options.group_size, options.embedding_quant)
    shortfall = disk_forecast(out, program)
    if shortfall is not None:
        raise UserError(shortfall)


def forecast_memory(
    options: ExportOptions,
    config,
    max_seq_len: int,
    progress: Callable[[str], None],
    warn: Callable[[str], None] | None = None,
) -> None:
    """Say what the export will need at its peak, from the model's shapes, and warn (also with
    -q) where the machine has less available: before the slow part, not when it runs out."""
    from mtp_edge import logs
    from mtp_edge.memory import available_gb, cache_gb, export_peak_gb, program_gb

    warn = warn or logs.warn
    program = program_gb(config, options.quant, options.group_size, options.embedding_quant)
    cache = cache_gb(config, max_seq_len)
    peak = export_peak_gb(program, cache)
    available = available_gb()
    have = f"; {available:.1f} GB available now" if available is not None else ""
    progress(
        f"[memory] expect a peak of ~{peak:.1f} GB (a {program:.2f} GB target program, a "
        f"{cache:.2f} GB cache){have}"
    )
    if available is not None and peak > available:
        smaller = " or --quant 8da4w (a smaller program)" if options.quant == "8da8w" else ""
        smaller += ", or a shorter -c (a smaller cache)" if cache > 0.5 else ""
        warn(
            f"[memory] warning: this export may need more memory than is available "
            f"(~{peak:.1f} GB against {available:.1f} GB): close other programs{smaller}"
        )


def load_for_export(
    options: ExportOptions,
    platform: Platform,
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
    # export never holds the float model (`load_hook`); the others convert float weights.
    make_hook = getattr(platform, "load_hook", None)
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
