"""Does the MTP head need more than the target's last hidden state? A probe for tau >= 3.

EAGLE-3 feeds its drafter a fusion of low, middle and high layer states instead of the last
one. This probe asks whether that would lift our first draft position on SmolLM2-135M before
anyone builds it through every exporter: it trains the first draft step only (predict the
target's argmax at t+1 from features at t and the embedding of the token at t+1) with the
shipped head's shape (proj -> one SwiGLU block -> final norm -> 8192-token draft vocabulary,
started from the target's LM head rows), once on the final hidden state and once on residual
outputs of several layers, and prints held-out and training accuracy as it goes.

    python benchmarks/head_features.py LAYERS SEQUENCES STEPS [GEN_JSONL [TRAIN_SEQUENCES]]
        [--variants base,mlp-init,dropout,weight-decay,frozen-head] [--requests REQUESTS_JSONL]

LAYERS: comma-separated layer counts whose outputs are the features (the last layer's count
means the final-normed state the LM head reads, what the shipped head gets). SEQUENCES:
how many sequences of the generated-text cache `mtp-train` writes (`<out>.gen.jsonl`: prompts
and the target's own greedy answers) to use, a twelfth of them held out; origins are the
answer positions. TRAIN_SEQUENCES trains on only that many of the rest (same held-out set), to
see how accuracy grows with text. Labelling runs the eager fp32 target (~7 minutes for 230k
tokens here).

--variants trains one head per variant on the same labelled text (labelling runs once): `base`
is the shipped recipe; `mlp-init` starts the head's SwiGLU block (and its norm) from the
target's last layer's MLP instead of random weights; `dropout` drops 20% of the head's
normalised inputs while training; `weight-decay` uses AdamW's decay 0.1; `frozen-head` keeps the
draft LM head at the target's rows. --requests names the `<out>.requests.jsonl` of requests the
target wrote itself (`mtp-train --self-prompt-tokens`): answers to those are then never
trained on and are scored separately ("self" accuracy), a test on requests of another kind than
the templates the head learned from.

Recorded (`results/training/head_features_*.log`): 900 sequences, 1000 steps of 1024 origins.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from mtp_edge.checkpoints import load_model
from mtp_edge.mtp import SwiGLU
from mtp_edge.train import draft_vocabulary

DRAFT_VOCAB = 8192


class Head(nn.Module):
    def __init__(
        self,
        parts: int,
        dim: int,
        lm_rows: torch.Tensor,
        final_norm: torch.Tensor,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.dim = dim
        self.dropout = dropout
        self.feature_norms = nn.ModuleList(nn.RMSNorm(dim, eps=1e-5) for _ in range(parts))
        self.embedding_norm = nn.RMSNorm(dim, eps=1e-5)
        self.proj = nn.Linear((parts + 1) * dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.mlp = SwiGLU(dim, 1536)
        self.final_norm = nn.RMSNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, len(lm_rows), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_rows)
            self.final_norm.weight.copy_(final_norm)

    def forward(self, features, embeddings):
        parts = features.float().split(self.dim, -1)
        normed = [n(p) for n, p in zip(self.feature_norms, parts, strict=True)]
        inputs = torch.cat(normed + [self.embedding_norm(embeddings)], -1)
        x = self.proj(F.dropout(inputs, self.dropout, self.training))
        x = x + self.mlp(self.norm(x))
        return self.lm_head(self.final_norm(x))


VARIANTS = ("base", "mlp-init", "dropout", "weight-decay", "frozen-head")


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("layers", type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("sequences", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("gen", nargs="?", default="SmolLM2-135M-Instruct.gen.jsonl")
    parser.add_argument("train_sequences", nargs="?", type=int, default=None)
    parser.add_argument("--variants", default="base", type=lambda v: v.split(","))
    parser.add_argument("--requests", default=None)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str]) -> None:
    args = arguments(argv)
    layers, steps = args.layers, args.steps
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(2)
    model = load_model("default").model
    rows = [json.loads(line) for line in open(args.gen)]
    random.shuffle(rows)
    asked = set()
    if args.requests:
        asked = {json.loads(line)["request"] for line in open(args.requests)}
    own = [r for r in rows if r["prompt"] in asked]
    rows = [r for r in rows if r["prompt"] not in asked][: args.sequences]
    n_held = max(1, len(rows) // 12)
    own = own[:n_held]
    model.setup_cache(1024)
    kept: dict[int, torch.Tensor] = {}
    for i in layers:
        if i < len(model.layers):
            model.layers[i - 1].register_forward_hook(
                lambda m, a, out, i=i: kept.__setitem__(i, out)
            )
    feats, argmax, tokens, starts, lengths = [], [], [], [], []
    began = time.time()
    with torch.inference_mode():
        for r in rows + own:
            ids = (r["prompt_ids"] + r["response_ids"])[:1024]
            n = len(ids)
            logits, h = model(torch.tensor([ids]), torch.tensor([0]), return_hidden=True, kv_len=n)
            parts = [kept[i][0] if i < len(model.layers) else h[0] for i in layers]
            feats.append(torch.cat(parts, -1).half())
            argmax.append(logits[0].argmax(-1))
            tokens.append(torch.tensor(ids))
            starts.append(len(r["prompt_ids"]))
            lengths.append(n)
    print("labelled", sum(lengths), "tokens in", round(time.time() - began), "s", flush=True)
    # Origin t (an answer position) reads features at t and the token at t+1, and is right when
    # it names the target's argmax at t+1.
    offset, origins = 0, []
    for n, s in zip(lengths, starts, strict=True):
        origins.append(torch.arange(offset + max(s - 1, 0), offset + n - 2))
        offset += n
    features, argmax, tokens = torch.cat(feats), torch.cat(argmax), torch.cat(tokens)
    ours = origins[len(rows) :]
    origins = origins[: len(rows)]
    rest = origins[n_held:]
    if args.train_sequences is not None:
        rest = rest[: args.train_sequences]
    held, train = torch.cat(origins[:n_held]), torch.cat(rest)
    self_held = torch.cat(ours) if ours else None
    print(
        "train origins",
        len(train),
        "held",
        len(held),
        "self-written requests",
        0 if self_held is None else len(self_held),
        flush=True,
    )
    vocab = model.embed_tokens.weight.shape[0]
    counts = torch.bincount(argmax[train + 1], minlength=vocab)
    ids, _ = draft_vocabulary(counts, DRAFT_VOCAB)
    to_draft = torch.full((vocab,), -100, dtype=torch.long)
    to_draft[ids] = torch.arange(DRAFT_VOCAB)
    embedding = model.embed_tokens.weight.detach()
    for variant in args.variants:
        torch.manual_seed(0)
        head = Head(
            len(layers),
            embedding.shape[1],
            embedding[ids],
            model.norm.weight.detach(),
            dropout=0.2 if variant == "dropout" else 0.0,
        )
        if variant == "mlp-init":
            last = model.layers[-1]
            head.mlp.load_state_dict(last.mlp.state_dict())
            with torch.no_grad():
                head.norm.weight.copy_(last.post_attention_layernorm.weight)
        if variant == "frozen-head":
            head.lm_head.weight.requires_grad_(False)
        trainable = [p for p in head.parameters() if p.requires_grad]
        decay = 0.1 if variant == "weight-decay" else 0.0
        optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=decay)
        print(f"variant {variant}", flush=True)
        train_head(head, optimizer, steps, features, tokens, argmax, ids, to_draft, embedding,
                   train, held, self_held)  # fmt: skip


def train_head(head, optimizer, steps, features, tokens, argmax, ids, to_draft, embedding,
               train, held, self_held) -> None:  # fmt: skip
    @torch.no_grad()
    def accuracy(idx: torch.Tensor) -> float:
        head.eval()
        hits = 0
        for chunk in idx.split(4096):
            guess = head(features[chunk], embedding[tokens[chunk + 1]]).argmax(-1)
            hits += int((ids[guess] == argmax[chunk + 1]).sum())
        head.train()
        return hits / len(idx)

    began = time.time()
    for step in range(steps + 1):
        if step % 250 == 0 or step == steps:
            sample = train[torch.randperm(len(train))[:8000]]
            own = "" if self_held is None else f" self acc {accuracy(self_held):.3f}"
            print(
                f"step {step} held acc {accuracy(held):.3f}{own} train-sample acc "
                f"{accuracy(sample):.3f} {time.time() - began:.0f}s",
                flush=True,
            )
        if step == steps:
            break
        warm = min(1, (step + 1) / 50)
        lr = 1e-3 * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(3.14159 * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = train[torch.randint(len(train), (1024,))]
        logits = head(features[batch], embedding[tokens[batch + 1]])
        loss = F.cross_entropy(logits, to_draft[argmax[batch + 1]], ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main(sys.argv[1:])
