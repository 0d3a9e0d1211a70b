"""verify(k+1) / decode(1) of a bundle's target, steady state: the same call repeated, as in
speculative decoding where verifications follow each other (scheme_table.py instead alternates
widths and methods every call, which costs more: see benchmarks/README.md), at each of several
cache positions (attention reads every earlier slot, and the row-exact verify reads them once
per row). Writes results/verification/verify_cost_by_position.{json,md,png} (or --out).

    python benchmarks/verify_cost.py [--bundle DIR] [--threads 2] [--repeats 60]
        [--positions 32,64,150,250,400,550] [--widths 1,2,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mtp_edge.runtime.bundle import open_bundle, target_session
from mtp_edge.runtime.session import prefill

RESULTS = "benchmarks/results/verification/verify_cost_by_position"


def timed(fn, repeats: int) -> float:
    """Median ms of `repeats` calls after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def alternating(session, tokens, position: int, repeats: int) -> tuple[float, float]:
    """Median ms of a decode step and of a verify when they alternate call by call, as in the
    speculative loop (the steady state above repeats one call)."""
    decode, verify = [], []
    for i in range(repeats + 5):
        start = time.perf_counter()
        session.forward(tokens[:1], position)
        middle = time.perf_counter()
        session.forward(tokens, position + 1)
        if i >= 5:
            decode.append(middle - start)
            verify.append(time.perf_counter() - middle)
    return sorted(decode)[repeats // 2] * 1e3, sorted(verify)[repeats // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="bundles/SmolLM2-135M-Instruct-android")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--positions", default="32,64,150,250,400,550")
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8,9", help="forward(T) sweep")
    parser.add_argument("--width-position", type=int, default=100)
    parser.add_argument("--out", default=RESULTS, help="results path without extension")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    positions = [int(p) for p in args.positions.split(",")]
    bundle = open_bundle(args.bundle)
    session = target_session(bundle)
    width = bundle.manifest.drafter.k + 1
    prefill(session, [100 + i % 1000 for i in range(max(positions))])
    tokens = list(range(5, 5 + width))
    rows = []
    for position in positions:
        at = torch.tensor([position])
        decode = timed(lambda p=position: session.forward(tokens[:1], p), args.repeats)
        verify = timed(lambda p=position: session.forward(tokens, p), args.repeats)
        batched = timed(
            lambda a=at: session.method.execute([torch.tensor([tokens]), a]), args.repeats
        )
        alt_decode, alt_verify = alternating(session, tokens, position, args.repeats)
        rows.append(
            {
                "position": position,
                "decode_ms": round(decode, 3),
                "verify_ms": round(verify, 3),
                "verify_over_decode": round(verify / decode, 3),
                "batched_forward_ms": round(batched, 3),
                "batched_over_decode": round(batched / decode, 3),
                "alternating_decode_ms": round(alt_decode, 3),
                "alternating_verify_ms": round(alt_verify, 3),
                "alternating_over_decode": round(alt_verify / alt_decode, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    # forward(T) / forward(1) by width, at one position: what the linear layers cost per row
    at = torch.tensor([args.width_position])
    by_width = {}
    for t in (int(w) for w in args.widths.split(",")):
        call = [torch.tensor([list(range(5, 5 + t))]), at]
        by_width[t] = timed(lambda c=call: session.method.execute(c), args.repeats)
    widths = [
        {"tokens": t, "ms": round(ms, 3), "over_one": round(ms / by_width[min(by_width)], 3)}
        for t, ms in by_width.items()
    ]
    print(json.dumps(widths), flush=True)
    command = (
        f"python benchmarks/verify_cost.py --bundle {args.bundle} --threads {args.threads} "
        f"--repeats {args.repeats} --positions {args.positions} --widths {args.widths} "
        f"--width-position {args.width_position}"
        + ("" if args.out == RESULTS else f" --out {args.out}")
    )
    report = {"bundle": args.bundle, "threads": args.threads, "width": width, "rows": rows}
    report["forward_by_width"] = {"position": args.width_position, "rows": widths}
    report["command"] = command
    with open(args.out + ".json", "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# verify({width}) / decode(1) by cache position: {args.bundle}",
        "",
        "| position | decode ms | verify ms | verify/decode | batched ms | batched/decode "
        "| alternating: decode ms | verify ms | verify/decode |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['position']} | {r['decode_ms']} | {r['verify_ms']} | "
            f"{r['verify_over_decode']} | {r['batched_forward_ms']} | {r['batched_over_decode']} "
            f"| {r['alternating_decode_ms']} | {r['alternating_verify_ms']} "
            f"| {r['alternating_over_decode']} |"
        )
    lines += [
        "",
        f"forward(T) / forward(1) at position {args.width_position}:",
        "",
        "| T | " + " | ".join(str(w["tokens"]) for w in widths) + " |",
        "|---|" + "---|" * len(widths),
        "| cost | " + " | ".join(str(w["over_one"]) for w in widths) + " |",
    ]
    lines += ["", f"Command: `{command}`", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    plot(rows, width, args.out + ".png")


def plot(rows: list[dict], width: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["position"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, [r["verify_over_decode"] for r in rows], "o-", label=f"verify({width}), repeated")
    ax.plot(x, [r["batched_over_decode"] for r in rows], "s--", label=f"batched forward({width})")
    ax.plot(
        x,
        [r["alternating_over_decode"] for r in rows],
        "^-",
        label=f"verify({width}) alternating with decode",
    )
    ax.axhline(1.3, color="grey", lw=0.8, ls=":", label="goal 1.3")
    ax.set_xlabel("cache position")
    ax.set_ylabel("cost / one decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
