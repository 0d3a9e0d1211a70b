"""`mtp-export`: load a target (and drafter), quantize, export, measure quality, write a bundle."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_edge.checkpoints import LoadedModel, load_model
from mtp_edge.errors import UserError
from mtp_edge.manifest import TARGETS, Manifest, ModelFile
from mtp_edge.quantize.quality import heldout_text, perplexity, verify_step_discrepancy
from mtp_edge.quantize.schemes import QuantScheme, check_scheme, check_target_scheme

# forward(tokens, start) -> logits [T, V]: how the exporter runs what it exported. The CLI passes
# the runtime's session for the target's backend, so exporter/ never imports runtime/.
Forward = Callable[[list[int], int], torch.Tensor]


@dataclass
class ExportOptions:
    target: str = "android"
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


def check_lookup(text: str) -> None:
    """--lookup takes none or MIN-MAX n-gram sizes with 1 <= MIN <= MAX."""
    if text == "none":
        return
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise UserError(f"--lookup takes none or MIN-MAX n-gram sizes such as 2-3, got {text!r}")


def chat_format(tokenizer) -> dict | None:
    """The chat template rendered around a placeholder user message and split there, so that a
    runtime without jinja (the native core) forms the same prompt text by concatenation."""
    if tokenizer.chat_template is None:
        return None
    marker = "\x00mtp-message\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    prefix, found, suffix = text.partition(marker)
    return {"prefix": prefix, "suffix": suffix} if found else None


def default_out(options: ExportOptions, model_name: str) -> Path:
    return Path("bundles") / f"{model_name}-{options.target}"


def eager_forward(model, max_seq_len: int) -> Forward:
    model.setup_cache(max_seq_len)

    @torch.inference_mode()
    def forward(tokens: list[int], start: int) -> torch.Tensor:
        ids = torch.tensor([tokens])
        return model(ids, torch.tensor([start]), kv_len=start + len(tokens))[0]

    return forward


def _write_draft_vocabulary(head, directory: Path) -> None:
    import json

    ids = head.draft_ids.tolist()
    (directory / "drafter_vocab.json").write_text(json.dumps({"draft_ids": ids}))


def load_drafter(options: ExportOptions, target: LoadedModel):
    """(kind, what to export): ("none"|"ngram", None), ("mtp", MTPHead), ("draft-lm", model)."""
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
        return "mtp", load_heads(heads, target.model, target.name)
    draft = load_model(kind)
    if (
        draft.config.vocab_size != target.config.vocab_size
        or draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab()
    ):
        raise UserError(
            "the draft model's vocabulary differs from the target's: use a draft model with "
            "the target's tokenizer, or --drafter ngram"
        )
    return "draft-lm", draft


def export_bundle(
    options: ExportOptions,
    out: Path | None,
    open_program: Callable[[Path, int], Forward],
    progress: Callable[[str], None] = print,
    measure: Callable[[Path, LoadedModel, object], dict] | None = None,
) -> tuple[Path, Manifest]:
    """Export `options.model` for `options.target` into the bundle directory `out`.

    `open_program(path, max_seq_len)` runs an exported file (for the quality report);
    `measure(bundle_dir, target, drafter)` measures the finished bundle through the runtime (the
    drafter's acceptance) and returns entries for the quality report.
    """
    from mtp_edge.exporter.bundle import check_writable, write_bundle

    if options.target not in TARGETS:
        raise UserError(f"unknown target '{options.target}': choose one of {', '.join(TARGETS)}")
    if options.target == "android":
        from mtp_edge.exporter.executorch import export_program
    elif options.target == "onnx":
        from mtp_edge.exporter.onnx import export_program
    if not 1 <= options.k <= 15:
        raise UserError(f"--k must be in 1..15, got {options.k}")
    check_lookup(options.lookup)
    if not 0 <= options.draft_confidence < 1:
        raise UserError(f"--draft-confidence must be in [0, 1), got {options.draft_confidence}")
    started = time.perf_counter()
    progress(f"[load] {options.model}")
    target = load_model(options.model)
    drafter_kind, draft = load_drafter(options, target)
    out = Path(out) if out is not None else default_out(options, target.name)
    check_writable(out)  # fail before the slow part, not after
    draft_scheme = QuantScheme(options.draft_quant, options.group_size, options.embedding_quant)
    if options.target == "android":
        check_scheme(
            QuantScheme(options.quant, options.group_size, options.embedding_quant), target.model
        )
        if drafter_kind == "draft-lm":
            check_scheme(draft_scheme, draft.model)
    else:
        check_target_scheme(options.target, options.quant, options.group_size)
        check_target_scheme(options.target, options.draft_quant, options.group_size)
    if options.target == "coreml" and drafter_kind == "draft-lm":
        raise UserError(
            "--target coreml carries no separate draft model yet: use --drafter mtp or ngram"
        )
    if options.target != "android" and drafter_kind == "mtp" and draft.has_own_cache:
        raise UserError(
            f"--target {options.target} does not run self-attending (EAGLE) MTP heads yet: "
            "export them with --target android, or pass heads trained with --attention none"
        )
    suffix = {"android": ".pte", "onnx": ".onnx"}.get(options.target)
    # A head that reads the target's cache runs inside the target's program on ExecuTorch (a
    # `draft` method); on ONNX Runtime as its own graph bound to the target session's cache
    # buffers; on Core ML as a function of the package sharing the cache state.
    in_program = drafter_kind == "mtp" and draft.reads_target_cache and options.target == "android"
    config = target.config
    max_seq_len = min(options.max_seq_len, config.max_position_embeddings)
    max_chunk = min(options.max_chunk, max_seq_len)
    tokenizer = target.tokenizer

    quality: dict = {}
    heldout: list[int] = []
    if options.quality_tokens:
        heldout = tokenizer.encode(heldout_text())[: min(options.quality_tokens, max_seq_len)]
        progress(f"[quality] fp32 perplexity on {len(heldout)} held-out tokens")
        quality["heldout_tokens"] = len(heldout)
        quality["perplexity_fp32"] = round(
            perplexity(eager_forward(target.model, max_seq_len), heldout, max_chunk), 4
        )

    def export_one(model, path: Path, quant: str, return_hidden: bool = False, **extra) -> dict:
        return export_program(
            model,
            path,
            quant=quant,
            group_size=options.group_size,
            embedding_quant=options.embedding_quant,
            max_seq_len=max_seq_len,
            max_chunk=max_chunk,
            bos_id=tokenizer.bos_id,
            eos_ids=tokenizer.eos_ids,
            return_hidden=return_hidden,
            attention_kernel=options.attention_kernel,
            progress=progress,
            **extra,
        )

    def build(tmp: Path) -> Manifest:
        quant = {
            "scheme": options.quant,
            "group_size": options.group_size,
            # onnx and coreml keep the embedding table in float (fp32 / fp16)
            "embedding": options.embedding_quant if options.target == "android" else "none",
        }
        if options.target == "android":
            quant["attention"] = options.attention_kernel
        hidden = drafter_kind == "mtp"
        drafter = {"kind": drafter_kind, "k": options.k}
        if drafter_kind in ("mtp", "draft-lm"):  # the runtime's defaults for this drafter
            if options.lookup != "none":
                drafter["lookup"] = options.lookup
            drafter["draft_confidence"] = options.draft_confidence
        draft_quant = dict(quant, scheme=options.draft_quant)
        if options.target == "coreml":  # one package: target functions and the drafter step
            from mtp_edge.exporter.coreml import export_package

            methods, settings = export_package(
                target.model,
                draft,
                tmp / "model.mlpackage",
                quant=options.quant,
                draft_quant=options.draft_quant,
                group_size=options.group_size,
                max_seq_len=max_seq_len,
                max_chunk=max_chunk,
                k=options.k,
                progress=progress,
            )
            models = {"target": ModelFile("model.mlpackage", "", quant, methods)}
            drafter.update(settings)
        else:
            # ExecuTorch: a row-exact verify method for k+1 tokens (see exporter/executorch.py)
            verify = options.target == "android" and drafter_kind != "none"
            extra = {"verify_width": options.k + 1} if verify else {}
            if in_program:  # the draft step is a method of the target's program
                extra.update(draft_head=draft, draft_scheme=draft_scheme)
            methods = export_one(
                target.model, tmp / f"target{suffix}", options.quant, hidden, **extra
            )
            models = {"target": ModelFile(f"target{suffix}", "", quant, methods)}
        if drafter_kind == "draft-lm":
            methods = export_one(draft.model, tmp / f"drafter{suffix}", options.draft_quant)
            models["drafter"] = ModelFile(f"drafter{suffix}", "", draft_quant, methods)
            drafter["model_name"] = draft.name
        if drafter_kind == "mtp":
            if in_program:
                _write_draft_vocabulary(draft, tmp)
                methods, settings = (
                    {},
                    {
                        "draft_vocab_size": draft.config.draft_vocab_size,
                        "hidden_size": draft.config.hidden_size,
                        "method": "draft",  # of the target's program
                        "reads_target_cache": True,
                    },
                )
            elif options.target == "android":
                from mtp_edge.exporter.executorch import export_mtp_program

                methods, settings = export_mtp_program(
                    draft,
                    target.model.embed_tokens,
                    tmp,
                    draft_scheme,
                    progress,
                    rope=config,
                    max_seq_len=max_seq_len,
                    max_chunk=max_chunk,
                )
            elif options.target == "onnx":
                from mtp_edge.exporter.onnx import export_mtp_program

                methods, settings = export_mtp_program(
                    draft,
                    target.model.embed_tokens,
                    tmp,
                    options.draft_quant,
                    options.group_size,
                    progress,
                    target=target.model,  # a head that reads the target's cache binds it
                    target_forward=models["target"].methods["forward"],
                )
            if options.target == "onnx" or (options.target == "android" and not in_program):
                models["drafter"] = ModelFile(f"drafter{suffix}", "", draft_quant, methods)
            models["drafter_vocab"] = ModelFile("drafter_vocab.json", "", {}, {})
            drafter.update(settings, recipe=draft.config.recipe)
        forward = open_program(tmp / models["target"].file, max_seq_len) if heldout else None
        if forward is None and heldout:
            progress(f"[quality] the exported {options.target} model cannot run here: skipped")
        if forward is not None:
            progress("[quality] exported target perplexity")
            quality["perplexity_exported"] = round(perplexity(forward, heldout, max_chunk), 4)
            quality["perplexity_ratio"] = round(
                quality["perplexity_exported"] / quality["perplexity_fp32"], 4
            )
            progress(f"[quality] {options.k + 1}-token verify vs one-token steps")
            quality["verify_vs_step"] = verify_step_discrepancy(
                forward, heldout[: max_chunk + 320], options.k + 1, max_chunk
            )
        progress("[write] tokenizer and manifest")
        tokenizer.save(tmp)
        return Manifest(
            target=options.target,
            backend=TARGETS[options.target],
            model_name=target.name,
            max_seq_len=max_seq_len,
            max_chunk=max_chunk,
            vocab_size=config.vocab_size,
            bos_id=tokenizer.bos_id,
            eos_ids=list(tokenizer.eos_ids),
            chat_template=tokenizer.chat_template,
            chat_format=chat_format(tokenizer),
            models=models,
            drafter=drafter,
            quality=quality,
        )

    finish = None
    if measure is not None:

        def finish(directory: Path, manifest: Manifest) -> None:
            manifest.quality.update(measure(directory, target, draft))

    manifest = write_bundle(out, build, finish)
    progress(f"[done] {out} in {time.perf_counter() - started:.0f} s")
    return out, manifest
