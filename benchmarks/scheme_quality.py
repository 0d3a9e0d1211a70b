"""Perplexity of a model under each weight scheme the android export offers, measured on the
held-out text with the eager model quantized as the export quantizes it (torchao, while
loading): which schemes stay within +3% of float32, before spending an export on each.
The exported program's own perplexity (the manifest's quality report) agrees to ~0.5%
(SmolLM2-135M and Qwen2.5-Coder-0.5B, 8da8w).

    python benchmarks/scheme_quality.py [--model default|PATH] [--tokens 1024]
        [--schemes 8da8w:0,8da4w:0,8da4w:32,8da4w:64,8da4w:128] [--out PATH]

An entry QUANT:GROUP/HEAD:GROUP gives the LM head a scheme of its own (e.g. 8da4w:32/8da8w:0,
4-bit layers and an 8-bit head: with a tied embedding the head is a quarter of a 0.5B model);
a third part names linears of every layer kept in 8da8w per channel, as llama.cpp's Q4_K_M keeps
some in more bits (8da4w:32/8da8w:0/down_proj+v_proj).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torchao.quantization import quantize_

from mtp_edge.checkpoints import load_model, open_checkpoint
from mtp_edge.exporter.loading import eager_forward
from mtp_edge.quantize.quality import StreamedPerplexity, perplexity
from mtp_edge.quantize.schemes import QuantScheme, _linear_config, check_scheme, quantize_part
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
        layers, _, rest = entry.partition("/")
        head, _, eight = rest.partition("/")
        kept = set(filter(None, eight.split("+")))
        quant, group = layers.split(":")
        head_quant, head_group = head.split(":") if head else (None, None)
        scheme = QuantScheme(
            quant,
            int(group),
            args.embedding_quant,
            head=head_quant,
            head_group_size=None if head_group is None else int(head_group),
        )
        check_scheme(scheme, checkpoint.skeleton())
        started = time.perf_counter()

        def hook(m, name, part, scheme=scheme, kept=kept):
            if kept and name.startswith("layers"):
                quantize_(
                    part,
                    _linear_config("8da8w", 0),
                    lambda mod, fqn: (
                        isinstance(mod, torch.nn.Linear) and fqn.split(".")[-1] in kept
                    ),
                )
            quantize_part(m, name, part, scheme)

        model = load_model(args.model, on_part=hook).model
        value = perplexity(eager_forward(model, len(tokens) + 1), tokens, 128)
        label = f"{quant} " + ("per channel" if group == "0" else f"group {group}")
        if head_quant is not None:
            label += f", head {head_quant} " + (
                "per channel" if head_group == "0" else f"group {head_group}"
            )
        if kept:
            label += ", 8da8w " + " ".join(sorted(kept))
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
