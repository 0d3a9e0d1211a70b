"""Where a wider call's extra time goes: each linear layer shape of a model, alone, as an XNNPACK
program (the export's own quantization and lowering), timed at T = 1..8 rows. A decode step is
the sum of these plus attention and glue; if forward(T)/forward(1) grows where the linears' own
ratios grow, the linear kernels decide verification's cost (benchmarks/README.md, "Verification").

    python benchmarks/linear_by_width.py [--model default|PATH] [--quant 8da8w] [--group-size 0]
        [--widths 1,2,3,4,5,8] [--threads 2] [--repeats 200] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from mtp_edge.checkpoints import open_checkpoint
from mtp_edge.exporter.executorch import lower
from mtp_edge.quantize.schemes import QuantScheme, quantize_modules
from mtp_edge.runtime.executorch_session import hand_cores_to_executorch

RESULTS = "benchmarks/results/verification/linear_by_width"


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each distinct linear in a layer, and of the LM head."""
    c = config
    return {
        "q_proj / o_proj": (c.hidden_size, c.num_heads * c.head_dim),
        "k_proj, v_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
        "gate_proj, up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
        "lm_head": (c.hidden_size, c.vocab_size),
    }


def linear_program(fan_in: int, fan_out: int, scheme: QuantScheme, max_rows: int) -> bytes:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(fan_in, fan_out, bias=False)).eval()
    quantize_modules(layer, scheme)
    example = (torch.randn(1, 2, fan_in),)
    dynamic = ({1: torch.export.Dim("T", min=1, max=max_rows)},)
    with torch.no_grad():
        exported = torch.export.export(layer, example, dynamic_shapes=dynamic, strict=True)
        return lower(exported).buffer


def loaded_forward(buffer: bytes):
    from executorch.runtime import Runtime

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "linear.pte"
        path.write_bytes(buffer)
        return Runtime.get().load_program(path).load_method("forward")


def timed(method, x: torch.Tensor, repeats: int) -> float:
    """Median microseconds of `repeats` calls after 10 warm-up calls."""
    for _ in range(10):
        method.execute([x])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        method.execute([x])
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quant", default="8da8w")
    parser.add_argument("--group-size", type=int, default=0)
    parser.add_argument("--widths", default="1,2,3,4,5,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hand_cores_to_executorch()
    checkpoint = open_checkpoint(args.model)  # the config alone: no weights are read
    scheme = QuantScheme(args.quant, args.group_size, "none")
    widths = [int(w) for w in args.widths.split(",")]
    rows = []
    for name, (fan_in, fan_out) in layer_shapes(checkpoint.config).items():
        forward = loaded_forward(linear_program(fan_in, fan_out, scheme, max(widths)))
        costs = {t: timed(forward, torch.randn(1, t, fan_in), args.repeats) for t in widths}
        row = {"layer": name, "in": fan_in, "out": fan_out, "us": costs}
        row["over_one"] = {t: round(costs[t] / costs[1], 3) for t in widths}
        row["weight_gb_per_s"] = round(fan_in * fan_out * (0.5 if "4" in args.quant else 1) /
                                       costs[1] / 1e3, 1)  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    command = "python benchmarks/linear_by_width.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    with open(args.out + ".json", "w") as f:
        json.dump({"model": checkpoint.name, "scheme": scheme.label(), "rows": rows,
                   "command": command}, f, indent=1)  # fmt: skip
    lines = [
        f"# One linear layer alone, XNNPACK, by rows per call: {checkpoint.name}, "
        f"{scheme.label()}, {args.threads} threads",
        "",
        "| layer | in x out | weights GB/s at T=1 | "
        + " | ".join(f"T={t} us (x T=1)" for t in widths)
        + " |",
        "|---|---|---|" + "---|" * len(widths),
    ]
    for row in rows:
        cells = " | ".join(f"{row['us'][t]:.0f} ({row['over_one'][t]:.2f})" for t in widths)
        lines.append(
            f"| {row['layer']} | {row['in']} x {row['out']} | {row['weight_gb_per_s']} | {cells} |"
        )
    lines += ["", f"Command: `{command}`", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
