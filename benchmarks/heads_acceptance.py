"""Acceptance of MTP heads files on the eager fp32 default target, by greedy speculative decoding
of suite prompts (one per category by default), and the eager cost of a draft step against a
target step: a quick way to compare heads before exporting.

    python benchmarks/heads_acceptance.py HEADS.safetensors [HEADS ...] [--per-category 1]
        [--max-new-tokens 48] [--k 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mtp_edge.checkpoints import load_model
from mtp_edge.devices.acceptance import measure_acceptance
from mtp_edge.devices.harness import load_prompts
from mtp_edge.mtp import load_heads
from mtp_edge.runtime.mtp_drafter import eager_step_fn, measure_step_cost, mtp_drafter
from mtp_edge.runtime.session import EagerSession


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("heads", nargs="+")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    target = load_model("default")
    taken: dict[str, int] = {}
    prompts = []
    for p in load_prompts(None):
        if taken.get(p.category, 0) < args.per_category:
            taken[p.category] = taken.get(p.category, 0) + 1
            chat = [{"role": "user", "content": p.prompt}]
            prompts.append(target.tokenizer.encode(target.tokenizer.apply_chat_template(chat)))
    results = []
    for path in args.heads:
        head = load_heads(path, target.model, target.name).to(torch.float32)
        session = EagerSession(target.model, 1024)
        d = target.config.hidden_size
        cost = measure_step_cost(eager_step_fn(head, target.model), session, d)
        drafter = mtp_drafter(head, target.model)
        measured = measure_acceptance(session, drafter, prompts, args.k, args.max_new_tokens)
        result = {"heads": str(path), "attention": head.config.attention, **measured}
        result["eager_step_cost"] = {k: round(v, 3) for k, v in cost.items()}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": len(prompts), "runs": results}, indent=2))


if __name__ == "__main__":
    main()
