"""Online adaptation (`--adapt`) on a stream of requests on one theme: tau with adapting heads
against the same heads left static, request for request, and what adapting costs.

    python benchmarks/adapt_stream.py --bundle BUNDLE [--requests 200] [--max-new-tokens 64]
        [--out results/drafting/adapt_stream]

The stream is built offline: questions about Python standard-library modules, from templates x
modules (shuffled with a fixed seed), a theme unlike the heads' training text (self-written
general chat). Three models of the same bundle answer each request in turn, greedy: plain (no
drafter), the bundle's drafter as exported (static), and the same drafter with `adapt=True`.
Reported: tau over the first and the last half of the stream, both drafters; the three terms of
the speedup (tau, verify/decode and draft/decode, where the draft time of the adapting drafter
includes its correction, and decode is plain decoding's step in the same run); adaptation time
over generation time; output identical to plain for every request; the process's RSS along the
stream.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from mtp_edge import load

MODULES = [
    "itertools", "functools", "collections", "pathlib", "os.path", "subprocess", "json",
    "csv", "re", "datetime", "argparse", "logging", "unittest", "sqlite3", "asyncio",
    "threading", "multiprocessing", "heapq", "bisect", "dataclasses", "typing", "enum",
    "contextlib", "shutil", "tempfile", "glob", "hashlib", "random", "statistics", "math",
    "decimal", "fractions", "textwrap", "string", "struct", "zipfile", "tarfile", "gzip",
    "urllib.request", "http.server", "socket", "uuid", "time", "calendar", "pickle", "copy",
    "pprint", "timeit", "abc", "operator",
]  # fmt: skip
TEMPLATES = [
    "What does the Python module {m} do? Give a short example.",
    "Explain how to use {m} in Python, with a code sample.",
    "What are the most useful functions in Python's {m} module?",
    "Write a small Python script that uses the {m} module and explain it.",
]


def stream(count: int, seed: int = 0) -> list[str]:
    requests = [t.format(m=m) for m in MODULES for t in TEMPLATES]
    random.Random(seed).shuffle(requests)
    return [requests[i % len(requests)] for i in range(count)]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def step_counts(st) -> dict:
    """What a request's stats add to the speedup's three terms over many requests."""
    return {
        "step_tokens": st.step_tokens,
        "verify_steps": st.verify_steps,
        "decoded": st.decoded_tokens,
        "decode_seconds": st.decode_seconds,
        "draft_seconds": st.draft_seconds,
        "verify_seconds": st.verify_seconds,
    }


def totals(rows: list[dict], key: str) -> dict:
    rows = [r for r in rows if key in r]
    return {f: sum(r[key][f] for r in rows) for f in rows[0][key]}


def terms(rows: list[dict], key: str) -> dict:
    """tau, verify/decode and draft/decode over `rows`, decode being plain's step."""
    s, p = totals(rows, key), totals(rows, "plain")
    decode = p["decode_seconds"] / p["verify_steps"]
    tau = s["step_tokens"] / s["verify_steps"]
    verify = s["verify_seconds"] / s["verify_steps"] / decode
    draft = s["draft_seconds"] / s["verify_steps"] / decode
    return {
        "tau": round(tau, 3),
        "verify_decode": round(verify, 3),
        "draft_decode": round(draft, 4),
        "speedup_formula": round(tau / (verify + draft), 3),
        "speedup_measured": round(
            (s["decoded"] / s["decode_seconds"]) / (p["decoded"] / p["decode_seconds"]), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/drafting/adapt_stream")
    parser.add_argument(
        "--plain-every",
        type=int,
        default=1,
        help="Decode plainly every Nth request only (identity with plain checked on those; "
        "static and adapting output compared on every request). Saves time on a busy machine.",
    )
    args = parser.parse_args()
    if args.requests < 2:
        sys.exit("error: --requests needs at least 2 (the stream is reported in halves)")

    models = {
        "plain": load(bundle=args.bundle, drafter="none"),
        "static": load(bundle=args.bundle),
        "adapt": load(bundle=args.bundle, adapt=True),
    }
    requests = stream(args.requests)
    rows: list[dict] = []
    start = time.perf_counter()
    for i, prompt in enumerate(requests):
        row: dict = {"prompt": prompt}
        tokens = {}
        for name, llm in models.items():
            if name == "plain" and i % args.plain_every:
                continue
            c = llm.generate(prompt, max_new_tokens=args.max_new_tokens)
            tokens[name] = c.token_ids
            row[name] = step_counts(c.stats)
        plain = tokens.get("plain", tokens["adapt"])
        row["identical"] = tokens["static"] == tokens["adapt"] == plain
        row["checked_against_plain"] = "plain" in tokens
        row["adaptation"] = models["adapt"].adaptation
        row["rss_mb"] = round(rss_mb(), 1)
        rows.append(row)
        done = i + 1
        elapsed = time.perf_counter() - start
        left = elapsed / done * (len(requests) - done)
        recent = rows[-20:]
        print(
            f"[{done}/{len(requests)}] tau static {terms(recent, 'static')['tau']:.2f} "
            f"adapt {terms(recent, 'adapt')['tau']:.2f} (last 20), identical "
            f"{sum(r['identical'] for r in rows)}/{done}, rss {row['rss_mb']:.0f} MB, "
            f"{elapsed:.0f} s, ~{left:.0f} s left",
            flush=True,
        )
        if done % 20 == 0 and done < len(requests):
            write(args, rows, elapsed)

    print(write(args, rows, time.perf_counter() - start))

def write(args, rows: list[dict], seconds: float) -> str:
    """The results of the requests so far (a partial stream says so)."""
    half = len(rows) // 2
    adaptation = rows[-1]["adaptation"]
    summary = {
        "bundle": args.bundle,
        "requests": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "identical": sum(r["identical"] for r in rows),
        "checked_against_plain": sum(r["checked_against_plain"] for r in rows),
        "first_half": {k: terms(rows[:half], k) for k in ("static", "adapt")},
        "last_half": {k: terms(rows[half:], k) for k in ("static", "adapt")},
        "adaptation": adaptation,
        "rss_mb": {
            "after_first": rows[0]["rss_mb"],
            "at_half": rows[half - 1]["rss_mb"],
            "at_end": rows[-1]["rss_mb"],
            "max": max(r["rss_mb"] for r in rows),
        },
        "seconds": round(seconds, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    last, first = summary["last_half"], summary["first_half"]
    lines = [
        f"# Online adaptation on a {len(rows)}-request stream (Python stdlib questions)"
        + ("" if len(rows) == args.requests else f" (partial: {args.requests} planned)"),
        "",
        f"Bundle {args.bundle}, greedy, {args.max_new_tokens} new tokens, "
        f"output identical: {summary['identical']}/{len(rows)} requests (static = adapting on "
        f"all, = plain on the {summary['checked_against_plain']} decoded plainly too).",
        "",
        "| requests | drafter | tau | verify/decode | draft/decode | speedup (formula) | "
        "speedup (measured) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, part in ((f"1-{half}", first), (f"{half + 1}-{len(rows)}", last)):
        for k in ("static", "adapt"):
            t = part[k]
            lines.append(
                f"| {label} | {k} | {t['tau']} | {t['verify_decode']} | {t['draft_decode']} | "
                f"{t['speedup_formula']} | {t['speedup_measured']} |"
            )
    lines += [
        "",
        f"tau gain over the last {len(rows) - half}: "
        f"{last['adapt']['tau'] - last['static']['tau']:+.3f}.",
        f"Adaptation: {adaptation['steps']} optimizer steps on {adaptation['pairs']} pairs, "
        f"{adaptation['adapt_seconds']} s = {adaptation['share']:.1%} of the adapting model's "
        f"generation time ({adaptation['generation_seconds']} s).",
        f"Store of past requests: {adaptation.get('store_drafts', 0)} drafts from it, "
        f"{adaptation.get('store_tokens', 0)} tokens of {adaptation.get('store_requests', 0)} "
        "requests held at the end.",
        f"RSS (whole process, three models): {summary['rss_mb']['after_first']} MB after the "
        f"first request, {summary['rss_mb']['at_half']} at the half, "
        f"{summary['rss_mb']['at_end']} at the end (max {summary['rss_mb']['max']}).",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
