"""One onnxruntime MatMulNBits (int4, block 32) on this CPU: microseconds per call and the int4
weight bytes read per second, by rows (1, 2, 5), threads and spinning, for accuracy levels 4
(int8 activations, what mtp-export uses) and 1 (fp32 activations).

The graph holds 40 independent matmuls of the same shape (so the weights come from memory, as in
a model, not from cache); the time per call is the graph's time / 40.

    python benchmarks/ort_matmulnbits.py [--k 576] [--n 3072] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

RESULTS = Path(__file__).parent / "results/formats"
COPIES = 40


def graph(k: int, n: int, level: int, path: Path) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"w{i}")
        for i in range(COPIES)
    ]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(COPIES)]
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(COPIES)], ["y"]))
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "matmuls",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
            weights,
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    quantizer = MatMulNBitsQuantizer(
        model, bits=4, block_size=32, is_symmetric=True, accuracy_level=level
    )
    quantizer.process()
    onnx.save(quantizer.model.model, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", default=str(RESULTS / "ort_matmulnbits"))
    args = parser.parse_args()
    rows = []
    weight_bytes = args.k * args.n / 2
    with tempfile.TemporaryDirectory() as tmp:
        for level in (4, 1):
            path = Path(tmp) / f"level{level}.onnx"
            graph(args.k, args.n, level, path)
            for m in (1, 2, 5):
                for threads, spin in ((1, "0"), (2, "0"), (2, "1")):
                    options = ort.SessionOptions()
                    options.intra_op_num_threads = threads
                    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
                    session = ort.InferenceSession(
                        str(path), options, providers=["CPUExecutionProvider"]
                    )
                    x = np.random.default_rng(1).standard_normal((m, args.k)).astype(np.float32)
                    times = []
                    for _ in range(args.rounds):
                        started = time.perf_counter()
                        session.run(None, {"x": x})
                        times.append(time.perf_counter() - started)
                    us = statistics.median(times[5:]) * 1e6 / COPIES
                    row = {
                        "accuracy_level": level, "rows": m, "threads": threads,
                        "spinning": spin == "1", "us_per_call": round(us, 1),
                        "int4_GB_per_s": round(weight_bytes / us / 1e3, 1),
                    }  # fmt: skip
                    rows.append(row)
                    print(row, flush=True)
    report = {"k": args.k, "n": args.n, "block_size": 32, "copies": COPIES, "rows": rows}
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# onnxruntime {ort.__version__} MatMulNBits, {args.k} x {args.n} int4, block 32",
        "",
        "| accuracy level | rows | threads | spinning | us per call | int4 GB/s |",
        "|---|---|---|---|---|---|",
        *[
            f"| {r['accuracy_level']} | {r['rows']} | {r['threads']} | {r['spinning']} | "
            f"{r['us_per_call']} | {r['int4_GB_per_s']} |"
            for r in rows
        ],
        "",
        "Command: `python benchmarks/ort_matmulnbits.py`",
    ]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
