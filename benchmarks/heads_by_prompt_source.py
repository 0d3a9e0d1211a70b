"""How well MTP heads draft depends on what they are asked about: tau of heads files on one
bundle's exported target, by where the prompts come from.

    python benchmarks/heads_by_prompt_source.py --bundle BUNDLE --model MODEL HEADS [HEADS ...]
        [--prompts 48] [--max-new-tokens 96] [--out results/training/heads_by_prompt_source]

Three sources, none of them in any heads' training text:
- the built-in suite, per category (hand-written requests of eight kinds);
- template prompts over the offline material (`mtp-train`'s templates) from another seed than
  training's;
- requests the target writes itself from the start of a user turn (Magpie-style), from another
  seed than training's (written once by the int8 target and kept next to --out).

Each heads file drafts in float32, eagerly, from the bundle's own hidden states (what the exported
heads do, within the <= 5% that quantizing them was measured to cost), greedy, at the bundle's k,
with neither the confidence gate nor prompt lookup: the heads alone. Heads without attention
only (as in heads_quantization.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from heads_quantization import run, run_arguments
from results_files import write_results

from mtp_edge.checkpoints import load_model
from mtp_edge.devices.harness import load_prompts
from mtp_edge.mtp import load_heads
from mtp_edge.runtime.bundle import open_bundle, target_session
from mtp_edge.runtime.mtp_drafter import MtpDrafter, eager_step_fn
from mtp_edge.train.corpus import kinded_prompts
from mtp_edge.train.int8 import int8_writer
from mtp_edge.train.own_requests import self_written_requests

# Seeds other than mtp-train's default (0), so that no prompt is one the heads trained on.
TEMPLATE_SEED = 777
REQUEST_SEED = 999


def prompt_sets(loaded, count: int, requests_path: Path) -> dict[str, list[list[int]]]:
    tokenizer = loaded.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    sets: dict[str, list[list[int]]] = {}
    for p in load_prompts(None):
        sets.setdefault(f"suite: {p.category}", []).append(encode(p.prompt))
    templates = itertools.islice(kinded_prompts(TEMPLATE_SEED), count)
    sets["templates (unseen seed)"] = [encode(prompt) for _, prompt in templates]
    requests = self_written_requests(
        loaded, count, REQUEST_SEED, requests_path, print, int8_writer(loaded.model), 64
    )
    sets["self-written requests (unseen seed)"] = [encode(r) for r in requests]
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="heads files (without attention) of the target")
    ap.add_argument("--bundle", required=True, help="an ExecuTorch bundle of the target")
    ap.add_argument("--prompts", type=int, default=48, help="template prompts and requests")
    args = run_arguments(ap)
    bundle = open_bundle(args.bundle)
    k = bundle.manifest.drafter.k or 4
    loaded = load_model(args.model)
    where = Path(args.out).with_suffix(".requests.jsonl") if args.out else None
    sets = prompt_sets(loaded, args.prompts, where or Path("heads_by_prompt_source.requests.jsonl"))
    session = target_session(bundle)
    eos = loaded.tokenizer.eos_ids
    runs: dict[str, dict] = {}
    for path in args.heads:
        head = load_heads(path, loaded.model, loaded.name).float().eval()
        if head.config.attention != "none":
            raise SystemExit(f"error: {path} has attention: only heads without it are swappable")
        drafter = MtpDrafter(
            eager_step_fn(head, loaded.model), head.draft_ids, bundle.manifest.vocab_size
        )
        began, results = time.perf_counter(), {}
        for name, prompts in sets.items():
            results[name], _ = run(session, drafter, prompts, k, args.max_new_tokens, eos)
            print(path, name, json.dumps(results[name]), flush=True)
        suite = [r["tau"] for name, r in results.items() if name.startswith("suite: ")]
        results["suite (mean over categories)"] = {"tau": round(sum(suite) / len(suite), 4)}
        results["seconds"] = round(time.perf_counter() - began, 1)
        runs[path] = results
    names = list(sets) + ["suite (mean over categories)"]
    lines = [
        f"# MTP heads by prompt source, on `{Path(args.bundle).name}`",
        "",
        f"Greedy, k={k}, {args.max_new_tokens} new tokens, the heads alone (no confidence gate, "
        "no lookup), float32 heads reading the bundle's hidden states. tau per prompt source "
        f"({len(sets['templates (unseen seed)'])} template prompts and "
        f"{len(sets['self-written requests (unseen seed)'])} self-written requests, seeds "
        f"{TEMPLATE_SEED} and {REQUEST_SEED}; the suite's 48 prompts by category).",
        "",
        "| prompts | " + " | ".join(Path(p).parent.name or Path(p).name for p in runs) + " |",
        "|---|" + "---|" * len(runs),
        *(
            f"| {name} | " + " | ".join(f"{r[name]['tau']:.2f}" for r in runs.values()) + " |"
            for name in names
        ),
    ]
    print("\n".join(lines))
    if args.out:
        data = {
            "bundle": Path(args.bundle).name,
            "k": k,
            "max_new_tokens": args.max_new_tokens,
            "runs": runs,
        }
        command = "python benchmarks/heads_by_prompt_source.py " + " ".join(sys.argv[1:])
        write_results(args.out, data, lines, command)


if __name__ == "__main__":
    main()
