"""The native runtime drafting from its own past requests (`mtp-runner --store`), on requests it
has not seen.

What the phone gets without any training: the C++ store of past requests (the C API's
`"store": true`, the Android demo's default). Each setup is one `mtp-runner` run over the same
test requests, plain and speculative decoding of each request in turn (so speedup compares
like with like inside a run), greedy:
- `static`: the bundle's drafter as exported;
- `store`: the store fed each test request after it is answered (what a fresh install learns
  from its first requests);
- `store, seeded`: the same, its store first fed a request log of earlier traffic
  (`--store-log DIR`, as `mtp-serve --log DIR` writes it).
Reported per setup and per category of request: tau, verify/decode, draft/decode, speedup,
how many drafts the store extended, output identical to plain.

    python benchmarks/native_store.py --bundle B --test test.jsonl [--log DIR] \\
        [--runner runtime/native/build/mtp-runner] [--threads 2] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run(runner: str, bundle: str, test: str, threads: int, extra: list[str], out: Path) -> dict:
    command = [runner, "--bundle", bundle, "--prompts", test, "--threads", str(threads)]
    command += [*extra, "--json", str(out)]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def row(label: str, report: dict) -> dict:
    s = report["summary"]
    by_category: dict[str, list[float]] = {}
    for p in report["prompts"]:
        by_category.setdefault(p["category"], []).append(p["tau"])
    return {
        "setup": label,
        "tau": s["tau"],
        "tau_by_category": {c: round(statistics.mean(t), 3) for c, t in by_category.items()},
        "verify_over_decode": s["verify_over_decode"],
        "draft_over_decode": s["draft_over_decode"],
        "plain_tok_s": s["ar_tokens_per_s"],
        "spec_tok_s": s["spec_tokens_per_s"],
        "speedup": s["speedup"],
        "store_extended": sum(p.get("store_extended", 0) for p in report["prompts"]),
        "verify_steps": sum(p["verify_steps"] for p in report["prompts"]),
        "identical": sum(p["identical"] for p in report["prompts"]),
        "prompts": len(report["prompts"]),
        "k": report["k"],
    }


def markdown(rows: list[dict], command: str) -> str:
    categories = list(rows[0]["tau_by_category"])
    head = (
        "| setup | tau | " + " / ".join(categories) + " | verify/decode | draft/decode "
        "| plain tok/s | spec tok/s | speedup | drafts the store extended | identical |"
    )
    lines = [f"`{command}`", "", head, "|" + "---|" * 10]
    for r in rows:
        by = " / ".join(f"{r['tau_by_category'][c]:.2f}" for c in categories)
        lines.append(
            f"| {r['setup']} | {r['tau']:.3f} | {by} | {r['verify_over_decode']:.2f} "
            f"| {r['draft_over_decode']:.3f} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
            f"| {r['speedup']:.3f}x | {r['store_extended']} | {r['identical']}/{r['prompts']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--test", required=True, help="prompts file (mtp-runner --prompts)")
    parser.add_argument("--log", help="a request log of earlier traffic (--store-log)")
    parser.add_argument("--runner", default="runtime/native/build/mtp-runner")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="native_store")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    setups = [("static", []), ("store", ["--store"])]
    if args.log:
        setups.append(("store, seeded", ["--store-log", args.log]))
    rows = []
    for n, (label, extra) in enumerate(setups):
        report = run(
            args.runner, args.bundle, args.test, args.threads, extra, Path(f"{out}.run{n}.json")
        )
        rows.append(row(label, report))
        print(json.dumps(rows[-1]), flush=True)
    command = "python " + " ".join(sys.argv)
    Path(f"{out}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    Path(f"{out}.md").write_text(markdown(rows, command))
    print(markdown(rows, command))


if __name__ == "__main__":
    main()
