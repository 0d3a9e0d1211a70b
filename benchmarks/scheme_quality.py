"""Perplexity of a model under each weight scheme the android export offers, measured on the
held-out text with the eager model quantized as the export quantizes it (torchao, while
loading): which schemes stay within +3% of float32, before spending an export on each.
The exported program's own perplexity (the manifest's quality report) agrees to ~0.5%
(SmolLM2-135M and Qwen2.5-Coder-0.5B, 8da8w).

    python benchmarks/scheme_quality.py [--model default|PATH] [--tokens 1024]
        [--schemes 8da8w:0,8da4w:0,8da4w:32,8da4w:64,8da4w:128] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mtp_edge.checkpoints import load_model, open_checkpoint
from mtp_edge.exporter.executorch import load_hook
from mtp_edge.exporter.loading import eager_forward
from mtp_edge.exporter.platform import ExportOptions
from mtp_edge.quantize.quality import StreamedPerplexity, perplexity
from mtp_edge.texts import heldout_text

RESULTS = "benchmarks/results/formats/scheme_quality"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--schemes", default="8da8w:0,8da4w:0,8da4w:32,8da4w:64,8da4w:128")
    parser.add_argument("--embedding-quant", default="8w")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = open_checkpoint(args.model)
    tokens = checkpoint.tokenizer.encode(heldout_text())[: args.tokens]
    reference = StreamedPerplexity(checkpoint.config, tokens)
    load_model(args.model, on_part=lambda model, name, part: reference.feed(name, part))
    tied = "lm_head.weight" not in checkpoint.readers
    fp32 = reference.finish(checkpoint.tensor("embed_tokens.weight") if tied else None)
    rows = [{"scheme": "fp32", "perplexity": round(fp32, 4), "ratio": 1.0}]
    print(json.dumps(rows[0]), flush=True)
    for entry in args.schemes.split(","):
        quant, group = entry.split(":")
        options = ExportOptions(
            model=args.model,
            quant=quant,
            group_size=int(group),
            embedding_quant=args.embedding_quant,
        )
        started = time.perf_counter()
        hook = load_hook(options, checkpoint.skeleton())
        model = load_model(args.model, on_part=hook).model
        value = perplexity(eager_forward(model, len(tokens) + 1), tokens, 128)
        label = f"{quant} " + ("per channel" if group == "0" else f"group {group}")
        row = {"scheme": label, "perplexity": round(value, 4), "ratio": round(value / fp32, 4)}
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
    command = "python benchmarks/scheme_quality.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    with open(args.out + ".json", "w") as f:
        json.dump({"model": checkpoint.name, "rows": rows, "command": command}, f, indent=1)
    lines = [
        f"# Perplexity by weight scheme: {checkpoint.name}, {len(tokens)} held-out tokens, "
        f"embedding {args.embedding_quant}, eager torchao",
        "",
        "| scheme | perplexity | x fp32 |",
        "|---|---|---|",
        *(f"| {r['scheme']} | {r['perplexity']} | {r['ratio']} |" for r in rows),
        "",
        f"Command: `{command}`",
        "",
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
