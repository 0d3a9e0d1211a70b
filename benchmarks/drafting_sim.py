"""Drafting policies compared without running the loop: under greedy decoding, what a drafter
gets accepted is fixed by the target's greedy output, so a policy's tau can be computed exactly
from that output (and, for MTP heads, the target's hidden states along it).

1. The bundle decodes the built-in suite and held-out prompts of the training text greedily.
2. The eager fp32 target gives the hidden states along each output (teacher-forced).
3. Each policy drafts at every point the loop would reach; a draft's accepted length is its
   longest prefix that equals the greedy continuation; the loop then advances by that + 1.

Policies: prompt lookup (the bundle's 2-3 sizes), a datastore of the target's own written text
(an n-gram table, orders 1..4, over data/'s answers minus the held-out ones: REST-style
retrieval), the MTP head gated at a confidence floor (the bundle's policy) or not, the head
with the datastore filling in where the head is unsure, and trees: the head's top-B first
tokens, each continued by the head (B x depth draft tokens, one verify of B x depth + 1).

    python benchmarks/drafting_sim.py [--bundle DIR] [--heads FILE] [--data FILE.jsonl.gz]
        [--held-out 48] [--max-new-tokens 128] [--json OUT] [--markdown OUT]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from mtp_edge.checkpoints import load_model
from mtp_edge.devices.harness import load_prompts
from mtp_edge.mtp import load_heads
from mtp_edge.runtime.bundle import open_bundle, target_session
from mtp_edge.runtime.drafters import NgramDrafter
from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.mtp_drafter import eager_step_fn
from mtp_edge.runtime.session import EagerSession, prefill

ORDER = 4


LOOKUP = NgramDrafter(max_n=3, min_n=2)  # the bundle's lookup sizes


def lookup(context: list[int], k: int) -> list[int]:
    """Prompt lookup: the runtime's own NgramDrafter."""
    return LOOKUP.propose(context, None, k, None).tokens


class Datastore:
    """Most frequent next token after each 1..ORDER-token context of a token corpus."""

    def __init__(self, sequences: list[list[int]], min_total: int = 2):
        self.tables = []
        for n in range(1, ORDER + 1):
            counts: dict = defaultdict(lambda: defaultdict(int))
            for s in sequences:
                for j in range(n, len(s)):
                    counts[tuple(s[j - n : j])][s[j]] += 1
            table = {}
            for key, nexts in counts.items():
                total = sum(nexts.values())
                if total >= min_total:
                    best, count = max(nexts.items(), key=lambda kv: kv[1])
                    table[key] = (best, count / total)
            self.tables.append(table)

    def next(self, context: list[int], min_n: int = 1):
        for n in range(min(ORDER, len(context)), min_n - 1, -1):
            hit = self.tables[n - 1].get(tuple(context[-n:]))
            if hit:
                return hit
        return None

    def draft(self, context: list[int], k: int, min_p: float) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            hit = self.next(context + out, min_n=2)
            if hit is None or hit[1] < min_p:
                break
            out.append(hit[0])
        return out


def accepted(draft: list[int], output: list[int], i: int) -> int:
    a = 0
    while a < len(draft) and i + 1 + a < len(output) and draft[a] == output[i + 1 + a]:
        a += 1
    return a


