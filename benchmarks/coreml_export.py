"""Core ML export of the default model with each weight scheme: wall time and package size.

Runs `mtp-export --target coreml --quant SCHEME` (default model, shipped MTP heads) once per
scheme into a temporary directory, and writes results/formats/coreml_export.{json,md}.
Conversion runs on Linux; running the package needs a Mac, so the quality column holds only
the fp32 perplexity.

    python benchmarks/coreml_export.py [--schemes fp16 int8 int4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results/formats"


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return round(sum(p.stat().st_size for p in files) / 1e6, 1)


def export(scheme: str, out: Path) -> dict:
    command = ["mtp-export", "--target", "coreml", "--quant", scheme, "--out", str(out)]
    started = time.perf_counter()
    subprocess.run([*command, "--quality-tokens", "0"], check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    manifest = json.loads((out / "manifest.json").read_text())
    methods = manifest["models"]["target"]["methods"]
    return {
        "scheme": scheme,
        "command": " ".join(command),
        "export_seconds": round(seconds, 1),
        "function_seconds": {name: m["seconds"] for name, m in methods.items()},
        "package_mb": size_mb(out / "model.mlpackage"),
        "bundle_mb": size_mb(out),
        "functions": manifest["drafter"].get("functions"),
        "drafter": manifest["drafter"]["kind"],
    }


def to_markdown(rows: list[dict], machine: str) -> str:
    lines = [
        "# Core ML export of SmolLM2-135M-Instruct (+ MTP drafter step), per weight scheme",
        "",
        f"{machine}. One multifunction .mlpackage: prefill / verify / decode (shared weights and "
        "KV-cache states) and draft_step. Wall time of the whole `mtp-export` (load, trace, "
        "convert, quantize, save), `--quality-tokens 0`.",
        "",
        "| scheme | export s | package MB | seconds per function (convert + quantize) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        parts = ", ".join(f"{k} {v}" for k, v in r["function_seconds"].items())
        lines.append(f"| {r['scheme']} | {r['export_seconds']} | {r['package_mb']} | {parts} |")
    lines += ["", "Reproduce: `python benchmarks/coreml_export.py`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["fp16", "int8", "int4"])
    parser.add_argument("--keep", default=None, help="Keep the bundles under this directory.")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="coreml-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    results = RESULTS / "coreml_export.json"
    # Schemes measured earlier stay; the ones measured now replace theirs.
    rows = json.loads(results.read_text())["rows"] if results.exists() else []
    for scheme in args.schemes:
        print(f"[coreml] {scheme}", flush=True)
        row = export(scheme, root / f"coreml-{scheme}")
        rows = [r for r in rows if r["scheme"] != scheme] + [row]
        print(json.dumps(row), flush=True)
    order = ["fp16", "int8", "int4"]
    rows.sort(key=lambda r: order.index(r["scheme"]) if r["scheme"] in order else len(order))
    machine = f"{platform.machine()}, {platform.system()}, nice'd on a shared 2-core machine"
    RESULTS.mkdir(exist_ok=True)
    results.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    (RESULTS / "coreml_export.md").write_text(to_markdown(rows, machine))


if __name__ == "__main__":
    main()
