"""Single target calls of an ONNX bundle on ONNX Runtime: verify(T) against decode(1).

After a 200-token prefill, calls of T tokens at position 200 (with the hidden-state output the
MTP drafter reads), T round-robin so that load from other processes hits every T alike; best
and median per T, written to results/formats/onnx_calls.{json,md}.

    python benchmarks/onnx_calls.py [--bundle bundles/SmolLM2-135M-Instruct-onnx] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mtp_edge.runtime.bundle import open_bundle, target_session

RESULTS = Path(__file__).parent / "results/formats"
WIDTHS = (1, 2, 5, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="bundles/SmolLM2-135M-Instruct-onnx")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=str(RESULTS / "onnx_calls"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the session hands these to ONNX Runtime
    bundle = open_bundle(args.bundle)
    session = target_session(bundle)
    hidden = bundle.manifest.drafter.kind == "mtp"
    prompt = [(17 * i) % 1000 + 100 for i in range(200)]
    for i in range(0, len(prompt), session.max_chunk):
        session.forward(prompt[i : i + session.max_chunk], i)
    times: dict[int, list[float]] = {t: [] for t in WIDTHS}
    for _ in range(args.rounds + 1):
        for t in WIDTHS:
            started = time.perf_counter()
            session.forward(list(range(5, 5 + t)), len(prompt), hidden)
            times[t].append((time.perf_counter() - started) * 1e3)
    rows = []
    for t in WIDTHS:
        runs = times[t][1:]  # the first round warms up
        rows.append(
            {"T": t, "best_ms": round(min(runs), 2), "median_ms": round(statistics.median(runs), 2)}
        )
    base = rows[0]
    for row in rows:
        row["median_ratio"] = round(row["median_ms"] / base["median_ms"], 2)
        row["best_ratio"] = round(row["best_ms"] / base["best_ms"], 2)
    report = {
        "bundle": args.bundle,
        "quant": bundle.manifest.models["target"].quant,
        "threads": args.threads,
        "rounds": args.rounds,
        "rows": rows,
    }
    lines = [
        f"# ONNX Runtime calls: {Path(args.bundle).name}, {args.threads} threads",
        "",
        f"{args.rounds} round-robin rounds after a 200-token prefill; calls at position 200.",
        "",
        "| T | best ms | median ms | best / T=1 | median / T=1 |",
        "|---|---|---|---|---|",
        *[
            f"| {r['T']} | {r['best_ms']} | {r['median_ms']} | {r['best_ratio']} | "
            f"{r['median_ratio']} |"
            for r in rows
        ],
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
