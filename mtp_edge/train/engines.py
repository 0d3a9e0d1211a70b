"""Who writes the text and who labels it: the target as loaded (fp32), the target with int8
linears (int8.py), or an exported target (--bundle); by default the faster eager path on this
machine, measured in its first seconds.

Why measure: int8 linears go through torch._int_mm, fast where the CPU multiplies int8 in
hardware (x86 VNNI/AMX) and 10-50x slower than a float32 matmul where it does not (an AVX2-only
x86 CPU: benchmarks/results/train_paths.md). Which CPU this is cannot be read reliably from its
name or flags (torch's kernels decide), so the probe times the target's own matrix shapes on
both paths: a slice of each distinct linear layer and of the LM head, at the rows a decoding
step of a writing batch multiplies (--gen-batch) and at those of a labelled sequence."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtp_edge.checkpoints import LoadedModel
from mtp_edge.errors import UserError
from mtp_edge.machine import Int8Path, int8_path
from mtp_edge.model import Transformer
from mtp_edge.mtp import target_fingerprint
from mtp_edge.train.int8 import Int8Linear, int8_writer
from mtp_edge.train.options import TrainOptions

# Output rows of each weight the probe multiplies by, at two slice sizes: a call's time is a
# fixed part (int8's activation quantization, the dispatch) plus a part per output row, and only
# the second grows with the weight. Scaling one small slice's time up to a 49k-row LM head
# multiplied the fixed part as well, which made int8 look 1.8x slower than fp32 at a writing
# batch's 8 rows on a VNNI host where it writes 2.5-3.3x faster (benchmarks/results/training/
# train_paths_vnni_*.md). And the rows of a labelled sequence it times.
PROBE_OUT_ROWS = (256, 1024)
PROBE_LABEL_ROWS = 128
# int8 only when its measured time is below fp32's by this factor: fp32 writes and labels the
# target's own numbers, int8 an approximation of them, so a near tie goes to fp32.
INT8_MARGIN = 1.1


def _distinct_linears(target: Transformer) -> list[tuple[torch.Tensor, int]]:
    """(weight, how many times a token's forward multiplies by one of its shape): the first
    layer's linears stand for every layer's; the LM head (the embedding when tied) once."""
    counts: dict[tuple[int, int], list] = {}
    for module in target.layers[0].modules():
        if isinstance(module, nn.Linear):
            entry = counts.setdefault(tuple(module.weight.shape), [module.weight, 0])
            entry[1] += len(target.layers)
    head = target.lm_head.weight if target.lm_head is not None else target.embed_tokens.weight
    entry = counts.setdefault(tuple(head.shape), [head, 0])
    entry[1] += 1
    return [(w, n) for w, n in counts.values()]


def _best_seconds(*calls: Callable[[], object], repeats: int = 3) -> list[float]:
    """The best time of each call over `repeats` rounds, the calls taking turns within a round,
    so that other work on the cores coming and going weighs on all of them alike."""
    for f in calls:
        f()  # warm-up (first-call allocations, kernel selection)
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, f in enumerate(calls):
            began = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - began)
    return best


def full_size_seconds(times: dict[int, float], out_rows: int) -> float:
    """A call's time on all `out_rows` from its times on slices ({rows: seconds}): the line
    through the two slices' times (its fixed part and its part per row, neither below zero),
    or, with one slice, that slice's time scaled by the rows."""
    if len(times) == 1:
        ((rows, seconds),) = times.items()
        return seconds * out_rows / rows
    (small, t_small), (large, t_large) = sorted(times.items())
    per_row = max((t_large - t_small) / (large - small), 0.0)
    fixed = max(t_small - per_row * small, 0.0)
    return fixed + per_row * out_rows


@torch.inference_mode()
def probe_paths(target: Transformer, rows: int) -> dict[str, float]:
    """Seconds per token of the target's matrix products on each eager path ("fp32", "int8"),
    for a forward over `rows` rows at once: each distinct weight shape timed on slices of
    PROBE_OUT_ROWS output rows (or all of them), its time on all its rows drawn through the
    slices' (full_size_seconds), counted as often as a forward multiplies by it. Attention,
    norms and the rest cost the same on both paths: left out."""
    seconds = {"fp32": 0.0, "int8": 0.0}
    generator = torch.Generator().manual_seed(0)
    for weight, count in _distinct_linears(target):
        out_rows, width = weight.shape
        x = torch.randn(rows, width, generator=generator)
        times: dict[str, dict[int, float]] = {"fp32": {}, "int8": {}}
        for n in sorted({min(n, out_rows) for n in PROBE_OUT_ROWS}):
            part = weight.detach()[:n].float()
            int8 = Int8Linear(part)
            fp32_s, int8_s = _best_seconds(lambda: F.linear(x, part), lambda: int8(x))  # noqa: B023
            times["fp32"][n], times["int8"][n] = fp32_s, int8_s
        for path in seconds:
            seconds[path] += full_size_seconds(times[path], out_rows) * count / rows
    return seconds


def choose(measured: dict[str, float], path: Int8Path | None = None) -> tuple[str, str]:
    """The eager path to take from `measured` (seconds per token by path) and why, in words.
    `path`: this CPU's int8 path by its flags (machine.int8_path), which the words name; the
    choice is the measurement's alone."""
    int8, fp32 = measured["int8"], measured["fp32"]
    ratio = fp32 / max(int8, 1e-12)
    if ratio > INT8_MARGIN:
        return "int8", f"int8 matmuls {ratio:.1f}x faster than fp32 here"
    if ratio >= 1 / INT8_MARGIN:
        return "fp32", "int8 no faster than fp32 here (fp32 is the target's own numbers)"
    slower = f"int8 matmuls {1 / ratio:.1f}x slower than fp32 here"
    if path is None or path.name == "unknown":
        return "fp32", slower
    if not path.dot_product:
        return "fp32", f"{slower} (this CPU's int8 path: {path.name}, no int8 dot product)"
    # A CPU with an int8 dot product measured slow: most likely other work on its cores.
    return "fp32", (
        f"{slower}, although this CPU has an int8 dot product ({path.name}): other work on "
        "the cores may have slowed the probe"
    )


@dataclass
class Engines:
    """The writer and the labeller, and the names of what they make: the cache of written text
    is keyed by who wrote it, the labels by who labelled them."""

    writer: object  # an eager Transformer (batched) or an exported target's session
    labeller: object  # an eager Transformer, or the session (by_session)
    text_hash: str
    label_hash: str
    by_session: bool  # the exported target labels
    cache: bool  # the labels keep the target's last-layer K/V (heads reading its cache)
    session: object | None  # --bundle's target session
    target_hash: str


def open_target_bundle(path: str, loaded: LoadedModel):
    """The target session of an ExecuTorch bundle of `loaded`, and the hash that names the text
    it writes (the exported file's, so that text from the eager model is not reused)."""
    from mtp_edge.runtime.bundle import open_bundle, target_session

    bundle = open_bundle(path)
    m = bundle.manifest
    if m.model_name != loaded.name or m.vocab_size != loaded.config.vocab_size:
        raise UserError(f"--bundle {path} holds {m.model_name}, not the target {loaded.name}")
    methods = m.models["target"].methods
    outputs = [o["name"] for o in methods["forward"]["outputs"]]
    if "hidden" not in outputs and "last_hidden" not in methods:  # older programs: forward's
        raise UserError(
            f"--bundle {path} does not return hidden states: export it with --drafter mtp"
        )
    return target_session(bundle), "bundle-" + m.models["target"].sha256[:16]


def resolve_auto(options: TrainOptions, target: Transformer, say, earlier: dict) -> None:
    """--writer/--labeller auto: the eager path this machine runs faster, each measured at its
    own rows; a resumed run keeps the choice recorded in `earlier` (its recipe), so that its
    text and labels are read back, not remade."""
    for role in ("writer", "labeller"):
        if getattr(options, role) == "auto" and earlier.get(role) in ("int8", "fp32"):
            setattr(options, role, earlier[role])
            say(f"{role}: {earlier[role]}, as the run being resumed chose")
    if "auto" not in (options.writer, options.labeller):
        return
    say("measuring this machine: the target's matmuls in int8 and in fp32 (a few seconds)")
    for role, rows in (("writer", options.gen_batch), ("labeller", PROBE_LABEL_ROWS)):
        if getattr(options, role) != "auto":
            continue
        rows = min(rows, options.seq_len) if role == "labeller" else rows
        measured = probe_paths(target, rows)
        path, why = choose(measured, int8_path())
        setattr(options, role, path)
        times = ", ".join(f"{k} {v * 1e3:.2f} ms/token" for k, v in sorted(measured.items()))
        say(f"{role}: {path} ({why}; {times} at {rows} rows; --{role} forces one)")


def set_up_engines(options: TrainOptions, loaded: LoadedModel, say, earlier: dict) -> Engines:
    """Who writes and who labels (resolving --writer/--labeller auto on this machine)."""
    target = loaded.model
    target_hash = target_fingerprint(target)
    session, bundle_hash = None, None
    if options.bundle:
        session, bundle_hash = open_target_bundle(options.bundle, loaded)
    resolve_auto(options, target, say, earlier)
    int8 = int8_writer(target) if "int8" in (options.writer, options.labeller) else None
    text_hash, writer = {
        "bundle": (bundle_hash, session),
        "fp32": (target_hash, target),
        "int8": ("int8-" + target_hash, int8),
    }[options.writer]
    cache = options.attention == "target_cache"  # labels keep the target's last-layer K/V
    # The exported program returns no K/V: heads that read the cache are labelled by the
    # eager target (the bundle may still write the text).
    by_session = options.labeller == "bundle" and not cache
    labeller = {"int8": int8, "fp32": target, "bundle": target if cache else session}[
        options.labeller
    ]
    label_hash = (
        bundle_hash
        if by_session
        else {"int8": "int8-" + target_hash}.get(options.labeller, target_hash)
    )

    def named(kind: str) -> str:
        return "the exported target" if kind == "bundle" else f"the {kind} target"

    say(
        f"{named(options.writer)} writes the text; "
        f"{named('bundle' if by_session else options.labeller.replace('bundle', 'fp32'))} "
        "labels it"
    )
    return Engines(writer, labeller, text_hash, label_hash, by_session, cache, session, target_hash)
