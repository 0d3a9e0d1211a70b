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

from mtp_edge.cli import setup
from mtp_edge.devices.harness import NEAR_TIE, load_prompts, run_suite
from mtp_edge.runtime import native
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
    runner = native.build(progress=lambda line: print(line, file=sys.stderr))
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
    python = setup(
        dict(
            model_spec="default",
            bundle=args.bundle,
            drafter=args.drafter,
            k=None,
            heads=None,
            adaptive_k=False,
            ngram_sizes=None,
            draft_confidence=None,
            max_seq_len=m.max_seq_len,
            no_chat_template=False,
            threads=0,
        ),  # fmt: skip
        max_new_tokens=args.max_new_tokens,
    )
    session, drafter = python.session, python.drafter
    config = GenerationConfig(k=python.config.k, eos_ids=tuple(m.eos_ids))
    # run_suite keeps no token ids: wrap generate's results through the harness's own rows.
    from mtp_edge.devices import harness

    results: dict[str, list] = {"plain": [], "spec": []}
    original = harness.generate

    def recording_generate(session_, ids, drafter_, cfg):
        result = original(session_, ids, drafter_, cfg)
        results["plain" if drafter_ is None else "spec"].append(result)
        return result

    harness.generate = recording_generate
    try:
        python_body = run_suite(
            session,
            lambda text: encoded[next(p.id for p in prompts if p.prompt == text)],
            drafter,
            prompts,
            config,
            args.max_new_tokens,
            args.repeat,
            progress=lambda line: print(line, file=sys.stderr),
        )
    finally:
        harness.generate = original
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

    last = slice(args.repeat - 1, None, args.repeat)  # the last repeat of each prompt
    py_rows = [
        {"ar": a.token_ids, "spec": s.token_ids, "gaps": a.top2_gaps}
        for a, s in zip(results["plain"][last], results["spec"][last], strict=True)
    ]
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
