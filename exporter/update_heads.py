"""`mtp-export --update-heads BUNDLE --heads FILE`: swap refined MTP heads into a bundle that is
already deployed, without lowering its target again.

Only the drafter's files change: the head's own program (drafter.pte, drafter.onnx) is exported
and lowered again from the new heads, drafter_vocab.json is rewritten, and the manifest gets
their hashes and the heads' record (`drafter.recipe`: how mtp-train made them, plus the heads
file's sha256 and name). Every other file of the bundle is carried over unchanged (hard-linked
where the filesystem allows, else copied), so the target's outputs are byte for byte what they
were. The new bundle is written into a temporary sibling directory and renamed into place
(mtp_edge.files.atomic_directory), also when it replaces BUNDLE itself: an interrupted update
leaves the old bundle as it was.

What a head program needs besides the heads is the target's embedding table (an ExecuTorch or
ONNX program cannot read another program's weights) and the target's fingerprint (to refuse
heads trained for another model). Both come from the checkpoint the bundle was exported from
(the manifest's `source`), read tensor by tensor: the embedding, final norm and LM head only.

Refused, each with one line and before anything is written: a damaged bundle (hashes), a bundle
whose drafter is not MTP heads, heads of another model (hidden size, vocabulary, the target's
fingerprint, draft ids outside the vocabulary), heads of a kind the bundle's programs cannot run
(the platform module's `check_heads`), and bundles whose heads live inside the target's program
(an ExecuTorch `draft` method, a Core ML function), which only a full export can rebuild.

Why an ExecuTorch `draft` method is not spliced into the existing target.pte: the program is one
flatbuffer whose methods share state by planning, not by name. With shared mutable buffers
(MemoryPlanningPass(share_mutable_buffers=True), exir/passes/memory_planning_pass.py,
run_multimethod) every method's cache tensors live in memory id 2 at offsets laid out over *all*
methods' buffers, and each plan carries the arena's total size; a program lowered with the draft
method alone lays out only the last layer's cache, at offset 0. A splice would have to rewrite
the new plan's allocation offsets and arena size to the old program's (matched by the emitted
mutable-buffer names), remap its constant indices onto the embedding table forward already holds
(or carry a second copy of it), merge the XNNPACK delegate's named weight data and segments into
the program's, and drop the old method's; then prove forward's logits byte-identical and the
drafts those of the new head. Not built: such bundles are refused with the command that works.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from mtp_edge.checkpoints import Checkpoint, open_checkpoint
from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import platform_module
from mtp_edge.files import atomic_directory, check_output, remove_stale_partials
from mtp_edge.logs import estimated_stage
from mtp_edge.manifest import MANIFEST, DrafterSpec, Manifest, sha256
from mtp_edge.memory import StageClock
from mtp_edge.model import Transformer
from mtp_edge.mtp import MTPHead, fingerprint, fingerprint_rows, load_heads
from mtp_edge.platforms import platform

# The files a heads update writes; every other file of the bundle is carried over unchanged.
HEAD_ROLES = ("drafter", "drafter_vocab")
# The DrafterSpec fields that describe how the head runs: reset, then set by the platform.
HEAD_SETTINGS = ("method", "reads_target_cache", "own_cache", "max_chunk", "functions")


def update_heads(
    bundle: str | Path,
    heads: str | Path,
    out: str | Path | None = None,
    progress: Callable[[str], None] = print,
) -> tuple[Path, Manifest]:
    """Write `bundle` with the MTP heads of the file `heads` to `out` (default: `bundle`
    itself, replaced atomically). Returns the new bundle's path and manifest."""
    clock = StageClock()
    bundle, heads = Path(bundle), Path(heads)
    out = bundle if out is None else Path(out)
    with clock.stage("check the bundle"):
        manifest = Manifest.load(bundle)  # a damaged bundle is refused here (hashes, keys)
    if out.resolve() != bundle.resolve():
        check_output(out, "--out", directory=True)
        if out.exists() and not (out / MANIFEST).exists():
            raise UserError(f"--out {out} exists and is not a bundle: choose another path")
    else:
        check_output(out, "--update-heads", directory=True)
    remove_stale_partials(out)
    module = _head_exporter(manifest, bundle, heads)
    if heads.is_dir():
        raise UserError(
            f"--heads {heads} is a directory: give the .safetensors heads file mtp-train --out "
            "wrote"
        )
    if not heads.is_file():
        raise UserError(f"MTP heads not found: {heads} (train them with mtp-train --out {heads})")

    with clock.stage("read the heads and the target's embedding"):
        checkpoint = _source(manifest, bundle, heads)
        target, target_hash = target_parts(checkpoint)
        head = load_heads(heads, target, manifest.model_name, target_hash)
        _check_vocabulary(head, manifest, heads)
        module.check_heads(head, manifest, _reexport(manifest, heads))
        heads_sha = sha256(heads)
    progress(
        f"[heads] {heads} ({head.config.attention} attention, "
        f"{head.config.draft_vocab_size} draft tokens) into {bundle}"
    )

    with atomic_directory(out) as tmp:
        with (
            clock.stage("export the heads"),
            estimated_stage("exporting the heads", _export_s(head)),
        ):
            models, settings = module.export_heads(
                head, target.embed_tokens, target, manifest, tmp, progress
            )
        with clock.stage("write the bundle"):
            for role, entry in manifest.models.items():
                if role not in HEAD_ROLES:
                    _carry(bundle / entry.file, tmp / entry.file)
            updated = dict(manifest.models)
            for role, entry in models.items():
                entry.sha256 = sha256(tmp / entry.file)
                updated[role] = entry
            drafter = _drafter(manifest.drafter, head, settings, heads, heads_sha)
            manifest = replace(manifest, models=updated, drafter=drafter)
            # Measured with the old heads: mtp-bench measures the new ones.
            manifest.quality = {
                k: v for k, v in manifest.quality.items() if k != "drafter_acceptance"
            }
        manifest.export_log = dict(manifest.export_log, heads_update=clock.report())
        manifest.save(tmp)
    for row in clock.rows:
        progress(f"[time] {row['stage']}: {row['seconds']:.1f} s, peak RSS {row['peak_rss_mb']} MB")
    report = clock.report()
    progress(f"[done] {out}: heads updated in {report['seconds']:.1f} s")
    return out, manifest


