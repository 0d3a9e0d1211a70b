"""`export_bundle`, what `mtp-export` and the API's `export` run: load a target (and drafter),
quantize, export, measure quality, write a bundle; and the disk and memory it will need,
forecast before it starts."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

from mtp_edge.checkpoints import LoadedModel, open_checkpoint
from mtp_edge.errors import UserError
from mtp_edge.exporter.loading import (
    Forward,
    counting_tokens,
    drafter_spec,
    load_for_export,
)
from mtp_edge.exporter.platform import (
    ExportOptions,
    platform_module,
    resolve_options,
)
from mtp_edge.manifest import TOKENIZER_FILES, DrafterSpec, Manifest, ModelFile
from mtp_edge.memory import StageClock, return_freed_memory
from mtp_edge.platforms import platform
from mtp_edge.quantize.quality import perplexity, verify_step_discrepancy
from mtp_edge.texts import heldout_text


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


def source_of(path: Path | str) -> dict:
    """What the manifest keeps of the checkpoint exported: its absolute path and format."""
    path = Path(path).resolve()
    return {"path": str(path), "format": "gguf" if path.suffix.lower() == ".gguf" else "hf"}


def default_out(options: ExportOptions, model_name: str) -> Path:
    """bundles/<model>-<platform>."""
    return Path("bundles") / f"{model_name}-{options.platform}"


def export_bundle(
    options: ExportOptions,
    out: Path | None,
    open_program: Callable[[Path, int], Forward],
    progress: Callable[[str], None] = print,
    measure: Callable[[Path, LoadedModel, object], dict] | None = None,
) -> tuple[Path, Manifest]:
    """Export `options.model` for `options.platform` into the bundle directory `out`
    (default: bundles/<model>-<platform>).

    `open_program(path, max_seq_len)` runs an exported file (for the quality report);
    `measure(bundle_dir, target, drafter)` measures the finished bundle through the runtime (the
    drafter's acceptance) and returns entries for the quality report.

    The options are decided and checked first (resolve_options), before anything loads. A
    platform whose row declares a `load_hook` (it quantizes while loading) loads and lowers in a
    process of its own (exporter/lowering_parent.py): what lowering leaves allocated dies with that
    process, before the quality checks load the program (unless the model is too small for that
    to matter: lowers_in_child). The others load and convert here.
    """
    from mtp_edge.exporter.bundle_writer import check_writable, write_bundle

    options = resolve_options(options, progress)
    if options.quant == "auto":  # exporter/choose.py exports each candidate through this
        raise UserError(
            "quant='auto' times its candidates through the runtime: export with "
            "mtp_edge.api.export (or mtp-export)"
        )
    row = platform(options.platform)
    module = platform_module(options.platform)
    if out is not None:
        check_writable(Path(out))  # fail before the slow part, not after
    clock = StageClock()
    return_freed_memory()  # the float parts read and dropped below must leave the process
    checkpoint = open_checkpoint(options.model)  # its tensors stay on disk for now
    tokenizer, config = checkpoint.tokenizer, checkpoint.config
    max_seq_len = min(options.max_seq_len, config.max_position_embeddings)
    max_chunk = min(options.max_chunk, max_seq_len)
    if out is None:
        out = default_out(options, checkpoint.name)
        check_writable(out)
    out = Path(out)
    if row.memory_forecast is not None:
        forecast_memory(options, config, max_seq_len, progress)
    forecast_disk(options, config, out)
    quality: dict = {}
    heldout: list[int] = []
    if options.quality_tokens:
        heldout = tokenizer.encode(heldout_text())[: min(options.quality_tokens, max_seq_len)]
        quality["heldout_tokens"] = len(heldout)
    isolated = row.load_hook and lowers_in_child(options, config)

    if isolated:
        from mtp_edge.exporter.lowering_parent import export_in_child

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
            options, module, checkpoint, heldout, max_seq_len, max_chunk, clock, progress
        )
        del checkpoint
        target, draft = loaded.job.target, loaded.job.draft
        quality.update(loaded.quality)

        def make(tmp: Path) -> tuple[dict, DrafterSpec]:
            with clock.stage("export"):
                models, settings = module.export(loaded.job, tmp)
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
            platform=row.name,
            backend=row.backend,
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


# A child process costs a second interpreter's start and its imports of torch and ExecuTorch
# (~8 CPU s, more than lowering a model of a few layers of width 64 takes); what lowering leaves
# allocated, the reason for the child, grows with the program (~1.3 GB after Qwen2.5-0.5B's
# 0.5 GB). Below this program size the export lowers in its own process.
IN_PROCESS_BELOW_GB = 0.02


def lowers_in_child(options: ExportOptions, config) -> bool:
    """Whether an export that quantizes while loading loads and lowers in a child process:
    `options.isolate` when set, else whether the target's program reaches IN_PROCESS_BELOW_GB
    (the default model's is 0.16 GB at 8da8w: a child)."""
    from mtp_edge.memory import program_gb

    if options.isolate is not None:
        return options.isolate
    program = program_gb(config, options.quant, options.group_size, options.embedding_quant)
    return program >= IN_PROCESS_BELOW_GB


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
    from mtp_edge.memory import available_gb

    warn = warn or logs.warn
    forecast = platform(options.platform).memory_forecast
    assert forecast is not None, f"{options.platform} declares no memory forecast"
    peak, program, cache = forecast(
        config, options.quant, options.group_size, options.embedding_quant, max_seq_len
    )
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
