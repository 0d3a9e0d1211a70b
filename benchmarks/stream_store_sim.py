"""Drafting from a deployment's own past requests, simulated exactly on a request stream.

Under greedy decoding what a drafter gets accepted is fixed by the target's output (see
drafting_sim.py), so each policy's tau over a stream follows from the target's greedy answers
and its hidden states along them. The stream is adapt_stream.py's (requests on one theme, in
order); before request i, the store holds requests 1..i-1 (prompt and answer), as an adapting
deployment's does, never request i's own.

Policies (k tokens per draft):
- the bundle's: prompt lookup over the request's own context, else the head at its floor;
- past requests: prompt lookup, else the store of past requests (runtime/answer_store.py);
- past requests, then head: lookup, the store where it is confident, else the head;
- head, then past requests: lookup, else the head, the store going on where the head stops
  short of k (what an adapting drafter does, without its correction of the head).

    python benchmarks/stream_store_sim.py --bundle B [--heads H] [--requests 200] [--k 3]
        [--max-new-tokens 64] [--answers FILE] [--json OUT] [--markdown OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from adapt_stream import stream  # noqa: E402
from drafting_sim import accepted, lookup  # noqa: E402

from mtp_edge.checkpoints import load_model  # noqa: E402
from mtp_edge.mtp import heads_file, load_heads  # noqa: E402
from mtp_edge.runtime.answer_store import AnswerStore  # noqa: E402
from mtp_edge.runtime.bundle import open_bundle, target_session  # noqa: E402
from mtp_edge.runtime.loop import GenerationConfig, generate  # noqa: E402
from mtp_edge.runtime.mtp_drafter import eager_step_fn  # noqa: E402
from mtp_edge.runtime.session import EagerSession, prefill  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--heads")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--floor", type=float, default=0.5)
    parser.add_argument("--answers", help="JSON file keeping the greedy answers between runs")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    torch.set_num_threads(2)

    bundle = open_bundle(args.bundle)
    tok = bundle.tokenizer
    session = target_session(bundle)
    runs, started = [], time.time()
    cached = Path(args.answers) if args.answers else None
    if cached is not None and cached.exists():
        runs = json.loads(cached.read_text())[: args.requests]
    for n, text in enumerate(stream(args.requests)[len(runs) :], len(runs) + 1):
        ids = tok.encode_prompt(text)
        result = generate(session, ids, None, GenerationConfig(args.max_new_tokens, args.k))
        runs.append({"prompt_ids": ids, "output_ids": result.token_ids})
        left = (time.time() - started) / n * (args.requests - n)
        print(f"\rgreedy answers {n}/{args.requests}, ~{left:.0f} s left", end="", flush=True)
    print(f" ({time.time() - started:.0f} s)")
    if cached is not None:
        cached.write_text(json.dumps(runs))

    source = bundle.manifest.source or {}
    target = load_model(source.get("path") or "default")
    name = bundle.manifest.model_name
    head = load_heads(heads_file(name, args.heads), target.model, name).float()
    eager = EagerSession(target.model, 1024)
    step = eager_step_fn(head, target.model)
    for n, run in enumerate(runs, 1):
        run["hidden"] = prefill(eager, run["prompt_ids"] + run["output_ids"], 0, True).hidden
        print(f"\rhidden states {n}/{len(runs)}", end="", flush=True)
    print()

    def head_chain(run, i, k):
        p = len(run["prompt_ids"])
        context = run["prompt_ids"] + run["output_ids"][: i + 1]
        h, feed, chain = run["hidden"][p + i - 1 : p + i], context[-1], []
        for _ in range(k):
            logits, h = step(h, torch.tensor([feed]), 0)
            probs = torch.softmax(logits[0].double(), -1)
            best = int(probs.argmax())
            if probs[best] < args.floor:
                break
            chain.append(int(head.draft_ids[best]))
            feed = chain[-1]
        return chain

    def policies(store):
        def context(run, i):
            return run["prompt_ids"] + run["output_ids"][: i + 1]

        def bundle_policy(run, i, k):
            return lookup(context(run, i), k) or head_chain(run, i, k)

        def store_only(run, i, k):
            return lookup(context(run, i), k) or store.draft(context(run, i), k)

        def store_then_head(run, i, k):
            found = lookup(context(run, i), k) or store.draft(context(run, i), k)
            return found or head_chain(run, i, k)

        def head_then_store(run, i, k):
            found = lookup(context(run, i), k)
            if found:
                return found
            chain = head_chain(run, i, k)
            if len(chain) < k:
                chain = chain + store.draft(context(run, i) + chain, k - len(chain))
            return chain

        return {
            "lookup, then head (the bundle's)": bundle_policy,
            "lookup, then past requests": store_only,
            "lookup, then past requests, then head": store_then_head,
            "lookup, then head, past requests where it stops short (--adapt's)": head_then_store,
        }

    store = AnswerStore()
    names = list(policies(store))
    tallies = {name: [[0, 0], [0, 0]] for name in names}  # per half: steps, tokens
    half = len(runs) // 2
    for n, run in enumerate(runs):
        out = run["output_ids"]
        for name, propose in policies(store).items():
            tally = tallies[name][n >= half]
            i = 0
            while i < len(out) - 1:
                best = accepted(propose(run, i, args.k), out, i)
                tally[0] += 1
                tally[1] += best + 1
                i += best + 1
        store.add(run["prompt_ids"] + out, len(run["prompt_ids"]))
        print(f"\rsimulated {n + 1}/{len(runs)}", end="", flush=True)
    print()
    results = [
        {
            "policy": name,
            "first_half_tau": round(t[0][1] / t[0][0], 3),
            "last_half_tau": round(t[1][1] / t[1][0], 3),
        }
        for name, t in tallies.items()
    ]
    for r in results:
        print(json.dumps(r))
    command = "python benchmarks/stream_store_sim.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "policies": results}, indent=2))
    if args.markdown:
        lines = [
            f"# Drafting from past requests on a {len(runs)}-request stream, simulated "
            f"(k={args.k})",
            "",
            f"Greedy, {args.max_new_tokens} new tokens, bundle `{args.bundle}`; the store holds "
            "the requests before each one (prompt and answer).",
            "",
            f"| policy | tau, requests 1-{half} | tau, {half + 1}-{len(runs)} |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['policy']} | {r['first_half_tau']} | {r['last_half_tau']} |" for r in results
        ]
        lines += ["", f"Command: `{command}`", ""]
        Path(args.markdown).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
