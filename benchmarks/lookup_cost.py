"""What prompt lookup costs per decoding step: the n-gram drafter's index (runtime/drafters.py)
against a full search of the context at every call (numpy, as the drafter searched until
2026-11-28), on text the default model wrote, at the context lengths a chat reaches. Each step
of the hybrid drafter (mtp+ngram) looks up twice: which source drafts, then the draft.

    python benchmarks/lookup_cost.py [--lengths 128,512,1024,2048] \\
        [--out results/drafting/lookup_cost]

The cost in decode steps comes from the plain decoding step times given (--decode-ms: NAME=MS,
this machine's plain tok/s turned into milliseconds per step).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np
from results_files import write_results

from mtp_edge.checkpoints import load_tokenizer
from mtp_edge.runtime.drafters import NgramDrafter

TEXT = Path(__file__).resolve().parents[1] / "data" / "SmolLM2-135M-Instruct.written.jsonl.gz"


def full_search(context: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The latest earlier occurrence of the last n tokens, by comparing every window."""
    tokens = np.asarray(context)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k].tolist()
    return []


def written_tokens(count: int) -> list[int]:
    """Requests and the default model's answers, one after another, as a long chat has them."""
    tokenizer, out = load_tokenizer("default"), []
    with gzip.open(TEXT, "rt") as f:
        for line in f:
            entry = json.loads(line)
            out += tokenizer.encode(entry["prompt"] + "\n" + entry["response"] + "\n")
            if len(out) >= count:
                break
    return out[:count]


def per_call_us(tokens: list[int], length: int, steps: int, index: bool) -> tuple[float, int]:
    """Microseconds per lookup while the context grows from `length` by `steps` tokens, and
    how many lookups found a draft."""
    drafter = NgramDrafter(max_n=3, min_n=1)
    context = list(tokens[:length])
    found, began = 0, time.perf_counter()
    for i in range(steps):
        context.append(tokens[length + i])
        for _ in range(2):  # which source drafts, then the draft itself
            draft = (
                drafter.propose(context, None, 4, None).tokens if index else full_search(context, 4)
            )
        found += bool(draft)
    return (time.perf_counter() - began) / (2 * steps) * 1e6, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,512,1024,2048")
    ap.add_argument("--steps", type=int, default=200, help="decoding steps timed per length")
    ap.add_argument(
        "--decode-ms",
        default="default=4.4,qwen05=13.5",
        help="NAME=MS per plain decoding step, to express the cost in decode steps",
    )
    ap.add_argument("--out", help="results path without extension (.json and .md)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    decode = {k: float(v) for k, v in (x.split("=") for x in args.decode_ms.split(","))}
    tokens = written_tokens(max(lengths) + args.steps + 1)
    rows = []
    for length in lengths:
        search, found_search = per_call_us(tokens, length, args.steps, index=False)
        index, found_index = per_call_us(tokens, length, args.steps, index=True)
        assert found_search == found_index  # the same drafts
        rows.append({"context": length, "search_us": search, "index_us": index})
        print(f"context {length}: full search {search:.1f} us, index {index:.1f} us per lookup")
    head = "| context tokens | full search, us/lookup | index, us/lookup |"
    head += "".join(f" search, % of a {n} step | index, % of a {n} step |" for n in decode)
    lines = [head, "|" + "---|" * (3 + 2 * len(decode))]
    for r in rows:
        line = f"| {r['context']} | {r['search_us']:.1f} | {r['index_us']:.1f} |"
        for ms in decode.values():  # two lookups per step
            line += (
                f" {200 * r['search_us'] / 1e3 / ms:.1f}% | {200 * r['index_us'] / 1e3 / ms:.2f}% |"
            )
        lines.append(line)
    print("\n".join(lines))
    if args.out:
        command = "python benchmarks/lookup_cost.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
        )
        write_results(args.out, {"decode_ms": decode, "rows": rows}, lines, command)


if __name__ == "__main__":
    main()