def simulate(runs: list[dict], propose, k: int) -> dict:
    """propose(run, i, k) -> list of candidate drafts (a chain is one) at output index i."""
    steps = generated = 0
    by_position = [0] * k
    for run in runs:
        out, i = run["output_ids"], 0
        while i < len(out) - 1:
            best = max((accepted(d, out, i) for d in propose(run, i, k)), default=0)
            for j in range(min(best, k)):
                by_position[j] += 1
            steps += 1
            generated += best + 1
            i += best + 1
    return {
        "tau": round(generated / steps, 3),
        "acceptance_by_position": [round(a / steps, 3) for a in by_position],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", default="bundles/SmolLM2-135M-Instruct-android")
    parser.add_argument("--heads", default="mtp_edge/heads/SmolLM2-135M-Instruct.safetensors")
    parser.add_argument("--data", default="data/SmolLM2-135M-Instruct.written.jsonl.gz")
    parser.add_argument("--held-out", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    torch.set_num_threads(2)

    bundle = open_bundle(args.bundle)
    tok = bundle.tokenizer
    rows = [json.loads(line) for line in gzip.open(args.data, "rt")]
    # Every tenth pair is held out: its prompt is decoded, its text stays out of the datastore.
    held = [r["prompt"] for i, r in enumerate(rows) if i % 10 == 0][: args.held_out]
    corpus = [
        tok.encode_prompt(r["prompt"]) + tok.encode(r["response"]) + tok.eos_ids[:1]
        for i, r in enumerate(rows)
        if i % 10
    ]
    prompts = [(p.category, p.prompt) for p in load_prompts(None)]
    prompts += [("held-out", p) for p in held]

    started = time.time()
    session = target_session(bundle)
    runs = []
    for n, (category, text) in enumerate(prompts, 1):
        ids = tok.encode_prompt(text)
        result = generate(session, ids, None, GenerationConfig(args.max_new_tokens, args.k))
        runs.append({"category": category, "prompt_ids": ids, "output_ids": result.token_ids})
        print(f"\rgreedy outputs {n}/{len(prompts)}", end="", flush=True)
    print(f" ({time.time() - started:.0f} s)")

    target = load_model("default")
    head = load_heads(args.heads, target.model, target.name).to(torch.float32)
    eager = EagerSession(target.model, 1024)
    step = eager_step_fn(head, target.model)
    for run in runs:
        run["hidden"] = prefill(eager, run["prompt_ids"] + run["output_ids"], 0, True).hidden
    store = Datastore(corpus)
    print(f"datastore: {sum(map(len, corpus))} tokens, {sum(map(len, store.tables))} contexts")

    def head_chain(run, i, k, first=None, floor=0.0, fill=None):
        """The head's greedy chain from output index i; `first` forces its first token."""
        p = len(run["prompt_ids"])
        context = run["prompt_ids"] + run["output_ids"][: i + 1]
        h, feed, chain = run["hidden"][p + i - 1 : p + i], context[-1], []
        for j in range(k):
            logits, h = step(h, torch.tensor([feed]), 0)
            probs = torch.softmax(logits[0].double(), -1)
            best = int(probs.argmax())
            token = int(head.draft_ids[best]) if j or first is None else first
            if first is None and probs[best] < floor:
                hit = fill and store.next(context + chain, min_n=2)
                if not hit or hit[1] < fill:
                    break
                token = hit[0]
            chain.append(token)
            feed = token
        return chain

    def with_lookup(policy):
        def propose(run, i, k):
            found = lookup(run["prompt_ids"] + run["output_ids"][: i + 1], k)
            return [found] if found else policy(run, i, k)

        return propose

    def tree(branches, depth):
        def propose(run, i, k):
            p = len(run["prompt_ids"])
            context = run["prompt_ids"] + run["output_ids"][: i + 1]
            logits, _ = step(run["hidden"][p + i - 1 : p + i], torch.tensor([context[-1]]), 0)
            firsts = head.draft_ids[torch.topk(logits[0], branches).indices].tolist()
            return [head_chain(run, i, depth, first=f) for f in firsts]

        return propose

    def datastore_only(min_p):
        def propose(run, i, k):
            context = run["prompt_ids"] + run["output_ids"][: i + 1]
            return [store.draft(context, k, min_p)]

        return propose

    policies = {
        "lookup": with_lookup(lambda run, i, k: []),
        "lookup, then datastore (p >= .3)": with_lookup(datastore_only(0.3)),
        "lookup, then head >= .5 (the bundle's policy)": with_lookup(
            lambda run, i, k: [head_chain(run, i, k, floor=0.5)]
        ),
        "lookup, then head (no floor)": with_lookup(lambda run, i, k: [head_chain(run, i, k)]),
        "lookup, then head >= .5, datastore (p >= .3) below": with_lookup(
            lambda run, i, k: [head_chain(run, i, k, floor=0.5, fill=0.3)]
        ),
        "lookup, then tree 2 x 4 (8 draft tokens)": with_lookup(tree(2, 4)),
        "lookup, then tree 3 x 3 (9 draft tokens)": with_lookup(tree(3, 3)),
        "lookup, then tree 4 x 4 (16 draft tokens)": with_lookup(tree(4, 4)),
    }
    suite = [r for r in runs if r["category"] != "held-out"]
    held_runs = [r for r in runs if r["category"] == "held-out"]
    results = []
    for name, propose in policies.items():
        row = {
            "policy": name,
            "suite": simulate(suite, propose, args.k),
            "held_out": simulate(held_runs, propose, args.k),
        }
        print(json.dumps(row), flush=True)
        results.append(row)
    command = "python benchmarks/drafting_sim.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "policies": results}, indent=2))
    if args.markdown:
        lines = [
            f"# Drafting policies, greedy, simulated exactly on the target's output (k={args.k})",
            "",
            f"{len(suite)} suite prompts and {len(held_runs)} held-out prompts of the training "
            f"text, up to {args.max_new_tokens} new tokens each; bundle `{args.bundle}`, heads "
            f"`{args.heads}`.",
            "",
            "| policy | suite tau | suite acceptance by position | held-out tau |",
            "|---|---|---|---|",
        ]
        for r in results:
            by_position = " / ".join(f"{a:.2f}" for a in r["suite"]["acceptance_by_position"])
            lines.append(
                f"| {r['policy']} | {r['suite']['tau']} | {by_position} | {r['held_out']['tau']} |"
            )
        lines += ["", f"Command: `{command}`", ""]
        Path(args.markdown).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
