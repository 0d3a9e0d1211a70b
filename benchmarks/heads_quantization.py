"""What quantizing MTP heads costs in acceptance, with nothing else changed: the exported target
of a bundle drafts with the head program the bundle carries (quantized with the target's linear
scheme) and then with the same heads in float32, eager, reading the same program's hidden
states. Greedy speculative decoding of the built-in suite, no confidence gate, no lookup, the
bundle's k: tau and acceptance per draft position for each, and whether their outputs agree
(both must equal plain decoding: only how many drafts are accepted may differ).

    python benchmarks/heads_quantization.py --bundle BUNDLE --heads HEADS.safetensors \\
        --model MODEL [--max-new-tokens 96] [--out results/training/heads_quantization]

Heads without attention only (a head reading the target's cache is a method of the target's
program and cannot be swapped for an eager one).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from results_files import write_results

from mtp_edge.checkpoints import load_model
from mtp_edge.devices.harness import load_prompts
from mtp_edge.mtp import load_heads
from mtp_edge.runtime.bundle import bundle_drafter, open_bundle, target_session
from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.mtp_drafter import MtpDrafter, eager_step_fn


def run(session, drafter, prompts, k, max_new, eos) -> tuple[dict, list[list[int]]]:
    """tau and acceptance per position over `prompts`, and the outputs."""
    drafted, accepted = [0] * k, [0] * k
    decoded = steps = 0
    outputs = []
    for prompt in prompts:
        config = GenerationConfig(max_new_tokens=max_new, k=k, eos_ids=tuple(eos))
        result = generate(session, prompt, drafter, config)
        stats = result.stats
        decoded += stats.decoded_tokens
        steps += stats.verify_steps
        for i in range(k):
            drafted[i] += stats.drafted_per_position[i]
            accepted[i] += stats.accepted_per_position[i]
        outputs.append(result.token_ids)
    measured = {
        "tau": round(decoded / steps, 4),
        "acceptance_per_position": [
            round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted, strict=True)
        ],
    }
    return measured, outputs


def run_arguments(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The options the scripts that run heads on a bundle share; parses them and sets the
    threads."""
    ap.add_argument("--model", default="default", help="the bundle's target (its embeddings)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="results path without extension (.json and .md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, help="an ExecuTorch bundle exported with --heads")
    ap.add_argument("--heads", required=True, help="the heads file the bundle was exported with")
    args = run_arguments(ap)
    bundle = open_bundle(args.bundle)
    m = bundle.manifest
    if m.drafter.kind != "mtp":
        raise SystemExit(f"error: {args.bundle} carries a {m.drafter.kind} drafter, not MTP heads")
    loaded = load_model(args.model)
    head = load_heads(args.heads, loaded.model, loaded.name).float().eval()
    if head.config.attention != "none":
        raise SystemExit("error: heads with attention live in the target's program: not swappable")
    session = target_session(bundle)
    k = m.drafter.k
    tokenizer = loaded.tokenizer
    suite = load_prompts(None)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}]))
        for p in suite
    ]
    quantized = bundle_drafter(bundle, 0.0)
    eager_head = MtpDrafter(eager_step_fn(head, loaded.model), head.draft_ids, m.vocab_size)
    results, outputs = {}, {}
    for name, drafter in (("exported (quantized)", quantized), ("float32, eager", eager_head)):
        began = time.perf_counter()
        results[name], outputs[name] = run(
            session, drafter, prompts, k, args.max_new_tokens, tokenizer.eos_ids
        )
        results[name]["seconds"] = round(time.perf_counter() - began, 1)
        print(name, json.dumps(results[name]), flush=True)
    first, second = outputs.values()
    same = sum(a == b for a, b in zip(first, second, strict=True))
    q, f = results["exported (quantized)"], results["float32, eager"]
    drop = 1 - (q["tau"] - 1) / (f["tau"] - 1) if f["tau"] > 1 else 0.0
    summary = {
        "bundle": Path(args.bundle).name,
        "heads": Path(args.heads).name,
        "quant": {role: f.quant for role, f in m.models.items() if getattr(f, "quant", None)},
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "k": k,
        "identical_outputs": same,
        "runs": results,
        "accepted_tokens_lost": round(drop, 4),
    }
    lines = [
        f"# Quantized heads against float32 heads, `{Path(args.bundle).name}`",
        "",
        f"Built-in suite ({len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy, "
        f"k={k}, no confidence gate, no lookup), the bundle's exported target for both.",
        "",
        "| heads | tau | acceptance per position |",
        "|---|---|---|",
        *(
            f"| {name} | {r['tau']:.3f} | "
            + " / ".join(f"{a:.3f}" for a in r["acceptance_per_position"])
            + " |"
            for name, r in results.items()
        ),
        "",
        f"Accepted draft tokens per step lost to quantization: {drop:.1%} (1 - (tau_q - 1) / "
        f"(tau_f - 1)); outputs identical between the two: {same}/{len(prompts)}.",
    ]
    print("\n".join(lines))
    if args.out:
        write_results(args.out, summary, lines)


if __name__ == "__main__":
    main()
