"""How long `mtp-export --update-heads` takes, by stage, on a real bundle, and what the stages that
grow with the model come to at a larger shape.

The update has four stages (exporter/update_heads.py, the manifest's export_log.heads_update):
checking the bundle (hashing its files: the size of the target program, unless the verified-once
stamp spares it), reading the heads and the target's embedding table from the source checkpoint
(vocabulary x hidden), exporting the head (its own weights plus a quantized copy of the
embedding table), and writing the bundle (hard links, and hashing the new drafter program).
The script runs the update on `--bundle`, then exports a head of `--shape` (random weights:
the time depends on the shapes only) the way the update does, and scales the two stages it
does not run there (hashing, reading the table) from the bundle's by the bytes they touch.

    python benchmarks/update_heads_time.py --bundle B --heads H.safetensors --shape qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mtp_edge.config import ModelConfig
from mtp_edge.exporter.executorch import export_mtp_program
from mtp_edge.exporter.update_heads import update_heads
from mtp_edge.manifest import Manifest, sha256
from mtp_edge.memory import program_gb
from mtp_edge.mtp import MTPConfig, MTPHead
from mtp_edge.quantize.schemes import QuantScheme

# hidden, intermediate, vocabulary, layers, heads, kv heads of published models
SHAPES = {
    "qwen2.5-1.5b": (1536, 8960, 151936, 28, 12, 2),
    "smollm2-1.7b": (2048, 8192, 49152, 24, 32, 32),
}


def export_cpu(d: int, inter: int, vocab: int, draft_vocab: int, scheme: QuantScheme):
    """(wall seconds, CPU seconds, program bytes) of exporting a random head of these shapes
    as the update does (executorch.export_mtp_program)."""
    torch.manual_seed(0)
    head = MTPHead(MTPConfig(d, inter, vocab, draft_vocab)).eval()
    embedding = nn.Embedding(vocab, d)
    nn.init.normal_(embedding.weight, std=0.02)
    with tempfile.TemporaryDirectory() as tmp:
        t, cpu = time.perf_counter(), time.process_time()
        export_mtp_program(head, embedding, Path(tmp) / "drafter.pte", scheme, print)
        wall, used = time.perf_counter() - t, time.process_time() - cpu
        return wall, used, (Path(tmp) / "drafter.pte").stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", required=True, help="an android bundle with MTP heads")
    parser.add_argument("--heads", required=True, help="heads for its model")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        started, cpu = time.perf_counter(), time.process_time()
        _, manifest = update_heads(args.bundle, args.heads, Path(tmp) / "b", progress=print)
        total, total_cpu = time.perf_counter() - started, time.process_time() - cpu
        stages = {
            row["stage"]: row["seconds"] for row in manifest.export_log["heads_update"]["stages"]
        }
        target_bytes = (Path(args.bundle) / manifest.models["target"].file).stat().st_size
        small_drafter = (Path(tmp) / "b" / manifest.models["drafter"].file).stat().st_size
        t = time.perf_counter()
        sha256(Path(args.bundle) / manifest.models["target"].file)
        hash_rate = target_bytes / (time.perf_counter() - t)
        small = Manifest.load(args.bundle, verify=False)
    print(
        json.dumps(
            {
                "bundle": args.bundle,
                "seconds": round(total, 1),
                "cpu_seconds": round(total_cpu, 1),
                "stages_s": stages,
            }
        )
    )

    d, inter, vocab, layers, heads, kv = SHAPES[args.shape]
    config = ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=d, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=d // heads,
    )  # fmt: skip
    q = small.models["drafter"].quant
    scheme = QuantScheme(q["scheme"], q["group_size"], q["embedding"])
    with safe_open(args.heads, "pt") as f:  # the heads' own shapes, from their metadata
        own = json.loads(f.metadata()["mtp_config"])
    small_cpu = export_cpu(
        own["hidden_size"], own["intermediate_size"], own["vocab_size"], own["draft_vocab_size"],
        scheme,
    )[1]  # fmt: skip
    export_s, big_cpu, big_drafter = export_cpu(d, inter, vocab, args.draft_vocab, scheme)
    table = vocab * d / (small.vocab_size * small.drafter.hidden_size)
    program = program_gb(config, q["scheme"], q["group_size"], q["embedding"]) * 1e9
    estimate = {
        "check the bundle": program / hash_rate,
        "read the heads and the target's embedding": stages[
            "read the heads and the target's embedding"
        ]
        * table,
        "export the heads": export_s,
        # links cost the same at any size; the new drafter program is hashed
        "write the bundle": stages["write the bundle"] + (big_drafter - small_drafter) / hash_rate,
    }
    print(
        json.dumps(
            {
                "shape": args.shape,
                "hash_mb_per_s": round(hash_rate / 1e6),
                "target_program_gb": round(program / 1e9, 2),
                "embedding_scale": round(table, 2),
                "drafter_mb": round(big_drafter / 1e6),
                "stages_s": {k: round(v, 1) for k, v in estimate.items()},
                "total_s": round(sum(estimate.values()), 1),
                "export_cpu_seconds": {
                    "bundle's shape": round(small_cpu, 1),
                    args.shape: round(big_cpu, 1),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
