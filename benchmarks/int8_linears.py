"""A model's linear layers alone, as ExecuTorch programs: XNNPACK's GEMMs against our kernels,
forward(T) for T = 1..8, side by side in one process: by default 8da8w against 8da8w-avx2
(mtp_edge::linear_i8); `--schemes 8da4w-mix,8da4w-mix-avx2` the 4-bit split (mtp_edge::linear_i4
for its 4-bit layers).

The program chains, per layer, the seven linears of a llama block (q, k, v, o, gate, up, down;
k and v folded into the residual as sums, gate x up into down), then the LM head: the weights
and shapes a decoding step reads, without attention or norms, so the two kernels' own costs
are what differs. Random weights (the time does not depend on their values). Each round times
every width of both programs in turn (the median of --calls calls each); the table gives the
fastest round's ms per call and its ratio to one row.

    MTP_EDGE_CPU_CLASS=avx2 python benchmarks/int8_linears.py --threads 2 \\
        --out benchmarks/results/verification/avx2_class_int8_linears_default
    MTP_EDGE_CPU_CLASS=avx2 python benchmarks/int8_linears.py --threads 2 --layers 24 \\
        --hidden 896 --intermediate 4864 --kv 128 --vocab 151936 \\
        --schemes 8da4w-mix,8da4w-mix-avx2 --out RUN      # Qwen2.5-0.5B's shapes

Shapes default to SmolLM2-135M's (30 layers, 576 -> 1536, 3 KV heads of 64, 49,152 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mtp_edge  # noqa: F401  (before ExecuTorch loads: MTP_EDGE_CPU_CLASS applies at import)


def stack(layers: int, hidden: int, intermediate: int, kv: int, vocab: int):
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(hidden, hidden, False), nn.Linear(hidden, hidden, False)
            # k_proj / v_proj: the names the 4-bit mixed schemes keep in 8 bits.
            self.k_proj, self.v_proj = nn.Linear(hidden, kv, False), nn.Linear(hidden, kv, False)
            self.gate = nn.Linear(hidden, intermediate, False)
            self.up = nn.Linear(hidden, intermediate, False)
            self.down = nn.Linear(intermediate, hidden, False)

        def forward(self, x):
            kv_sums = self.k_proj(x).sum(-1, keepdim=True) + self.v_proj(x).sum(-1, keepdim=True)
            a = self.o(self.q(x)) + kv_sums
            return self.down(self.gate(a) * self.up(a))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.head = nn.Linear(hidden, vocab, False)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x) * 0.01
            return self.head(x)

    torch.manual_seed(0)
    return Stack().eval()


def program(scheme: str, args, directory: Path) -> Path:
    import torch

    from mtp_edge.exporter.executorch import lower, write_program
    from mtp_edge.quantize.schemes import QuantScheme, default_group_size, quantize_modules

    model = stack(args.layers, args.hidden, args.intermediate, args.kv, args.vocab)
    chosen = QuantScheme(scheme, default_group_size(scheme), "none")
    quantize_modules(model.layers, chosen)
    holder = torch.nn.Module()  # the head with the scheme's head scheme, as in an export
    holder.head = model.head
    quantize_modules(holder, QuantScheme(*chosen.head_scheme, "none"))
    model.head = holder.head
    path = directory / f"{scheme}.pte"
    x = torch.randn(1, 2, args.hidden)
    rows = torch.export.Dim("rows", min=1, max=max(args.widths))
    with torch.no_grad():
        exported = torch.export.export(model, (x,), dynamic_shapes=({1: rows},))
        write_program(lower(exported), path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--widths", default="1,2,3,4,5,6,8")
    parser.add_argument(
        "--schemes", default="8da8w,8da8w-avx2", help="android schemes, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="RUN: writes RUN.json and RUN.md")
    args = parser.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]

    import torch
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    from mtp_edge.machine import int8_path
    from mtp_edge.runtime.executorch_ops import load_kernels

    schemes = args.schemes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for scheme in schemes:
            print(f"[int8-linears] exporting {scheme}", file=sys.stderr)
            paths[scheme] = program(scheme, args, Path(tmp))
        torch.set_num_threads(1)  # ExecuTorch's pool gets the cores (mtp_edge/machine.py)
        portable_lib._unsafe_reset_threadpool(args.threads)
        load_kernels()
        programs = {s: Runtime.get().load_program(p) for s, p in paths.items()}
        methods = {s: programs[s].load_method("forward") for s in schemes}
        inputs = {t: torch.randn(1, t, args.hidden) for t in args.widths}
        best = {s: {t: float("inf") for t in args.widths} for s in schemes}
        start = time.monotonic()
        for r in range(args.rounds):
            for scheme in schemes:
                for t in args.widths:
                    method = methods[scheme]
                    for _ in range(3):
                        method.execute([inputs[t]])
                    times = []
                    for _ in range(args.calls):
                        began = time.perf_counter()
                        method.execute([inputs[t]])
                        times.append(time.perf_counter() - began)
                    best[scheme][t] = min(best[scheme][t], 1000 * statistics.median(times))
            left = (time.monotonic() - start) / (r + 1) * (args.rounds - r - 1)
            say = f"[int8-linears] round {r + 1}/{args.rounds}, ~{left:.0f} s left"
            print(say, file=sys.stderr)

    path = int8_path()
    header = "| kernel | " + " | ".join(f"T={t}" for t in args.widths) + " |"
    lines = [
        "# A model's linear layers alone: XNNPACK's GEMMs against ours",
        "",
        f"{args.layers} layers ({args.hidden} -> {args.intermediate}, k/v {args.kv}) and an LM "
        f"head of {args.vocab}; {args.threads} threads; the fastest of {args.rounds} rounds of "
        f"the median of {args.calls} calls; ms per call, in brackets the ratio to T=1. CPU int8 "
        f"path: {path.name} ({path.instruction}).",
        "",
        header,
        "|---" * (len(args.widths) + 1) + "|",
    ]
    from mtp_edge.platforms import OWN_KERNEL_SCHEMES

    names = {s: f"{'ours' if s in OWN_KERNEL_SCHEMES else 'XNNPACK'} ({s})" for s in schemes}
    for scheme in schemes:
        one = best[scheme][args.widths[0]]
        cells = [f"{best[scheme][t]:.2f} ({best[scheme][t] / one:.2f})" for t in args.widths]
        lines.append(f"| {names[scheme]} | " + " | ".join(cells) + " |")
    command = " ".join(["python", "benchmarks/int8_linears.py", *sys.argv[1:]])
    cls = os.environ.get("MTP_EDGE_CPU_CLASS")
    lines += ["", f"Command: `{f'MTP_EDGE_CPU_CLASS={cls} ' if cls else ''}{command}`", ""]
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines))
    record = {"args": vars(args), "int8_path": path.name, "ms": best, "cpu_class": cls}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
