"""Native runner (C++) vs the Python runtime on one bundle: speed, and token agreement.

Both decode the built-in prompt suite (encoded once, by the Python tokenizer with the chat
template, so both get the same ids) plain and speculatively, with the same ExecuTorch thread
count. Writes both mtp-bench reports and a comparison JSON; prints a Markdown table.

    python benchmarks/native_vs_python.py --bundle bundles/SmolLM2-135M-Instruct-android \
        --max-new-tokens 96 --threads 2 --out benchmarks/results/runtimes/native_vs_python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from mtp_edge.devices.harness import NEAR_TIE, Suite, load_prompts, progress_line
from mtp_edge.runtime import native_runner
from mtp_edge.runtime.assemble import LoadOptions, assemble
from mtp_edge.runtime.bundle import open_bundle
from mtp_edge.runtime.loop import GenerationConfig, first_divergence


def agreement(python_rows: list[dict], native_rows: list[dict], key: str) -> dict:
    """How often native and Python token ids agree; where not, the Python run's top-2 gap."""
    identical, gaps = 0, []
    for p, n in zip(python_rows, native_rows, strict=True):
        j = first_divergence(p[key], n[key])
        if j is None:
            identical += 1
        else:
            gaps.append(p["gaps"][j] if j < len(p["gaps"]) else None)
    return {
        "identical": identical,
        "prompts": len(python_rows),
        "divergence_top2_gaps": [None if g is None else round(g, 4) for g in gaps],
        "near_tie_divergences": sum(1 for g in gaps if g is not None and g < NEAR_TIE),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/runtimes/native_vs_python")
    parser.add_argument(
        "--drafter",
        default=None,
        help="a drafter name both runtimes take (ngram, mtp, mtp+ngram...; default: the "
        "bundle's own, with its drafting policy)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(args.threads)  # the Python session gives ExecuTorch this many
    bundle = open_bundle(args.bundle)
    m = bundle.manifest
    prompts = load_prompts()
    encoded = {p.id: bundle.tokenizer.encode_prompt(p.prompt, chat=True) for p in prompts}
    ids_file = out / "prompts_ids.jsonl"
    ids_file.write_text(
        "".join(
            json.dumps(
                {
                    "id": p.id,
                    "category": p.category,
                    "prompt_ids": encoded[p.id],
                    "max_new_tokens": p.max_new_tokens,
                }
            )
            + "\n"
            for p in prompts
        )
    )

    print("[native] build and run", file=sys.stderr)
    runner = native_runner.build(progress=lambda line: print(line, file=sys.stderr))
    native_json = out / "native.json"
    subprocess.run(
        [
            str(runner),
            "--bundle",
            args.bundle,
            "--prompts",
            str(ids_file),
            "--json",
            str(native_json),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--repeat",
            str(args.repeat),
            "--threads",
            str(args.threads),
            *(["--drafter", args.drafter] if args.drafter else []),
        ],
        check=False,
    )
    native_report = json.loads(native_json.read_text())

    print("[python] run", file=sys.stderr)
    # The bundle's drafter with its drafting policy, as mtp-run / mtp-bench (and the native
    # runner) apply it by default.
    python = assemble(
        LoadOptions(bundle=args.bundle, drafter=args.drafter, max_seq_len=m.max_seq_len),
        max_new_tokens=args.max_new_tokens,
    )
    session, drafter = python.session, python.drafter
    config = GenerationConfig(k=python.config.k, eos_ids=tuple(m.eos_ids))
    suite = Suite(config.k, args.repeat)
    runs = []  # (plain, speculative) results of each prompt's last repeat
    for i, p in enumerate(prompts):
        encode = lambda text, p=p, **_: encoded[p.id]  # noqa: E731  (the runner's own ids)
        row = suite.run_prompt(session, encode, drafter, p, config, args.max_new_tokens)
        runs.append(suite.last_runs)
        print(f"[{i + 1}/{len(prompts)}] {progress_line(row)}", file=sys.stderr)
    python_body = suite.body()
    python_report = {
        "bundle": args.bundle,
        "backend": "executorch",
        "runtime": "python",
        "drafter": drafter.name if drafter else "none",
        "k": config.k,
        "threads": args.threads,
        **python_body,
    }
    (out / "python.json").write_text(json.dumps(python_report, indent=2) + "\n")

    py_rows = [{"ar": a.token_ids, "spec": s.token_ids, "gaps": a.top2_gaps} for a, s in runs]
    nat_rows = [
        {"ar": r["ar_token_ids"], "spec": r["spec_token_ids"]} for r in native_report["prompts"]
    ]
    ps, ns = python_report["summary"], native_report["summary"]
    comparison = {
        "python": {
            k: ps[k]
            for k in (
                "ar_tokens_per_s",
                "spec_tokens_per_s",
                "speedup",
                "tau",
                "ttft_ms_ar",
                "lossless",
                "divergences",
            )
        },
        "native": {
            k: ns[k]
            for k in (
                "ar_tokens_per_s",
                "spec_tokens_per_s",
                "speedup",
                "tau",
                "ttft_ms_ar",
                "lossless",
                "divergences",
            )
        },
        "plain_native_vs_python": agreement(py_rows, nat_rows, "ar"),
        "spec_native_vs_python": agreement(py_rows, nat_rows, "spec"),
        "command": " ".join(sys.argv),
    }
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    print("| runtime | plain tok/s | spec tok/s | speedup | tau | ttft ms | spec==plain |")
    print("|---|---|---|---|---|---|---|")
    for name, s in (("python", ps), ("native", ns)):
        print(
            f"| {name} | {s['ar_tokens_per_s']:.1f} | {s['spec_tokens_per_s']:.1f} | "
            f"{s['speedup']:.2f}x | {s['tau']:.2f} | {s['ttft_ms_ar']:.1f} | "
            f"{s['prompts'] - s['divergences']}/{s['prompts']} |"
        )
    for key in ("plain_native_vs_python", "spec_native_vs_python"):
        a = comparison[key]
        print(
            f"{key}: {a['identical']}/{a['prompts']} identical, divergence gaps "
            f"{a['divergence_top2_gaps']}"
        )


if __name__ == "__main__":
    main()
