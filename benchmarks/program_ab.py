"""Two bundles' target programs side by side: forward(T) calls of A and B in alternating rounds
(A then B, then B then A, ...) in one process, so that both see the same states of a noisy
host; per round the median of --calls calls, and B/A as the median of the rounds' ratios.
For a change that leaves the program's numbers alone and moves its speed (a kernel, an export
option), where two separate mtp-bench runs would differ by the host's drift.

    python benchmarks/program_ab.py A_BUNDLE B_BUNDLE [--widths 1,5] [--position 150]
        [--rounds 10] [--calls 15] [--out PATH]

Writes PATH.json and PATH.md (default results/verification/program_ab).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mtp_edge.machine import hand_cores_to_executorch
from mtp_edge.runtime.bundle import open_bundle, target_session
from mtp_edge.runtime.session import prefill

RESULTS = "benchmarks/results/verification/program_ab"


def call_ms(method, width: int, position: int, calls: int) -> float:
    """Median ms of `calls` forward(width) calls at `position` (each overwrites the same slots,
    as a rejected draft's)."""
    tokens, start = torch.tensor([[1234] * width]), torch.tensor([position])
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        method.execute([tokens, start])
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def compare(a: str, b: str, widths: list[int], position: int, rounds: int, calls: int) -> dict:
    hand_cores_to_executorch()
    methods = {}
    for name in (a, b):
        session = target_session(open_bundle(name))
        prefill(session, [1000 + i % 500 for i in range(position)], 0)
        methods[name] = session.method
        for width in widths:  # warm-up
            call_ms(session.method, width, position, 3)
    times = {name: {w: [] for w in widths} for name in (a, b)}
    began = time.perf_counter()
    for r in range(rounds):
        for name in (a, b) if r % 2 == 0 else (b, a):
            for width in widths:
                times[name][width].append(call_ms(methods[name], width, position, calls))
        left = (time.perf_counter() - began) / (r + 1) * (rounds - r - 1)
        print(f"round {r + 1}/{rounds}, ~{left:.0f} s left", file=sys.stderr, flush=True)
    rows = []
    for width in widths:
        ratios = [y / x for x, y in zip(times[a][width], times[b][width], strict=True)]
        rows.append(
            {
                "width": width,
                "a_ms": round(statistics.median(times[a][width]), 3),
                "b_ms": round(statistics.median(times[b][width]), 3),
                "b_over_a": round(statistics.median(ratios), 4),
                "b_faster_rounds": sum(x < 1 for x in ratios),
                "ratios": [round(x, 4) for x in ratios],
            }
        )
    return {"a": a, "b": b, "position": position, "rounds": rounds, "calls": calls, "rows": rows}


def to_markdown(result: dict, command: str) -> str:
    lines = [
        "# Two target programs side by side",
        "",
        f"A `{result['a']}`, B `{result['b']}`; forward(T) at position {result['position']}, "
        f"{result['rounds']} alternating rounds of {result['calls']} calls each (ms: medians).",
        "",
        "| T | A ms | B ms | B/A (median of rounds) | rounds B faster |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['width']} | {row['a_ms']:.2f} | {row['b_ms']:.2f} | {row['b_over_a']:.3f} "
            f"| {row['b_faster_rounds']}/{result['rounds']} |"
        )
    return "\n".join(lines + ["", f"Command: `{command}`", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--widths", default="1,5")
    parser.add_argument("--position", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--out", default=RESULTS, help="results path without extension")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    result = compare(args.a, args.b, widths, args.position, args.rounds, args.calls)
    command = "python benchmarks/program_ab.py " + " ".join(sys.argv[1:])
    result["command"] = command
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = to_markdown(result, command)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
