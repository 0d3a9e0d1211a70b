"""How on-policy is text from mtp-train's eager writers? The share of written tokens that an
exported target would itself have chosen greedily (teacher-forced over the text).

    python benchmarks/writer_agreement.py --bundle bundles/SmolLM2-135M-Instruct-android \
        --prompts data/SmolLM2-135M-Instruct.written.jsonl.gz --count 32 --max-new 96
"""

from __future__ import annotations

import argparse
import gzip
import json
import random

import torch

from mtp_edge import train
from mtp_edge.checkpoints import load_model
from mtp_edge.runtime.bundle import open_bundle, target_session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, help="ExecuTorch bundle exported with --drafter mtp")
    ap.add_argument("--model", default="default", help="the bundle's target, eager")
    ap.add_argument("--prompts", required=True, help=".jsonl[.gz] of {prompt, ...}")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    opener = gzip.open if args.prompts.endswith(".gz") else open
    with opener(args.prompts, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    random.Random(0).shuffle(texts)
    loaded = load_model(args.model)
    prompts = [loaded.tokenizer.encode_prompt(t) for t in texts[: args.count]]
    int8 = train.int8_writer(loaded.model)
    int8_fp32_head = train.int8_writer(loaded.model)
    if loaded.model.lm_head is None:
        int8_fp32_head.lm_head = None  # the tied fp32 head
    session = target_session(open_bundle(args.bundle))
    writers = [("int8", int8), ("int8, fp32 LM head", int8_fp32_head), ("fp32", loaded.model)]
    for name, model in writers:
        outs = train.generate_batch(model, prompts, args.max_new, loaded.tokenizer.eos_ids)
        seqs = [train.Sequence(p + o, len(p) - 1) for p, o in zip(prompts, outs, strict=True) if o]
        labels = train.label_with_session(session, seqs)
        same = total = 0
        for (offset, length, _), s in zip(labels.bounds.tolist(), seqs, strict=True):
            for i in range(s.start, length - 1):
                same += int(labels.argmax[offset + i]) == s.tokens[i + 1]
                total += 1
        print(f"{name}: {same / total:.4f} of {total} written tokens are the bundle's argmax")


if __name__ == "__main__":
    main()
