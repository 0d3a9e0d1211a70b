"""Write MTP heads with random weights for a model, shaped as mtp-train makes them (no attention,
one block, the target's intermediate size), reading only the model's embedding, final norm and
LM head: what a heads update costs depends on the heads' and the model's shapes, not on how
well the heads draft, so a model of a published shape (benchmarks/shaped_model.py) gets heads
without a training run.

    python benchmarks/random_heads.py -m /tmp/smollm2-1.7b-shaped --seed 0 --out /tmp/h0.safetensors
"""

from __future__ import annotations

import argparse

import torch

from mtp_edge.checkpoints import open_checkpoint
from mtp_edge.exporter.update_heads import target_parts
from mtp_edge.mtp import MTPConfig, MTPHead, init_from_target, save_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True, help="an HF directory or a .gguf file")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checkpoint = open_checkpoint(args.model)
    target, target_hash = target_parts(checkpoint)
    c = checkpoint.config
    config = MTPConfig(
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        args.draft_vocab,
        rms_norm_eps=c.rms_norm_eps,
        target_name=checkpoint.name,
        target_hash=target_hash,
        recipe={"random": True, "seed": args.seed},
    )
    torch.manual_seed(args.seed)
    head = MTPHead(config)
    init_from_target(head, target, torch.arange(args.draft_vocab))
    save_heads(head, config, args.out)
    print(f"{args.out}: {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
