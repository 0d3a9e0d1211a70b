"""How much can a learned correction of the MTP head's output layer (what `--adapt` trains)
raise the first draft token's acceptance on a request stream, at best?

Offline and teacher-forced: along the target's greedy answers to adapt_stream.py's stream, every
position gives a first-step pair (the head's features from the target's hidden state and the
next token, the token after it as the label). A correction is fitted on the pairs of requests
1-100 and scored on 101-200, for each setting given: low-rank (what --adapt uses), full-rank
(a whole new output layer: its product per draft step costs ~10x the low-rank one) or a bias.

    python benchmarks/correction_ceiling.py --bundle B --answers FILE \\
        lowrank:32:3e-4:600 lowrank:32:1e-3:600 full:0:3e-4:600 bias:0:1e-2:600

Settings are kind:rank:learning rate:steps (batches of 256, Adam). FILE is the greedy answers
stream_store_sim.py --answers keeps (the same stream, k-independent under greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from mtp_edge.checkpoints import load_model
from mtp_edge.mtp import heads_file, load_heads
from mtp_edge.runtime.bundle import open_bundle
from mtp_edge.runtime.session import EagerSession, prefill


def pairs(bundle_dir: str, answers: str):
    bundle = open_bundle(bundle_dir)
    runs = json.loads(open(answers).read())
    target = load_model((bundle.manifest.source or {}).get("path") or "default")
    name = bundle.manifest.model_name
    head = load_heads(heads_file(name, None), target.model, name).float()
    eager = EagerSession(target.model, 1024)
    index = {int(t): i for i, t in enumerate(head.draft_ids.tolist())}
    feats, logits, labels, request = [], [], [], []
    with torch.inference_mode():
        for n, run in enumerate(runs):
            seq = run["prompt_ids"] + run["output_ids"]
            hidden = prefill(eager, seq, 0, True).hidden
            origins = list(range(len(run["prompt_ids"]) - 1, len(seq) - 2))
            emb = target.model.embed_tokens(torch.tensor([seq[i + 1] for i in origins]))
            z, g = head.step(hidden[origins], emb, None)
            f = head.final_norm(g)
            for j, i in enumerate(origins):
                if seq[i + 2] in index:
                    feats.append(f[j])
                    logits.append(z[j])
                    labels.append(index[seq[i + 2]])
                    request.append(n)
            print(f"\rpairs from request {n + 1}/{len(runs)}", end="", flush=True)
    print()
    return (
        torch.stack(feats),
        torch.stack(logits),
        torch.tensor(labels),
        torch.tensor(request),
    )


def fit(kind, rank, lr, steps, f, z, y, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab, dim = z.shape[1], f.shape[1]
    if kind == "lowrank":
        u = torch.zeros(vocab, rank, requires_grad=True)
        v = (torch.randn(rank, dim, generator=g) / math.sqrt(dim)).requires_grad_()
        params, correction = [u, v], lambda x: x @ v.T @ u.T
    elif kind == "full":
        w = torch.zeros(vocab, dim, requires_grad=True)
        params, correction = [w], lambda x: x @ w.T
    elif kind == "bias":
        b = torch.zeros(vocab, requires_grad=True)
        params, correction = [b], lambda x: b.expand(x.shape[0], -1)
    else:
        raise SystemExit(f"error: unknown kind {kind!r}: lowrank, full or bias")
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        rows = torch.randint(len(y), (256,), generator=g)
        loss = F.cross_entropy(z[rows] + correction(f[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return correction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--answers", required=True)
    parser.add_argument("settings", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(2)
    f, z, y, r = pairs(args.bundle, args.answers)
    train, test = r < 100, r >= 100
    base = (z[test].argmax(-1) == y[test]).float().mean().item()
    print(f"pairs: {int(train.sum())} to fit, {int(test.sum())} to score")
    print(f"first-token acceptance, no correction: {base:.4f}")
    for setting in args.settings:
        kind, rank, lr, steps = setting.split(":")
        start = time.time()
        correction = fit(kind, int(rank), float(lr), int(steps), f[train], z[train], y[train])
        with torch.no_grad():
            scored = ((z[test] + correction(f[test])).argmax(-1) == y[test]).float().mean()
            fitted = ((z[train] + correction(f[train])).argmax(-1) == y[train]).float().mean()
        print(
            f"{setting}: acceptance {scored:.4f} on requests 101-200 ({scored - base:+.4f}), "
            f"{fitted:.4f} on the requests it was fitted on, {time.time() - start:.0f} s"
        )


if __name__ == "__main__":
    main()
