"""`mtp-export --quant auto`: the weight scheme, and k, chosen by timing them on this machine.

Which scheme decodes fastest depends on the CPU more than on the model: without an int8 dot
product (AVX2-only x86) XNNPACK's 8-bit GEMMs are bound by their arithmetic, so a verification
of k+1 rows costs far more than one decoding step, and float weights or a narrower verification
can win; with one (VNNI, SDOT, i8mm) 8da8w verifies at ~1.1-1.25 decodes
(benchmarks/README.md, "CPUs without an int8 dot product"). So the search measures:

1. each candidate scheme (every scheme of the platform's row, at its default group size) is
   exported as a complete bundle (exporter/pipeline.py: its own perplexity against fp32 and the
   verify-vs-step check), into a scratch directory beside the output;
2. every (scheme, k) pair within the perplexity bound is timed (one out of it is never chosen,
   so its time is not spent), plain and speculative greedy decoding, over a short
   built-in suite, each pair in a worker process of its own and the prompts handed to them in
   turn (mtp-bench --compare's machinery, devices/bench_setups.py), every pass repeated so that the
   run-to-run spread is measured, not assumed; k is the manifest's runtime setting, so its
   candidates share one export;
3. `pick` keeps, among the candidates within the perplexity bound whose output was identical
   to plain decoding, the fastest speculative one, where "fastest" allows for the spread: a
   candidate within the spread of the fastest is a near-tie, and near-ties go to the better
   perplexity, then to the smaller bundle. Nothing slower than another candidate by more than
   the spread is ever chosen;
4. the chosen candidate's files become the bundle, its k the manifest's, and the manifest's
   `quality.auto` records every candidate's measurements, the spread and why.

Each candidate is a full export (loading included, a few percent of an export's time): the
platforms that quantize while loading never hold the float model, and keeping that matters
more than the seconds a shared load would save. The exporter never imports the runtime: the
timing is a callback the API hands in (mtp_edge/api.py), like the quality checks'.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import (
    DEFAULT_K,
    ExportOptions,
    auto_candidates,
    resolve_options,
)
from mtp_edge.manifest import Manifest

# The perplexity bound of a candidate against the fp32 model on the held-out text: the
# android default's own reason ("within +3% perplexity of fp32 at every size measured",
# mtp_edge/platforms.py), which 4-bit weights missed by 5-59% (benchmarks/README.md, "Weight
# scheme by model size").
QUALITY_BOUND = 1.03


@dataclass(frozen=True)
class SearchPlan:
    """How the candidates are timed: the built-in suite's first `per_category` prompts of each
    category, `max_new_tokens` each, the whole suite `repeat` times (the spread's samples)."""

    per_category: int = 1
    max_new_tokens: int = 48
    repeat: int = 3

    def describe(self, prompts: int) -> str:
        return (
            f"{prompts} prompts ({self.per_category} per category of the built-in suite) x "
            f"{self.max_new_tokens} new tokens, greedy, {self.repeat} passes; plain and "
            "speculative interleaved prompt by prompt, each candidate in a process of its own, "
            "the candidates in turn"
        )


PLAN = SearchPlan()

# timer(setups, plan) -> one mtp-bench summary (devices/harness.py) per (bundle, k) setup, and
# the number of prompts timed. None where the platform's bundles cannot run on this machine.
Timer = Callable[[list[tuple[Path, int]], SearchPlan], tuple[list[dict], int]]

# Rough rates for the estimate said before the search (this 2-core development VM, 2026-11-29:
# the 135M default exported in ~5.5 min quiet, decoded at 60-80 tok/s); refined as it runs.
EXPORT_S_FIXED, EXPORT_S_PER_M = 60.0, 2.0
DECODE_S_PER_M_TOKEN, WORKER_START_S = 1.2e-4, 15.0


def pick(rows: list[dict], bound: float | None = None) -> dict:
    """The choice among measured candidates (a pure function of the table).

    Each row: "label", "perplexity_ratio", "size_mb", "lossless" and "spec_tok_s_runs" (the
    speculative tok/s of each pass). Returns {"chosen": index, "spread": tok/s, "why": text,
    "excluded": {index: reason}}. The spread is the largest max-min of any eligible candidate's
    passes; "chosen" is None when no candidate is eligible. `bound`: QUALITY_BOUND unless given.
    """
    bound = QUALITY_BOUND if bound is None else bound
    excluded: dict[int, str] = {}
    for i, row in enumerate(rows):
        ratio = row["perplexity_ratio"]
        if ratio is not None and not ratio <= bound:  # the search does not time these
            excluded[i] = f"perplexity x{ratio:.3f} > x{bound}"
        elif not row.get("spec_tok_s_runs"):
            excluded[i] = "not timed"
        elif not row["lossless"]:
            excluded[i] = "its speculative output differed from plain decoding"
        elif not ratio <= bound:
            excluded[i] = f"perplexity x{ratio:.3f} > x{bound}"
    eligible = [i for i in range(len(rows)) if i not in excluded]
    if not eligible:
        return {
            "chosen": None,
            "spread": None,
            "why": "no candidate is eligible",
            "excluded": excluded,
        }
    median = {i: statistics.median(rows[i]["spec_tok_s_runs"]) for i in eligible}
    spread = max(
        max(rows[i]["spec_tok_s_runs"]) - min(rows[i]["spec_tok_s_runs"]) for i in eligible
    )
    fastest = max(eligible, key=lambda i: median[i])
    near = [i for i in eligible if median[fastest] - median[i] <= spread]
    chosen = min(near, key=lambda i: (rows[i]["perplexity_ratio"], rows[i]["size_mb"], -median[i]))
    why = (
        f"{rows[fastest]['label']} decoded fastest speculatively "
        f"({median[fastest]:.1f} tok/s, median of {len(rows[fastest]['spec_tok_s_runs'])})"
    )
    others = [i for i in near if i != fastest]
    if others:
        ties = ", ".join(f"{rows[i]['label']} {median[i]:.1f}" for i in others)
        why += f"; within the spread of {spread:.1f} tok/s of it: {ties}"
        if chosen != fastest:
            why += (
                f"; of these {rows[chosen]['label']} has the best perplexity "
                f"(x{rows[chosen]['perplexity_ratio']:.3f}), then the smallest size "
                f"({rows[chosen]['size_mb']:.0f} MB)"
            )
    else:
        why += f", by more than the spread ({spread:.1f} tok/s) over every other candidate"
    if excluded:
        why += "; excluded: " + ", ".join(f"{rows[i]['label']} ({r})" for i, r in excluded.items())
    return {"chosen": chosen, "spread": round(spread, 3), "why": why, "excluded": excluded}


def candidate_row(
    scheme: str, k: int, manifest: Manifest, size_mb: float, summary: dict | None
) -> dict:
    """What the manifest records of one (scheme, k) candidate: its quality and its timing
    (None: not timed, its perplexity out of the bound)."""
    quant = manifest.models["target"].quant
    row = {
        "label": f"{scheme} k={k}",
        "scheme": scheme,
        "group_size": quant.get("group_size"),
        "k": k,
        "perplexity_ratio": manifest.quality.get("perplexity_ratio"),
        "size_mb": round(size_mb, 1),
    }
    if summary is None:
        return {
            **row,
            **dict.fromkeys(_TIMING, None),
            "spec_tok_s_runs": [],
            "plain_tok_s_runs": [],
        }
    spread = summary.get("spread", {})
    spec_runs = spread.get("spec_tokens_per_s", {}).get("runs", [summary["spec_tokens_per_s"]])
    plain_runs = spread.get("ar_tokens_per_s", {}).get("runs", [summary["ar_tokens_per_s"]])
    return {
        **row,
        "plain_tok_s": summary["ar_tokens_per_s"],
        "plain_tok_s_runs": plain_runs,
        "spec_tok_s": summary["spec_tokens_per_s"],
        "spec_tok_s_runs": spec_runs,
        "spec_tok_s_min": min(spec_runs),
        "spec_tok_s_spread": round(max(spec_runs) - min(spec_runs), 3),
        "speedup": summary["speedup"],
        "tau": summary["tau"],
        "verify_over_decode": summary["verify_over_decode"],
        "draft_over_decode": summary["draft_over_decode"],
        "lossless": summary["lossless"],
    }


_TIMING = (
    "plain_tok_s",
    "spec_tok_s",
    "spec_tok_s_min",
    "spec_tok_s_spread",
    "speedup",
    "tau",
    "verify_over_decode",
    "draft_over_decode",
    "lossless",
)


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], choice: dict) -> list[str]:
    """The candidates as a small text table, the chosen one marked."""
    head = (
        f"{'candidate':<14} {'ppl':>6} {'MB':>6} {'plain':>7} {'spec':>7} {'spec min':>8} "
        f"{'tau':>5} {'ver/dec':>7} {'dr/dec':>6}"
    )
    lines = [head]
    for i, r in enumerate(rows):
        ppl = f"x{r['perplexity_ratio']:.3f}" if r["perplexity_ratio"] is not None else "-"
        mark = " <- chosen" if i == choice["chosen"] else ""
        if i in choice["excluded"]:
            mark = f" ({choice['excluded'][i]})"
        lines.append(
            f"{r['label']:<14} {ppl:>6} {r['size_mb']:>6.0f} "
            f"{_cell(r.get('plain_tok_s'), '>7.1f')} "
            f"{_cell(r.get('spec_tok_s'), '>7.1f')} {_cell(r.get('spec_tok_s_min'), '>8.1f')} "
            f"{_cell(r.get('tau'), '>5.2f')} {_cell(r.get('verify_over_decode'), '>7.2f')} "
            f"{_cell(r.get('draft_over_decode'), '>6.3f')}{mark}"
        )
    return lines


