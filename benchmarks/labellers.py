"""Who should label mtp-train's text? Each labeller's rate (tokens/s over the same sequences, one
sequence per call as mtp-train labels) and how its labels agree with the others': the argmax and
the hidden state at every draft origin (relative error per position, averaged). The exported
bundle is what the heads will draft for; the fp32 target is the model as loaded; int8 is
mtp-train's int8 copy of it (--labeller int8).

    python benchmarks/labellers.py --model MODEL.gguf --bundle BUNDLE \\
        --text heads.gen.jsonl [--count 24] [--skip 500] [--out results/training/labellers]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from results_files import write_results

from mtp_edge import train
from mtp_edge.checkpoints import load_model

KINDS = ("fp32", "int8", "bundle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="the target, as mtp-train loads it")
    ap.add_argument("--bundle", required=True, help="an ExecuTorch bundle of it (--drafter mtp)")
    ap.add_argument("--text", required=True, help="a <heads>.gen.jsonl mtp-train wrote")
    ap.add_argument("--count", type=int, default=24, help="sequences labelled")
    ap.add_argument("--skip", type=int, default=500, help="sequences of the file skipped first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="results path without extension (.json and .md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model = loaded.model.requires_grad_(False)
    entries = [json.loads(line) for line in Path(args.text).read_text().splitlines()]
    entries = [e for e in entries if e.get("response_ids")][args.skip : args.skip + args.count]
    sequences = [
        train.Sequence(e["prompt_ids"] + e["response_ids"], len(e["prompt_ids"]) - 1)
        for e in entries
    ]
    tokens = sum(len(s.tokens) for s in sequences)
    session, _ = train.open_target_bundle(args.bundle, loaded)
    int8 = train.int8_writer(model)
    labellers = {
        "fp32": lambda seqs: train.label_sequences(model, seqs),
        "int8": lambda seqs: train.label_sequences(int8, seqs),
        "bundle": lambda seqs: train.label_with_session(session, seqs),
    }
    labels, rates = {}, {}
    for kind in KINDS:
        labellers[kind](sequences[:1])  # warm-up (caches sized, kernels loaded)
        began = time.perf_counter()
        labels[kind] = labellers[kind](sequences)
        rates[kind] = tokens / (time.perf_counter() - began)
        print(f"{kind}: {rates[kind]:.0f} tokens/s", flush=True)
    pairs = []
    for a, b in (("int8", "fp32"), ("bundle", "fp32"), ("int8", "bundle")):
        origins = labels[a].starts
        ha, hb = labels[a].hidden[origins].float(), labels[b].hidden[origins].float()
        pairs.append(
            {
                "labeller": a,
                "against": b,
                "argmax_agreement": float((labels[a].argmax[origins] == labels[b].argmax[origins])
                                          .float().mean()),
                "hidden_relative_error": float(((ha - hb).norm(dim=-1) / hb.norm(dim=-1)).mean()),
            }
        )  # fmt: skip
    origins = len(labels["fp32"].starts)
    result = {
        "model": loaded.name,
        "bundle": Path(args.bundle).name,
        "sequences": len(sequences),
        "tokens": tokens,
        "origins": origins,
        "threads": args.threads,
        "tokens_per_s": rates,
        "agreement": pairs,
    }
    lines = [
        f"# Labellers of {loaded.name}'s text",
        "",
        f"{len(sequences)} sequences of `{Path(args.text).name}`, {tokens} tokens "
        f"({origins} draft origins), {args.threads} threads; bundle `{Path(args.bundle).name}`.",
        "",
        "| labeller | tokens/s | vs fp32 |",
        "|---|---|---|",
        *(f"| {k} | {rates[k]:.0f} | {rates[k] / rates['fp32']:.2f}x |" for k in KINDS),
        "",
        "| labels of | against | argmax agreement | hidden state, relative error |",
        "|---|---|---|---|",
        *(
            f"| {p['labeller']} | {p['against']} | {p['argmax_agreement']:.4f} | "
            f"{p['hidden_relative_error']:.4f} |"
            for p in pairs
        ),
    ]
    print("\n".join(lines[4:]))
    if args.out:
        write_results(args.out, result, lines)


if __name__ == "__main__":
    main()