def _export_s(head: MTPHead) -> float:
    """Seconds to export and lower a head with its copy of the embedding table, for the
    progress bar: measured 10.5 s for the default model's (36M weights with the table) and
    27 s at Qwen2.5-1.5B's shape (292M) on a 2-core machine (benchmarks/README.md)."""
    c = head.config
    weights = sum(p.numel() for p in head.parameters()) + c.vocab_size * c.hidden_size
    return 8.0 + 0.065 * weights / 1e6


def _head_exporter(manifest: Manifest, bundle: Path, heads: Path):
    """The platform module that re-exports this bundle's head, after the refusals that need
    neither the heads nor the checkpoint."""
    if manifest.drafter.kind != "mtp":
        raise UserError(
            f"bundle {bundle} drafts with '{manifest.drafter.kind}', not MTP heads: export a "
            f"bundle with heads with mtp-export --drafter mtp --heads {heads}"
        )
    row = platform(manifest.platform)
    module = platform_module(manifest.platform)
    in_target = manifest.drafter.method is not None or row.head_in_target
    if in_target or not hasattr(module, "export_heads"):
        raise UserError(
            f"bundle {bundle} carries its heads inside the target's program, which only a full "
            f"export rebuilds: {_reexport(manifest, heads)}"
        )
    return module


def _reexport(manifest: Manifest, heads: Path) -> str:
    """The command that makes a bundle with these heads where an update cannot."""
    model = (manifest.source or {}).get("path", "MODEL")
    return f"re-export with mtp-export --target {manifest.platform} -m {model} --heads {heads}"


def _source(manifest: Manifest, bundle: Path, heads: Path) -> Checkpoint:
    """The checkpoint the bundle was exported from, opened without its weights, checked to be
    the model the bundle holds."""
    path = (manifest.source or {}).get("path")
    if not path or not Path(path).exists():
        where = f"its source checkpoint {path} is gone" if path else "it names no source checkpoint"
        raise UserError(
            f"bundle {bundle}: {where}, whose embedding table the head's program needs: "
            f"{_reexport(manifest, heads)}"
        )
    checkpoint = open_checkpoint(path)
    c = checkpoint.config
    hidden = manifest.drafter.hidden_size
    if c.vocab_size != manifest.vocab_size or (hidden is not None and c.hidden_size != hidden):
        raise UserError(
            f"bundle {bundle}: its source checkpoint {path} is no longer the model it was "
            f"exported from (vocabulary {c.vocab_size}, hidden {c.hidden_size}): "
            f"{_reexport(manifest, heads)}"
        )
    return checkpoint


def target_parts(checkpoint: Checkpoint) -> tuple[Transformer, str]:
    """The target with only its embedding, final norm and LM head read (the rest stays on the
    meta device, never read), and its fingerprint, as load_model takes it."""
    model = checkpoint.skeleton()
    slices = []
    for name, part in model.parts():
        if name in ("embed_tokens", "norm", "lm_head"):
            checkpoint.fill(name, part)
            slices.append(fingerprint_rows(part.weight[None] if name == "norm" else part.weight))
    return model, fingerprint(checkpoint.config, slices)


def _check_vocabulary(head: MTPHead, manifest: Manifest, heads: Path) -> None:
    ids = head.draft_ids
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= manifest.vocab_size):
        raise UserError(
            f"{heads}: draft ids reach {int(ids.max())}, outside the bundle's vocabulary of "
            f"{manifest.vocab_size}: the heads file is corrupt; train it again with mtp-train"
        )
    if len(torch.unique(ids)) != len(ids):
        raise UserError(
            f"{heads}: its draft vocabulary names a token twice: the heads file is corrupt; "
            "train it again with mtp-train"
        )


def _drafter(
    old: DrafterSpec, head: MTPHead, settings: dict, heads: Path, heads_sha: str
) -> DrafterSpec:
    """The bundle's drafter with the new heads: its drafting policy kept, how the head runs
    from the platform's `settings`, and the heads recorded."""
    defaults = DrafterSpec()
    fresh = {name: getattr(defaults, name) for name in HEAD_SETTINGS}
    recipe = dict(head.config.recipe, heads_file=heads.name, heads_sha256=heads_sha)
    return replace(old, **fresh, **settings, recipe=recipe)


def _carry(source: Path, destination: Path) -> None:
    """`source` into the new bundle unchanged: a hard link where the filesystem allows (no
    copy of a gigabyte program; the old bundle keeps its own name for it), else a copy."""
    if source.is_dir():  # a package directory
        shutil.copytree(source, destination, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, destination)


def _link_or_copy(source, destination) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
