"""Memory of a model that adapts (`adapt=True`) over a long stream: does anything grow?

    python benchmarks/adapt_memory.py --bundle BUNDLE [--requests 400] [--max-new-tokens 64]
        [--out results/drafting/adapt_memory]

One process per allocator setting, each serving the same stream (adapt_stream.py's questions
about Python standard-library modules, cycled) with only the adapting model loaded, greedy.
After every request it records the process's RSS, what glibc's malloc holds in use (heap and
mmapped blocks: `mallinfo2`) and what the adapter itself keeps (replay buffer, store of past
requests). Settings: the threshold fixed at 1 MB (`mtp_edge.memory.return_freed_memory`, what
an adapting model sets when it loads), and glibc's defaults (that call skipped: a freed block
of several MB raises the mmap threshold, so later blocks of that size come from the heap and
stay resident when freed).
Reported: each series at the first request, the half and the end, the growth over the second
half, and a plot.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = ("threshold-1mb", "glibc-default")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def malloc_in_use_mb() -> float | None:
    """Bytes malloc has handed out and not had back (heap + mmapped blocks), in MB."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def serve(args) -> None:
    """The child: one setting, the adapting model alone, a row per request as JSON lines."""
    import mtp_edge.runtime.adapt as adapt

    if args.setting == "glibc-default":  # what an adapting model did before it fixed the threshold
        adapt.return_freed_memory = lambda: None
    sys.path.insert(0, str(Path(__file__).parent))
    from adapt_stream import rss_mb, stream

    from mtp_edge import load

    llm = load(bundle=args.bundle, adapt=True)
    adapter = llm.generator.adapter
    buffer = adapter.buffer
    buffer_mb = sum(t.numel() * t.element_size() for t in (buffer.features, buffer.logits)) / 2**20
    start = time.perf_counter()
    requests = stream(args.requests)
    with open(args.rows, "w") as out:
        for i, prompt in enumerate(requests):
            llm.generate(prompt, max_new_tokens=args.max_new_tokens)
            a = llm.adaptation
            row = {
                "request": i + 1,
                "rss_mb": round(rss_mb(), 1),
                "malloc_mb": round(malloc_in_use_mb() or 0.0, 1),
                "buffer_mb": round(buffer_mb, 1),
                "store_tokens": a.get("store_tokens", 0),
                "steps": a["steps"],
            }
            out.write(json.dumps(row) + "\n")
            out.flush()
            done = i + 1
            left = (time.perf_counter() - start) / done * (len(requests) - done)
            print(
                f"[{args.setting} {done}/{len(requests)}] rss {row['rss_mb']:.0f} MB, malloc in "
                f"use {row['malloc_mb']:.0f} MB, ~{left:.0f} s left",
                flush=True,
            )


def summary(rows: list[dict]) -> dict:
    half = len(rows) // 2
    out = {}
    for key in ("rss_mb", "malloc_mb"):
        series = [r[key] for r in rows]
        out[key] = {
            "first": series[0],
            "half": series[half - 1],
            "end": series[-1],
            "max": max(series),
            "second_half_growth": round(series[-1] - series[half - 1], 1),
        }
    out["store_tokens_end"] = rows[-1]["store_tokens"]
    out["steps"] = rows[-1]["steps"]
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for setting, rows in results.items():
        x = [r["request"] for r in rows]
        ax.plot(x, [r["rss_mb"] for r in rows], label=f"RSS, {setting}")
        ax.plot(x, [r["malloc_mb"] for r in rows], ls="--", label=f"malloc in use, {setting}")
    ax.set_xlabel("request")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/drafting/adapt_memory")
    parser.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting:
        serve(args)
        return
    if args.requests < 2:
        sys.exit("error: --requests needs at least 2 (the stream is reported in halves)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for setting in SETTINGS:
        rows_file = out.with_name(f"{out.name}.{setting}.jsonl")
        child = [sys.executable, __file__, "--bundle", args.bundle, "--requests",
                 str(args.requests), "--max-new-tokens", str(args.max_new_tokens),
                 "--setting", setting, "--rows", str(rows_file)]  # fmt: skip
        subprocess.run(child, check=True)
        results[setting] = [json.loads(line) for line in rows_file.read_text().splitlines()]
        rows_file.unlink()
    summaries = {s: summary(rows) for s, rows in results.items()}
    out.with_suffix(".json").write_text(
        json.dumps({"bundle": args.bundle, "summary": summaries, "rows": results}, indent=1)
    )
    plot(results, out.with_suffix(".png"))
    half = args.requests // 2
    lines = [
        f"# Memory of an adapting model over {args.requests} requests",
        "",
        f"Bundle {args.bundle}, only the adapting model in the process, greedy, "
        f"{args.max_new_tokens} new tokens; MB after request 1 / {half} / {args.requests}.",
        "",
        "| malloc setting | RSS | RSS growth, 2nd half | malloc in use | in use growth, 2nd half |",
        "|---|---|---|---|---|",
    ]
    for s, m in summaries.items():
        r, u = m["rss_mb"], m["malloc_mb"]
        lines.append(
            f"| {s} | {r['first']} / {r['half']} / {r['end']} (max {r['max']}) | "
            f"{r['second_half_growth']:+} | {u['first']} / {u['half']} / {u['end']} | "
            f"{u['second_half_growth']:+} |"
        )
    last = next(iter(summaries.values()))
    lines += [
        "",
        f"Store of past requests at the end: {last['store_tokens_end']} tokens; optimizer steps: "
        f"{last['steps']}. Plot: {out.with_suffix('.png').name}.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
