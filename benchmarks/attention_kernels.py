"""Attention alone, per layer: our mtp_edge::sdpa kernel against ExecuTorch's llama.custom_sdpa,
with SmolLM2-135M's layout (9 query heads, 3 KV heads, head size 64, a 2048-slot cache), for
1 query row (a decode step) and 5 (a k=4 verification) at several cache positions. Each is a
one-op ExecuTorch program (the cache as mutable buffers, as in the bundles) run under
executorch.runtime with ExecuTorch's thread pool. Writes
results/verification/attention_kernels.{json,md}.

    python benchmarks/attention_kernels.py [--threads 2] [--positions 64,250,550] [--repeats 300]
"""

from __future__ import annotations

import argparse
import json
import time

import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (torch.ops.llama)
import torch
from executorch.exir import ExecutorchBackendConfig, to_edge
from executorch.exir.passes import MemoryPlanningPass
from executorch.runtime import Runtime

from mtp_edge import ops
from mtp_edge.runtime import executorch_ops
from mtp_edge.runtime.executorch_session import hand_cores_to_executorch

RESULTS = "benchmarks/results/verification/attention_kernels"
HEADS, KV_HEADS, DIM, SLOTS, LAYERS = 9, 3, 64, 2048, 30


class Attend(torch.nn.Module):
    def __init__(self, kernel: str):
        super().__init__()
        self.kernel = kernel
        self.register_buffer("k", torch.randn(1, SLOTS, KV_HEADS, DIM))
        self.register_buffer("v", torch.randn(1, SLOTS, KV_HEADS, DIM))

    def forward(self, q, start):
        s = start.item()
        if self.kernel == "mtp_edge::sdpa":
            return torch.ops.mtp_edge.sdpa(q, self.k, self.v, s)
        return torch.ops.llama.custom_sdpa(q, self.k, self.v, s, None, 0.0, True)


def program(kernel: str, rows: int):
    q = torch.randn(1, rows, HEADS, DIM)
    exported = to_edge(torch.export.export(Attend(kernel), (q, torch.tensor([100])), strict=True))
    planning = MemoryPlanningPass(alloc_graph_input=False)
    config = ExecutorchBackendConfig(memory_planning_pass=planning)
    loaded = Runtime.get().load_program(exported.to_executorch(config).buffer)
    return loaded, loaded.load_method("forward"), q  # the method needs its program alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", default="64,250,550")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # ExecuTorch takes this count (below)
    ops.define()
    executorch_ops.load_kernels()
    hand_cores_to_executorch()
    torch.manual_seed(0)
    rows = []
    for kernel in ("mtp_edge::sdpa", "llama.custom_sdpa"):
        for width in (1, 5):
            loaded, method, q = program(kernel, width)
            for position in (int(p) for p in args.positions.split(",")):
                at = torch.tensor([position])
                for _ in range(20):
                    method.execute([q, at])
                start = time.perf_counter()
                for _ in range(args.repeats):
                    method.execute([q, at])
                us = (time.perf_counter() - start) / args.repeats * 1e6
                rows.append(
                    {
                        "kernel": kernel,
                        "rows": width,
                        "position": position,
                        "us_per_layer": round(us, 1),
                        "ms_per_30_layers": round(us * LAYERS / 1e3, 2),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            del method, loaded  # a method must go before its program
    command = (
        f"python benchmarks/attention_kernels.py --threads {args.threads} "
        f"--positions {args.positions} --repeats {args.repeats}"
    )
    with open(RESULTS + ".json", "w") as f:
        f.write(json.dumps({"threads": args.threads, "rows": rows, "command": command}, indent=2))
        f.write("\n")
    lines = [
        f"# Attention per layer ({HEADS} heads, {KV_HEADS} KV heads, head size {DIM})",
        "",
        "| kernel | rows | position | us per layer | ms per 30 layers |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['rows']} | {r['position']} | {r['us_per_layer']} "
            f"| {r['ms_per_30_layers']} |"
        )
    lines += ["", f"Command: `{command}`", ""]
    with open(RESULTS + ".md", "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
