"""A deployment that learned from its own requests, end to end, on requests it has not seen.

The path the product offers, each step a real command or API call:
1. the deployment serves the training requests with a request log (`load(..., log=DIR)`, as
   `mtp-serve --log DIR` does);
2. heads refined on them (`mtp-train --init HEADS --prompts DIR`) and swapped into the bundle
   (`mtp-export --update-heads`): given here as a bundle (refine_stream.py makes one);
3. the deployment restarts with `--adapt --log DIR`: its store of past requests is seeded from
   the log, and it keeps learning.

Then the test requests (none of them served before), greedy, each setup request for request:
plain decoding, the shipped bundle as exported, the shipped bundle adapting (store seeded from
the log), the refined bundle, the refined bundle adapting. Reported per setup and per category
of request: tau, verify/decode, draft/decode (decode = plain's step in the same run), speedup,
output identical to plain.

    python benchmarks/served_stream.py --shipped B --refined B2 --refined-heads H \\
        --train train.txt --test test.jsonl --log DIR [--max-new-tokens 64] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from adapt_stream import step_counts  # noqa: E402

from mtp_edge import load  # noqa: E402
from mtp_edge.request_log import log_files  # noqa: E402


def serve_training_requests(bundle: str, prompts: list[str], log: Path, max_new: int) -> None:
    if log_files(log):
        print(f"[log] {log} holds requests already: kept", flush=True)
        return
    llm = load(bundle=bundle, drafter="none", log=log)
    start = time.perf_counter()
    for n, prompt in enumerate(prompts, 1):
        llm.chat([{"role": "user", "content": prompt}], max_new_tokens=max_new)
        left = (time.perf_counter() - start) / n * (len(prompts) - n)
        print(f"\r[log] served {n}/{len(prompts)}, ~{left:.0f} s left", end="", flush=True)
    print()


def terms(rows: list[dict], name: str) -> dict:
    s = {f: sum(r[name][f] for r in rows) for f in rows[0][name]}
    p = {f: sum(r["plain"][f] for r in rows) for f in rows[0]["plain"]}
    decode = p["decode_seconds"] / p["verify_steps"]
    tau = s["step_tokens"] / s["verify_steps"]
    return {
        "tau": round(tau, 3),
        "verify_decode": round(s["verify_seconds"] / s["verify_steps"] / decode, 3),
        "draft_decode": round(s["draft_seconds"] / s["verify_steps"] / decode, 4),
        "speedup": round(
            (s["decoded"] / s["decode_seconds"]) / (p["decoded"] / p["decode_seconds"]), 3
        ),
        "identical": sum(r["identical"][name] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shipped", required=True, help="the bundle as exported")
    parser.add_argument("--refined", required=True, help="the bundle with refined heads")
    parser.add_argument("--refined-heads", required=True, help="the refined heads file")
    parser.add_argument("--train", required=True, help="requests served first (.txt)")
    parser.add_argument("--test", required=True, help="requests to measure on (.jsonl)")
    parser.add_argument("--log", required=True, help="the request log folder")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/drafting/served_stream")
    args = parser.parse_args()

    train = [line for line in Path(args.train).read_text().splitlines() if line.strip()]
    test = [json.loads(line) for line in Path(args.test).read_text().splitlines() if line.strip()]
    log = Path(args.log)
    serve_training_requests(args.shipped, train, log, args.max_new_tokens)

    def log_copy() -> Path:
        """The log for an adapting model to seed from and append to (a copy: the test requests
        it serves must not reach the other model's store, nor a rerun's)."""
        copy = Path(tempfile.mkdtemp(prefix="served-log-")) / "log"
        shutil.copytree(log, copy)
        return copy

    models = {
        "plain": load(bundle=args.shipped, drafter="none"),
        "shipped": load(bundle=args.shipped),
        "shipped, adapting": load(bundle=args.shipped, adapt=True, log=log_copy()),
        "refined": load(bundle=args.refined),
        "refined, adapting": load(
            bundle=args.refined, heads=args.refined_heads, adapt=True, log=log_copy()
        ),
    }
    seeded = models["refined, adapting"].adaptation
    print(f"[store] seeded from the log: {seeded['store_requests']} requests", flush=True)
    rows, start = [], time.perf_counter()
    for n, request in enumerate(test, 1):
        row: dict = {"id": request.get("id"), "category": request.get("category", "all")}
        tokens = {}
        for name, llm in models.items():
            messages = [{"role": "user", "content": request["prompt"]}]
            c = llm.chat(messages, max_new_tokens=args.max_new_tokens)
            tokens[name] = c.token_ids
            row[name] = step_counts(c.stats)
        row["identical"] = {name: tokens[name] == tokens["plain"] for name in models}
        rows.append(row)
        left = (time.perf_counter() - start) / n * (len(test) - n)
        recent = {name: terms(rows[-20:], name)["tau"] for name in models if name != "plain"}
        print(f"[{n}/{len(test)}] tau (last 20) {recent}, ~{left:.0f} s left", flush=True)

    categories = sorted({r["category"] for r in rows})
    table = {
        name: {
            "all": terms(rows, name),
            **{c: terms([r for r in rows if r["category"] == c], name) for c in categories},
        }
        for name in models
        if name != "plain"
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"args": vars(args), "table": table, "adaptation": {
        name: models[name].adaptation for name in models if "adapting" in name
    }}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    lines = [
        f"# Served, refined, adapting: {len(test)} requests never served before",
        "",
        f"{len(train)} requests served first with a request log; greedy, {args.max_new_tokens} "
        "new tokens; tau per category of request.",
        "",
        "| setup | tau | " + " | ".join(f"tau {c}" for c in categories)
        + " | verify/decode | draft/decode | speedup | identical to plain |",
        "|---|---|" + "---|" * len(categories) + "---|---|---|---|",
    ]
    for name, t in table.items():
        lines.append(
            f"| {name} | {t['all']['tau']} | "
            + " | ".join(str(t[c]["tau"]) for c in categories)
            + f" | {t['all']['verify_decode']} | {t['all']['draft_decode']} | "
            f"{t['all']['speedup']}x | {t['all']['identical']}/{len(rows)} |"
        )
    lines += ["", "Command: `python benchmarks/served_stream.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    ) + "`", ""]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
