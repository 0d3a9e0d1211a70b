"""verify(k+1) / decode(1) of a bundle's target, steady state: the same call repeated, as in
speculative decoding where verifications follow each other (scheme_table.py instead alternates
widths and methods every call, which costs more: see benchmarks/README.md).

    python benchmarks/verify_cost.py [--bundle DIR] [--threads 2] [--repeats 60]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mtp_edge.runtime.bundle import open_bundle, target_session
from mtp_edge.runtime.session import prefill

RESULTS = "benchmarks/results/verify_cost"


def timed(fn, repeats: int) -> float:
    """Median ms of `repeats` calls after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="bundles/SmolLM2-135M-Instruct-android")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundle = open_bundle(args.bundle)
    session = target_session(bundle)
    width = bundle.manifest.drafter.get("k", 4) + 1
    position = 64
    prefill(session, list(range(100, 100 + position)))
    tokens = list(range(5, 5 + width))
    decode = timed(lambda: session.forward(tokens[:1], position), args.repeats)
    verify = timed(lambda: session.forward(tokens, position), args.repeats)
    batched = timed(
        lambda: session.method.execute([torch.tensor([tokens]), torch.tensor([position])]),
        args.repeats,
    )
    report = {
        "bundle": args.bundle,
        "threads": args.threads,
        "position": position,
        "decode_ms": round(decode, 3),
        "verify_ms": round(verify, 3),
        "verify_over_decode": round(verify / decode, 3),
        "batched_forward_ms": round(batched, 3),
        "batched_over_decode": round(batched / decode, 3),
        "command": f"python benchmarks/verify_cost.py --bundle {args.bundle} "
        f"--threads {args.threads} --repeats {args.repeats}",
    }
    with open(RESULTS + ".json", "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
