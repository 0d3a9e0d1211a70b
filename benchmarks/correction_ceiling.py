"""How much can learning from a request stream's verified positions raise the first draft
token's acceptance, at best: a correction of the MTP head's output layer (what `--adapt` trains)
or the whole head?

Offline and teacher-forced: along the target's greedy answers to adapt_stream.py's stream, every
position gives a first-step pair (the head's input there, the target's hidden state and the next
token's embedding, and the token after it as the label). Each setting is fitted on the pairs of
requests 1-100 with as many steps as it asks for and scored on 101-200: the most any adapter
that learns online from the first 100 requests could reach. Kinds: low-rank (what --adapt uses),
full-rank (a whole new output layer: its product per draft step costs ~10x the low-rank one), a
bias, or `head` (every weight of the head: drafting then needs the new weights, which a
bundle's program does not take); `+soft` fits the target's distribution over the draft
vocabulary instead of its token.

    python benchmarks/correction_ceiling.py --bundle B --answers FILE [--reference HEADS]
        [--save HEADS_OUT] lowrank:32:3e-4:600 full:0:3e-4:600 head:0:3e-5:600 head+soft:0:1e-4:600

Settings are kind:rank:learning rate:steps (batches of 256, Adam). FILE is the greedy answers
stream_store_sim.py --answers keeps (the same stream, k-independent under greedy decoding).
--reference scores other heads (e.g. refined offline by mtp-train) on the same pairs; --save
writes the last `head` setting's heads, for stream_store_sim.py --heads to give their tau.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch
import torch.nn.functional as F

from mtp_edge.checkpoints import load_model
from mtp_edge.mtp import heads_file, load_heads, save_heads
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
    feats, logits, labels, request, hs, es, soft = [], [], [], [], [], [], []
    with torch.inference_mode():
        for n, run in enumerate(runs):
            seq = run["prompt_ids"] + run["output_ids"]
            hidden = prefill(eager, seq, 0, True).hidden
            origins = list(range(len(run["prompt_ids"]) - 1, len(seq) - 2))
            emb = target.model.embed_tokens(torch.tensor([seq[i + 1] for i in origins]))
            z, g = head.step(hidden[origins], emb, None)
            # the target's distribution over the draft vocabulary at each label's position
            target_p = torch.softmax(
                target.model.logits(hidden[[i + 1 for i in origins]])[:, head.draft_ids].float(), -1
            )
            f = head.final_norm(g)
            for j, i in enumerate(origins):
                if seq[i + 2] in index:
                    feats.append(f[j])
                    hs.append(hidden[i].float())
                    es.append(emb[j].float())
                    soft.append(target_p[j].half())
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
        head,
        torch.stack(hs),
        torch.stack(es),
        target.model,
        torch.stack(soft),
    )


def fit(kind, rank, lr, steps, f, z, y, h, e, head, p, seed=0):
    """Fit on the given pairs; returns the drafted logits as a function of (f, z, h, e)."""
    g = torch.Generator().manual_seed(seed)
    soft = kind.endswith("+soft")  # the target's distribution as the label, not its token
    kind = kind.removesuffix("+soft")
    vocab, dim = z.shape[1], f.shape[1]
    if kind == "lowrank":
        u = torch.zeros(vocab, rank, requires_grad=True)
        v = (torch.randn(rank, dim, generator=g) / math.sqrt(dim)).requires_grad_()
        params = [u, v]
        drafted = lambda f, z, h, e: z + f @ v.T @ u.T  # noqa: E731
    elif kind == "full":
        w = torch.zeros(vocab, dim, requires_grad=True)
        params = [w]
        drafted = lambda f, z, h, e: z + f @ w.T  # noqa: E731
    elif kind == "bias":
        b = torch.zeros(vocab, requires_grad=True)
        params = [b]
        drafted = lambda f, z, h, e: z + b  # noqa: E731
    elif kind == "head":  # every weight of the head: drafting then needs its new weights
        tuned = copy.deepcopy(head)
        params = list(tuned.parameters())
        drafted = lambda f, z, h, e: tuned.step(h, e, None)[0]  # noqa: E731
        drafted.head = tuned
    else:
        raise SystemExit(f"error: unknown kind {kind!r}: lowrank, full, bias or head")
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        rows = torch.randint(len(y), (256,), generator=g)
        label = p[rows].float() if soft else y[rows]
        loss = F.cross_entropy(drafted(f[rows], z[rows], h[rows], e[rows]), label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--answers", required=True)
    parser.add_argument(
        "--reference", action="append", default=[], help="other heads to score (e.g. refined)"
    )
    parser.add_argument(
        "--save", help="write the last head setting's heads here (stream_store_sim.py --heads)"
    )
    parser.add_argument("settings", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(2)
    f, z, y, r, head, h, e, model, p = pairs(args.bundle, args.answers)
    train, test = r < 100, r >= 100
    base = (z[test].argmax(-1) == y[test]).float().mean().item()
    print(f"pairs: {int(train.sum())} to fit, {int(test.sum())} to score")
    print(f"first-token acceptance, no correction: {base:.4f}")
    for path in args.reference:
        other = load_heads(path, model, head.config.target_name).float()
        with torch.no_grad():
            drafted = other.draft_ids[other.step(h[test], e[test], None)[0].argmax(-1)]
            hit = (drafted == head.draft_ids[y[test]]).float().mean()
        print(f"{path}: acceptance {hit:.4f} on requests 101-200")
    for setting in args.settings:
        kind, rank, lr, steps = setting.split(":")
        start = time.time()
        part = (f[train], z[train], y[train], h[train], e[train])
        drafted = fit(kind, int(rank), float(lr), int(steps), *part, head, p[train])
        with torch.no_grad():
            scored = drafted(f[test], z[test], h[test], e[test]).argmax(-1) == y[test]
            fitted = drafted(f[train], z[train], h[train], e[train]).argmax(-1) == y[train]
            scored, fitted = scored.float().mean(), fitted.float().mean()
        print(
            f"{setting}: acceptance {scored:.4f} on requests 101-200 ({scored - base:+.4f}), "
            f"{fitted:.4f} on the requests it was fitted on, {time.time() - start:.0f} s",
            flush=True,
        )
        if args.save and kind.startswith("head"):
            save_heads(drafted.head, head.config, args.save)


if __name__ == "__main__":
    main()
