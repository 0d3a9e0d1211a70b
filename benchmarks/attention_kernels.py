"""Attention alone, as a whole forward call runs it: every layer's mtp_edge::sdpa over that
layer's own cache (so the caches stream from memory as in a bundle, not from a cache one layer
warmed), for T query rows at several cache positions, in the head layout of a real model. Each
width is a one-program ExecuTorch method (caches as mutable buffers, as in the bundles) run under
executorch.runtime with ExecuTorch's thread pool. Optionally ExecuTorch's llama.custom_sdpa (not
row-exact) on the same layout, for reference. Writes <out>.{json,md}.

    python benchmarks/attention_kernels.py [--layout qwen05|smollm2|H,HKV,D,LAYERS]
        [--widths 1,2,5,8] [--positions 150,600,1000,1500] [--threads 2] [--repeats 50]
        [--versions avx512,avx2,baseline] [--flags "-DMTP_EDGE_BASELINE -mavx2 -mfma"]
        [--custom-sdpa] [--out benchmarks/results/verification/attention_kernels]

--versions measures each named version of our kernel (MTP_EDGE_ATTENTION_ISA, one process
each; a version this CPU lacks falls back to its own, with one line); --flags builds the kernel
with extra compiler flags (e.g. the baseline alone compiled for AVX2: how GCC compiles the
source for a CPU of that class without the dispatch).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from executorch.exir import ExecutorchBackendConfig, to_edge
from executorch.exir.passes import MemoryPlanningPass
from executorch.runtime import Runtime

from mtp_edge import ops
from mtp_edge.runtime import executorch_ops
from mtp_edge.runtime.executorch_session import hand_cores_to_executorch

RESULTS = "benchmarks/results/verification/attention_kernels"
SLOTS = 2048
LAYOUTS = {  # query heads, KV heads, head size, layers
    "smollm2": (9, 3, 64, 30),  # SmolLM2-135M
    "qwen05": (14, 2, 64, 24),  # Qwen2.5-0.5B
    "qwen15": (12, 2, 128, 28),  # Qwen2.5-1.5B
}


class Attend(torch.nn.Module):
    """One attention call per layer, each over its own K and V cache."""

    def __init__(self, kernel: str, kv_heads: int, dim: int, layers: int):
        super().__init__()
        self.kernel, self.layers = kernel, layers
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.randn(1, SLOTS, kv_heads, dim))
            self.register_buffer(f"v{i}", torch.randn(1, SLOTS, kv_heads, dim))

    def forward(self, q, start):
        s = start.item()
        outs = []
        for i in range(self.layers):
            k, v = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            if self.kernel == "mtp_edge::sdpa":
                outs.append(torch.ops.mtp_edge.sdpa(q, k, v, s))
            else:
                outs.append(torch.ops.llama.custom_sdpa(q, k, v, s, None, 0.0, True))
        return tuple(outs)


def program(kernel: str, layout: tuple[int, int, int, int], rows: int):
    heads, kv_heads, dim, layers = layout
    q = torch.randn(1, rows, heads, dim)
    module = Attend(kernel, kv_heads, dim, layers)
    exported = to_edge(torch.export.export(module, (q, torch.tensor([100])), strict=True))
    planning = MemoryPlanningPass(alloc_graph_input=False)
    config = ExecutorchBackendConfig(memory_planning_pass=planning)
    loaded = Runtime.get().load_program(exported.to_executorch(config).buffer)
    return loaded, loaded.load_method("forward"), q  # the method needs its program alive


def parse_layout(text: str) -> tuple[int, int, int, int]:
    if text in LAYOUTS:
        return LAYOUTS[text]
    heads, kv_heads, dim, layers = (int(x) for x in text.split(","))
    return heads, kv_heads, dim, layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="qwen05", help="a name or H,HKV,D,LAYERS")
    parser.add_argument("--widths", default="1,2,5,8")
    parser.add_argument("--positions", default="150,600,1000,1500")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--versions", default="", help="kernel versions, one process each")
    parser.add_argument("--flags", default="", help="extra compiler flags for the kernel")
    parser.add_argument("--custom-sdpa", action="store_true", help="also llama.custom_sdpa")
    parser.add_argument("--out", default=RESULTS, help="results path without extension")
    args = parser.parse_args()
    layout = parse_layout(args.layout)
    if args.versions:
        rows = each_version(args)
    else:
        rows = measure(args, layout)
    report(args, layout, rows)


def each_version(args) -> list[dict]:
    """This script once per named version, in its own process; their rows together."""
    rows = []
    for version in args.versions.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows")
            argv = list(sys.argv[1:])
            at = argv.index("--versions")
            del argv[at : at + 2]
            subprocess.run(
                [sys.executable, __file__, *argv, "--out", out], check=True,
                env={**os.environ, "MTP_EDGE_ATTENTION_ISA": version},
            )  # fmt: skip
            with open(out + ".json") as f:
                rows += json.load(f)["rows"]
    return rows


def kernel_label(args) -> str:
    label = "mtp_edge::sdpa"
    if os.environ.get("MTP_EDGE_ATTENTION_ISA"):
        label += f" {os.environ['MTP_EDGE_ATTENTION_ISA']}"
    if args.flags:
        label += f" built {args.flags}"
    return label


def measure(args, layout) -> list[dict]:
    torch.set_num_threads(args.threads)  # ExecuTorch takes this count (below)
    ops.define()
    if args.flags:
        from executorch.extension.pybindings import portable_lib  # noqa: F401

        flags = args.flags.split()
        library = executorch_ops.library_path(flags)
        if not library.is_file():
            executorch_ops.build(library, flags)
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        executorch_ops._loaded = True  # this build is the one registered
    else:
        executorch_ops.load_kernels()
    label = kernel_label(args)
    kernels = ["mtp_edge::sdpa"]
    if args.custom_sdpa:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (torch.ops.llama)

        kernels.append("llama.custom_sdpa")
    hand_cores_to_executorch()
    torch.manual_seed(0)
    widths = [int(w) for w in args.widths.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    rows = []
    for kernel in kernels:
        for width in widths:
            loaded, method, q = program(kernel, layout, width)
            for position in positions:
                at = torch.tensor([position])
                for _ in range(5):
                    method.execute([q, at])
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    method.execute([q, at])
                    times.append(time.perf_counter() - start)
                ms = statistics.median(times) * 1e3
                name = label if kernel == "mtp_edge::sdpa" else kernel
                rows.append({"kernel": name, "rows": width, "position": position,
                             "ms": round(ms, 3)})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del method, loaded  # a method must go before its program
    return rows


def report(args, layout, rows: list[dict]) -> None:
    widths = [int(w) for w in args.widths.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    command = (
        f"python benchmarks/attention_kernels.py --layout {args.layout} --widths {args.widths} "
        f"--positions {args.positions} --threads {args.threads} --repeats {args.repeats}"
        + (f" --versions {args.versions}" if args.versions else "")
        + (f' --flags "{args.flags}"' if args.flags else "")
        + (" --custom-sdpa" if args.custom_sdpa else "")
        + (f" --out {args.out}" if args.out != RESULTS else "")
    )
    with open(args.out + ".json", "w") as f:
        record = {"layout": layout, "threads": args.threads, "rows": rows, "command": command}
        f.write(json.dumps(record, indent=2) + "\n")
    heads, kv_heads, dim, layers = layout
    lines = [
        f"# Attention of a whole forward call ({layers} layers; {heads} query heads, "
        f"{kv_heads} KV heads, head size {dim})",
        "",
        f"Median ms per call over all layers, {args.threads} threads; in brackets the ratio "
        "to one row at the same position.",
        "",
        "| kernel | rows | " + " | ".join(f"position {p}" for p in positions) + " |",
        "|---|---|" + "---|" * len(positions),
    ]
    one = {(r["kernel"], r["position"]): r["ms"] for r in rows if r["rows"] == 1}
    for kernel in kernels:
        for width in widths:
            cells = []
            for p in positions:
                ms = next(r["ms"] for r in rows if (r["kernel"], r["rows"], r["position"]) ==
                          (kernel, width, p))  # fmt: skip
                base = one.get((kernel, p))
                cells.append(f"{ms:.3f}" + (f" ({ms / base:.2f})" if base and width > 1 else ""))
            lines.append(f"| {kernel} | {width} | " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{command}`", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
