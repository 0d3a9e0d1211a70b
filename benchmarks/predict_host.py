"""Predicted vs measured tokens/s on this machine, for several bundles: runs `mtp-profile --device
host` on each (measurement and roofline calibration interleaved prompt by prompt) and writes
benchmarks/results/devices/roofline_vs_host.md and .json.

    python benchmarks/predict_host.py BUNDLE [BUNDLE ...] [--max-new-tokens 64] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results/devices"
PROMPTS = RESULTS / "prompts_two_per_category.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--note", default="", help="Conditions of the run (machine load...).")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, bundle in enumerate(args.bundles):
            out = Path(tmp) / f"{i}.json"
            command = [
                "mtp-profile", "--device", "host", "--bundle", bundle,
                "--prompts", os.path.relpath(PROMPTS), "--max-new-tokens", str(args.max_new_tokens),
            ]  # fmt: skip
            print(" ".join(command), file=sys.stderr)
            # exit 1 when not lossless; the JSON is written all the same
            subprocess.run([*command, "--json", str(out)], check=False)
            report = json.loads(out.read_text())
            report["command"] = " ".join(command)
            runs.append(report)
    table = [
        "| bundle | plain measured | plain predicted | error | spec measured | spec predicted "
        "| error | speedup measured / predicted | plain bound | verify bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        v, p = r["host_validation"], r["prediction"]
        table.append(
            f"| {Path(r['bundle']).name} | {v['plain']['measured']:.1f} | "
            f"{v['plain']['predicted']:.1f} | {v['plain']['error']:+.1%} | "
            f"{v['speculative']['measured']:.1f} | {v['speculative']['predicted']:.1f} | "
            f"{v['speculative']['error']:+.1%} | {v['speedup']['measured']:.2f} / "
            f"{v['speedup']['predicted']:.2f} | {p['plain']['bound']} | "
            f"{p['speculative']['verify']['bound']} |"
        )
    lines = [
        "# Roofline prediction vs measurement on the host",
        "",
        f"Machine: {os.uname().nodename}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}."
        + (f" {args.note}" if args.note else ""),
        "",
        f"Command: `python benchmarks/predict_host.py {' '.join(args.bundles)} "
        f"--max-new-tokens {args.max_new_tokens}`",
        "",
        "Tokens/s are decode tokens per second over the 16 prompts of "
        "`results/devices/prompts_two_per_category.jsonl` (two per category); predicted from "
        "the bundle's files, "
        "the host's calibration (taken before every prompt and after the last, then averaged) "
        "and the tau measured in the same run.",
        "",
        *table,
        "",
        "Calibration (averages):",
        "",
        "| bundle | bandwidth GB/s | compute Gop/s | target call overhead ms | loop ms plain / "
        "spec | draft step overhead ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        c = r["calibration"]
        lines.append(
            f"| {Path(r['bundle']).name} | {c['bandwidth_gbs']:.1f} | {c['compute_gops']:.0f} | "
            f"{c['target_overhead_ms']:.2f} | {c['plain_loop_ms']:.2f} / {c['spec_loop_ms']:.2f} | "
            f"{c['draft_overhead_ms']:.3f} |"
        )
    lines += ["", "Per run:", ""] + [f"- `{r['command']}`" for r in runs]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "roofline_vs_host.md").write_text("\n".join(lines) + "\n")
    summary = [{k: r[k] for k in ("bundle", "command", "summary", "prediction", "calibration",
                                  "host_validation")} for r in runs]  # fmt: skip
    (RESULTS / "roofline_vs_host.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
