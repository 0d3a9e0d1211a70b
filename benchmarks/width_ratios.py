"""forward(T) / forward(1) of one or more target programs, measured interleaved in one process,
so that a machine shared with other work loads every width and every program alike.

Each round, for every program (in turn) and every width T (in a shuffled order): a one-token
call at the cache position, then a T-token call right after it at the next position (as a
verification follows a step in the speculative loop), both timed by the wall clock and by this
process's CPU time (all its threads: ExecuTorch's pool). The ratio of each pair is taken, and
the table gives its median over the rounds with the quartiles, next to the median one-token call
in ms. The load average before and after is recorded with the results: compare ratios, not
milliseconds, across runs.

    python benchmarks/width_ratios.py A/target.pte B/target.pte --labels a,b \\
        --widths 1,2,3,4,5,6,7,8 --position 150 --rounds 40 --threads 2 \\
        --out benchmarks/results/verification/RUN
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import mtp_edge  # noqa: F401  (before ExecuTorch loads: MTP_EDGE_CPU_CLASS applies at import)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def vocab_size(pte: Path) -> int:
    """The vocabulary of the bundle a program belongs to (its manifest), else 1010."""
    from mtp_edge.manifest import Manifest

    try:
        return Manifest.load(pte.parent, verify=False).vocab_size
    except Exception:  # a program outside a bundle
        return 1010


def measure(ptes: list[Path], widths: list[int], position: int, rounds: int, threads: int):
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    import executorch.kernels.quantized  # noqa: F401
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    from mtp_edge.runtime.executorch_ops import load_kernels
    from mtp_edge.runtime.executorch_session import hand_cores_to_executorch

    hand_cores_to_executorch()
    if portable_lib._threadpool_get_thread_count() != threads:
        portable_lib._unsafe_reset_threadpool(threads)
    load_kernels()
    methods = [Runtime.get().load_program(p).load_method("forward") for p in ptes]
    span = min(vocab_size(p) for p in ptes) - 10  # ordinary ids, inside every vocabulary
    ids = [(17 * i + 11) % span + 10 for i in range(position + max(widths) + 2)]
    for method in methods:  # prefill in chunks of at most 128 tokens (mtp-export's max_chunk)
        for start in range(0, position, 128):
            chunk = ids[start : min(position, start + 128)]
            method.execute([torch.tensor([chunk]), torch.tensor([start])])

    def call(method, n: int, start: int) -> tuple[float, float]:
        tokens, at = torch.tensor([ids[start : start + n]]), torch.tensor([start])
        wall, cpu = time.perf_counter(), time.process_time()
        method.execute([tokens, at])
        return time.perf_counter() - wall, time.process_time() - cpu

    for method in methods:  # warm up every width
        for width in widths:
            call(method, width, position)
    samples = {(i, w): [] for i in range(len(methods)) for w in widths}
    rng = random.Random(0)
    started = time.perf_counter()
    for r in range(rounds):
        order = list(range(len(methods)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            shuffled = list(widths)
            rng.shuffle(shuffled)
            for width in shuffled:
                one = call(methods[i], 1, position)
                wide = call(methods[i], width, position + 1)
                samples[(i, width)].append((one, wide))
        if r in (0, rounds // 2):
            left = (time.perf_counter() - started) / (r + 1) * (rounds - r - 1)
            print(f"[width-ratios] round {r + 1}/{rounds}, ~{left:.0f} s left", file=sys.stderr)
    rows = []
    for i in range(len(methods)):
        for width in widths:
            pairs = samples[(i, width)]
            wall = quartiles([w[0] / o[0] for o, w in pairs])
            cpu = quartiles([w[1] / o[1] for o, w in pairs if o[1] > 0])
            rows.append(
                {
                    "program": i,
                    "tokens": width,
                    "ratio_wall": [round(v, 3) for v in wall],
                    "ratio_cpu": [round(v, 3) for v in cpu],
                    "one_token_ms": round(statistics.median(o[0] for o, _ in pairs) * 1e3, 3),
                    "ms": round(statistics.median(w[0] for _, w in pairs) * 1e3, 3),
                    "cpu_ms": round(statistics.median(w[1] for _, w in pairs) * 1e3, 3),
                }
            )
    return rows


def markdown(rows: list[dict], labels: list[str], args, loads, command: str) -> str:
    from mtp_edge.machine import int8_path

    widths = sorted({r["tokens"] for r in rows})
    path = int8_path()
    lines = [
        "# forward(T) / forward(1), interleaved",
        "",
        f"Position {args.position}, {args.threads} threads, {args.rounds} rounds; each cell the "
        "median ratio of a T-token call to the one-token call just before it, wall clock "
        "[quartiles], then the same in this process's CPU time. CPU int8 path: "
        f"{path.name} ({path.instruction}). Load average (1 min) before / after: "
        f"{loads[0]:.2f} / {loads[1]:.2f}.",
        "",
        "| program | one-token call ms | " + " | ".join(f"T={w}" for w in widths) + " |",
        "|---|---|" + "---|" * len(widths),
    ]
    for i, label in enumerate(labels):
        mine = {r["tokens"]: r for r in rows if r["program"] == i}
        one = statistics.median(r["one_token_ms"] for r in mine.values())
        wall = " | ".join(
            f"{mine[w]['ratio_wall'][1]:.2f} [{mine[w]['ratio_wall'][0]:.2f}-"
            f"{mine[w]['ratio_wall'][2]:.2f}]"
            for w in widths
        )
        cpu = " | ".join(f"{mine[w]['ratio_cpu'][1]:.2f}" for w in widths)
        lines.append(f"| {label}, wall | {one:.2f} | {wall} |")
        lines.append(f"| {label}, CPU time | | {cpu} |")
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pte", nargs="+", help="exported target programs (a bundle's target.pte)")
    parser.add_argument("--labels", help="comma-separated names for the programs")
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--position", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="results path without extension (.json and .md)")
    args = parser.parse_args()
    ptes = [Path(p) for p in args.pte]
    for p in ptes:
        if not p.is_file():
            sys.exit(f"error: {p} is not a file: pass a bundle's target.pte")
    labels = args.labels.split(",") if args.labels else [p.parent.name for p in ptes]
    if len(labels) != len(ptes):
        sys.exit("error: --labels needs one name per program")
    widths = sorted({int(w) for w in args.widths.split(",")})
    before = os.getloadavg()[0]
    rows = measure(ptes, widths, args.position, args.rounds, args.threads)
    loads = (before, os.getloadavg()[0])
    command = "python benchmarks/width_ratios.py " + " ".join(sys.argv[1:])
    text = markdown(rows, labels, args, loads, command)
    print(text)
    if args.out:
        body = {
            "programs": dict(zip(labels, map(str, ptes), strict=True)),
            "args": vars(args),
            "load_average_before_after": loads,
            "rows": rows,
            "command": command,
        }
        Path(args.out + ".json").write_text(json.dumps(body, indent=1) + "\n")
        Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
