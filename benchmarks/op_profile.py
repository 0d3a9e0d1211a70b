"""Where a forward call's time goes, per operator and per width T: ExecuTorch's event tracer
(ETDump) on an exported target program, with XNNPACK's per-operator profiling, which the
ExecuTorch wheel's runtime records inside each delegate call.

For each width T, the program is prefilled to --position, then `forward` runs T tokens at that
position --reps times (each call overwrites the same cache slots, as a rejected draft would).
Per call, the time is split into: XNNPACK operators by kind (8-bit dynamically quantized
GEMMs, float GEMMs, element-wise), the time inside delegate calls that no XNNPACK operator
accounts for (delegate glue: setting up inputs, the dynamic-shape reshape), our attention op
(mtp_edge::sdpa), our glue ops (rms_norm, rope, swiglu), the cache writes
(llama::update_cache), the embedding lookup, other portable operators, and the runtime's
dispatch around each portable operator. Medians over the calls.

    python benchmarks/op_profile.py bundles/qwen05-android/target.pte --widths 1,2,5,8 \\
        --json benchmarks/results/verification/op_profile_qwen05.json \\
        --markdown benchmarks/results/verification/op_profile_qwen05.md

The tracer itself costs a little per operator; the ratios between widths are what this is for
(`benchmarks/verify_cost.py` measures the calls without it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import mtp_edge  # noqa: F401  (before ExecuTorch loads: MTP_EDGE_CPU_CLASS applies at import)

CATEGORIES = [
    ("linear int8 (QD8/QDU8 x QC8W)", "GEMMs with 8-bit dynamically quantized rows, int8 weights"),
    ("linear int4 (QD8 x QB4W/QC4W)", "the same with 4-bit weights"),
    ("linear int8 (mtp_edge::linear_i8)", "8da8w-avx2's layers: our int8 kernel, 6-row tile"),
    ("linear int4 (mtp_edge::linear_i4)", "8da4w-mix-avx2's 4-bit layers: our kernel, 6-row tile"),
    ("linear int6 (mtp_edge::linear_i6)", "a 6-bit LM head (8da4w-mix-avx2's): our kernel, 6 rows"),
    ("linear fp32", "float GEMMs: the RoPE rotation and the norms' mean, as small products"),
    ("xnnpack element-wise", "norms, SwiGLU, residual adds, reshapes inside the delegate"),
    ("delegate glue", "inside delegate calls, not inside any XNNPACK operator"),
    ("attention (mtp_edge::sdpa)", "our row-exact attention op, with its dispatch"),
    ("glue (mtp_edge::rms_norm, rope, swiglu)", "our element-wise ops between our linears"),
    ("cache write (update_cache)", "K and V written into the static cache"),
    ("embedding", "the 8-bit embedding lookup"),
    ("other portable ops", "index, arange, select and the like outside the delegates"),
    ("dispatch", "the runtime's work around each other portable operator call"),
]


def category(name: str, delegated: bool) -> str | None:
    """The category of one ETDump event (None: a wrapper event counted elsewhere)."""
    if delegated:
        if name.startswith("Fully Connected"):
            if "QC8W" in name:
                return "linear int8 (QD8/QDU8 x QC8W)"
            if "4W" in name:
                return "linear int4 (QD8 x QB4W/QC4W)"
            return "linear fp32"
        return "xnnpack element-wise"
    if name in ("Method::execute", "DELEGATE_CALL", "OPERATOR_CALL"):
        return None
    if "linear_i8" in name:
        return "linear int8 (mtp_edge::linear_i8)"
    if "linear_i4" in name:
        return "linear int4 (mtp_edge::linear_i4)"
    if "linear_i6" in name:
        return "linear int6 (mtp_edge::linear_i6)"
    if "sdpa" in name:
        return "attention (mtp_edge::sdpa)"
    if any(op in name for op in ("rms_norm", "rope", "swiglu")):
        return "glue (mtp_edge::rms_norm, rope, swiglu)"
    if "update_cache" in name:
        return "cache write (update_cache)"
    if "embedding" in name:
        return "embedding"
    return "other portable ops"


def profile(pte: Path, widths: list[int], position: int, reps: int, threads: int) -> dict:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    import executorch.kernels.quantized  # noqa: F401
    from executorch.devtools import Inspector
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    from mtp_edge.runtime.executorch_ops import load_kernels
    from mtp_edge.runtime.executorch_session import hand_cores_to_executorch

    hand_cores_to_executorch()  # torch one thread, ExecuTorch's pool the cores
    if portable_lib._threadpool_get_thread_count() != threads:
        portable_lib._unsafe_reset_threadpool(threads)
    load_kernels()
    program = Runtime.get().load_program(pte, enable_etdump=True)
    forward = program.load_method("forward")
    chunk = 128  # prefill in calls of at most this many tokens (mtp-export's max_chunk)
    calls: list[tuple[str, int]] = []  # what each execute was: ("prefill", n) or ("T", T)
    wall: dict[int, list[float]] = defaultdict(list)

    def run(tokens: list[int], start: int) -> float:
        began = time.perf_counter()
        forward.execute([torch.tensor([tokens]), torch.tensor([start])])
        return time.perf_counter() - began

    ids = [(17 * i + 11) % 1000 + 10 for i in range(position + max(widths))]
    for start in range(0, position, chunk):
        run(ids[start : min(position, start + chunk)], start)
        calls.append(("prefill", 0))
    for width in widths:
        for _ in range(reps):
            wall[width].append(run(ids[position : position + width], position) * 1e3)
            calls.append(("T", width))
    with tempfile.TemporaryDirectory() as tmp:
        etdump = Path(tmp) / "profile.etdp"
        program.write_etdump_result_to_file(str(etdump), str(Path(tmp) / "debug.bin"))
        inspector = Inspector(etdump_path=str(etdump))
    per_call: list[dict[str, float]] = [defaultdict(float) for _ in calls]
    for block in inspector.event_blocks:
        if block.name != "Execute":
            continue
        delegate_ops: list[list[float]] = []
        delegate_calls: list[list[float]] = []
        operator_calls: list[list[float]] = []
        native_calls: list[list[float]] = []
        previous = None
        for event in block.events:
            if event.perf_data is None:
                continue
            raw = list(event.perf_data.raw)
            if len(raw) != len(calls):  # an instruction that does not run in every call
                raw = (raw + [0.0] * len(calls))[: len(calls)]
            name = re.sub(r" #\d+$", "", event.name)
            if event.name == "Method::execute":
                for i, value in enumerate(raw):
                    per_call[i]["total"] += value
                continue
            if event.name == "DELEGATE_CALL":
                delegate_calls.append(raw)
                continue
            if event.name == "OPERATOR_CALL":
                # A kernel from ExecuTorch's generated registrations records its own event
                # just before its OPERATOR_CALL ends; ours (mtp_edge::sdpa) records none, so an
                # OPERATOR_CALL without one is our attention op, its dispatch included.
                scoped = (
                    previous is not None
                    and not previous.is_delegated_op
                    and (previous.name.startswith("native_call_") or "::" in previous.name)
                )
                if scoped:
                    operator_calls.append(raw)
                else:
                    for i, value in enumerate(raw):
                        per_call[i]["attention (mtp_edge::sdpa)"] += value
                        per_call[i]["attention calls"] += 1
                previous = event
                continue
            previous = event
            kind = category(name, bool(event.is_delegated_op))
            if kind is None:
                continue
            (delegate_ops if event.is_delegated_op else native_calls).append(raw)
            for i, value in enumerate(raw):
                per_call[i][kind] += value
                per_call[i]["kernel " + name] += value
        for i in range(len(calls)):
            inside = sum(raw[i] for raw in delegate_calls)
            per_call[i]["delegate glue"] += inside - sum(raw[i] for raw in delegate_ops)
            wrapped = sum(raw[i] for raw in operator_calls)
            per_call[i]["dispatch"] += wrapped - sum(raw[i] for raw in native_calls)
    rows = {}
    for width in widths:
        picked = [per_call[i] for i, call in enumerate(calls) if call == ("T", width)]
        keys = sorted({key for call in picked for key in call})
        rows[width] = {
            key: statistics.median(call.get(key, 0.0) for call in picked) for key in keys
        }
        rows[width]["wall"] = statistics.median(wall[width])
    return rows


def markdown(rows: dict, args) -> str:
    widths = sorted(rows)
    base = rows[widths[0]]
    lines = [
        f"# Per-operator time of forward(T), {Path(args.pte).parent.name or args.pte}",
        "",
        f"`{Path(args.pte).name}` at position {args.position}, {args.threads} threads, median of "
        f"{args.reps} calls per width, ETDump with XNNPACK's operator profiling; ms per call, "
        f"and in brackets the ratio to T={widths[0]}.",
        "",
        "| | " + " | ".join(f"T={w}" for w in widths) + " |",
        "|---|" + "---|" * len(widths),
    ]

    def cell(width: int, key: str) -> str:
        value = rows[width].get(key, 0.0)
        ratio = value / base[key] if base.get(key) else float("nan")
        return f"{value:.2f}" + (f" ({ratio:.2f})" if width != widths[0] and ratio == ratio else "")

    for key, _ in [("wall", ""), ("total", ""), *CATEGORIES]:
        if any(rows[w].get(key, 0.0) > 0.005 for w in widths):
            label = {"wall": "wall clock of the call", "total": "Method::execute"}.get(key, key)
            lines.append(f"| {label} | " + " | ".join(cell(w, key) for w in widths) + " |")
    lines += ["", "By XNNPACK operator kind (ms per call, summed over layers):", ""]
    lines += ["| operator | " + " | ".join(f"T={w}" for w in widths) + " |"]
    lines += ["|---|" + "---|" * len(widths)]
    kernels = sorted(
        {k for w in widths for k in rows[w] if k.startswith("kernel ")},
        key=lambda k: -rows[widths[-1]].get(k, 0.0),
    )
    for key in kernels:
        if any(rows[w].get(key, 0.0) > 0.02 for w in widths):
            cells = " | ".join(cell(w, key) for w in widths)
            lines.append(f"| {key.removeprefix('kernel ')} | {cells} |")
    lines += ["", "Categories:", ""]
    lines += [f"- {name}: {meaning}" for name, meaning in CATEGORIES]
    lines += ["", "Command: `python benchmarks/op_profile.py " + " ".join(sys.argv[1:]) + "`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pte", help="an exported target program (a bundle's target.pte)")
    parser.add_argument("--widths", default="1,2,3,4,5,6,8")
    parser.add_argument("--position", type=int, default=150)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    rows = profile(Path(args.pte), widths, args.position, args.reps, args.threads)
    text = markdown(rows, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