def _within_bound(manifest: Manifest) -> bool:
    ratio = manifest.quality.get("perplexity_ratio")
    return ratio is None or ratio <= QUALITY_BOUND


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes}:{s:02d}"


def bundle_size_mb(directory: Path, manifest: Manifest) -> float:
    """The bundle's model files (programs, drafter), as the user will ship them."""
    total = 0
    for entry in manifest.models.values():
        path = directory / entry.file
        files = path.rglob("*") if path.is_dir() else [path]
        total += sum(f.stat().st_size for f in files if f.is_file())
    return total / 1e6


def export_auto(
    options: ExportOptions,
    out: Path | None,
    open_program,
    progress: Callable[[str], None],
    measure,
    timer: Timer | None,
    plan: SearchPlan | None = None,
) -> tuple[Path, Manifest]:
    """Export `options` (quant "auto") as the candidate this machine runs fastest (module doc).
    `open_program` and `measure` are export_bundle's; `timer` times bundles (Timer)."""
    from mtp_edge.checkpoints import open_checkpoint
    from mtp_edge.exporter.bundle_writer import check_writable
    from mtp_edge.exporter.pipeline import default_out, export_bundle
    from mtp_edge.files import atomic_directory
    from mtp_edge.memory import program_gb
    from mtp_edge.quantize.schemes import default_group_size

    plan = plan or PLAN
    options = resolve_options(options, progress)
    if options.quant != "auto":  # nothing to measure (resolve_options said so)
        return export_bundle(options, out, open_program, progress, measure)
    schemes, ks = auto_candidates(options)
    if timer is None:
        raise UserError(
            f"--quant auto times each candidate on this machine, and {options.platform} "
            "bundles cannot run here: choose the scheme with --quant"
        )
    started = time.perf_counter()
    checkpoint = open_checkpoint(options.model)  # its tensors stay on disk
    config = checkpoint.config
    out = Path(out) if out is not None else default_out(options, checkpoint.name)
    check_writable(out)
    del checkpoint
    params_m = program_gb(config, "fp32", 0, "none") * 1e9 / 4 / 1e6
    export_s = EXPORT_S_FIXED + EXPORT_S_PER_M * params_m
    setups = len(schemes) * len(ks)
    tokens = 8 * plan.per_category * plan.max_new_tokens * plan.repeat * 2 * setups
    timing_s = setups * WORKER_START_S + tokens * DECODE_S_PER_M_TOKEN * params_m
    progress(
        f"[auto] {len(schemes)} schemes ({', '.join(schemes)}) x k in "
        f"{{{', '.join(map(str, ks))}}}: {len(schemes)} exports (~{_clock(export_s)} each, "
        f"estimated), then {setups} setups timed (~{_clock(timing_s)}): "
        f"~{_clock(len(schemes) * export_s + timing_s)} in all"
    )
    with atomic_directory(out) as tmp:
        work = tmp / "candidates"
        exported: list[tuple[str, Path, Manifest]] = []
        for n, scheme in enumerate(schemes, 1):
            candidate = replace(
                options,
                quant=scheme,
                group_size=default_group_size(scheme, options.platform),
                draft_quant=options.draft_quant or scheme,
                draft_group_size=None,  # decided anew for this candidate (resolve_options)
                k=options.k or DEFAULT_K,  # the programs verify at any k (auto_candidates)
                auto_schemes=None,
            )
            progress(f"[auto] candidate {n}/{len(schemes)}: {scheme}")
            began = time.perf_counter()
            directory, manifest = export_bundle(
                candidate, work / scheme, open_program, progress, None
            )
            exported.append((scheme, directory, manifest))
            took = time.perf_counter() - began
            export_s = (time.perf_counter() - started) / n  # what an export takes here
            left = (len(schemes) - n) * export_s + timing_s
            progress(f"[auto] {scheme} exported in {_clock(took)}; ~{_clock(left)} left")
        pairs = [(scheme, d, m, k) for scheme, d, m in exported for k in ks]
        # A candidate out of the perplexity bound is never chosen: not timed either.
        timed = [p for p in pairs if _within_bound(p[2])]
        dropped = [scheme for scheme, _, m in exported if not _within_bound(m)]
        if dropped:
            progress(
                f"[auto] not timed, perplexity above x{QUALITY_BOUND} of fp32: "
                + ", ".join(dropped)
            )
        summaries, prompts = [], 0
        if timed:
            timing_s *= len(timed) / len(pairs)
            progress(
                f"[auto] timing {len(timed)} setups, plain and speculative "
                f"(~{_clock(timing_s)}, estimated; the bar below has the time left)"
            )
            summaries, prompts = timer([(d, k) for _, d, _, k in timed], plan)
        timings = iter(summaries)
        rows = [
            candidate_row(
                scheme, k, m, bundle_size_mb(d, m), next(timings) if _within_bound(m) else None
            )
            for scheme, d, m, k in pairs
        ]
        choice = pick(rows)
        for line in table(rows, choice):
            progress(f"[auto] {line}")
        if choice["chosen"] is None:
            raise UserError(
                "--quant auto: no candidate was within the perplexity bound "
                f"(x{QUALITY_BOUND}) with output identical to plain decoding: see the table "
                "above, and choose the scheme with --quant"
            )
        scheme, directory, manifest, k = pairs[choice["chosen"]]
        progress(f"[auto] chosen: {scheme}, k={k}: {choice['why']}")
        for entry in os.scandir(directory):
            os.replace(entry.path, tmp / entry.name)
        shutil.rmtree(work)
        manifest.drafter.k = k
        manifest.quality["auto"] = {
            "chosen": {
                "scheme": scheme,
                "group_size": rows[choice["chosen"]]["group_size"],
                "k": k,
            },
            "why": choice["why"],
            "rule": "the fastest speculative tok/s (median of the passes) among candidates "
            f"within perplexity x{QUALITY_BOUND} of fp32 and lossless; a candidate within the "
            "spread (the largest max-min of any candidate's passes) of the fastest is a "
            "near-tie, decided by perplexity, then size",
            "spread_tok_s": choice["spread"],
            "bound": QUALITY_BOUND,
            "suite": plan.describe(prompts),
            "candidates": rows,
            "seconds": round(time.perf_counter() - started, 1),
            "plan": asdict(plan),
        }
        manifest.save(tmp)
        if measure is not None:
            from mtp_edge.checkpoints import LoadedModel

            checkpoint = open_checkpoint(options.model)
            target = LoadedModel(  # the float model is never held here
                None,  # type: ignore[arg-type]
                checkpoint.tokenizer,
                checkpoint.config,
                checkpoint.name,
                checkpoint.path,
            )
            del checkpoint
            manifest.quality.update(measure(tmp, target, None))
            manifest.save(tmp)
    progress(f"[done] {out}: {scheme}, k={k}, searched in {_clock(time.perf_counter() - started)}")
    return out, manifest
