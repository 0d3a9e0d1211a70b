"""Time to first token of a chat turn: with the conversation's KV cache kept (only the new turn is
prefilled) vs a fresh prefill of the whole conversation, on the same model.

A conversation of several turns is built from the model's own greedy answers. At each turn t >= 2
the time from the call to the first streamed chunk is measured twice: right after turn t-1 (the
cache holds the conversation so far) and after `reset()` (nothing cached). Each number is the
median of --repeats runs; the prompt, cached and prefilled token counts are exact.

    python benchmarks/chat_ttft.py --model default --threads 2 \
        --out benchmarks/results/runtimes/chat_ttft
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import mtp_edge

SYSTEM = "You are a concise assistant who explains things to programmers."
QUESTIONS = [
    "What is a KV cache in a transformer, and why does it make decoding faster? Give the idea "
    "in a few sentences, then one concrete example with numbers for a small model.",
    "And what happens to that cache when the conversation gets a new user message?",
    "How much memory does it take for a 135M-parameter model with a 2048-token context?",
    "Summarize everything we discussed in three bullet points.",
]


def first_chunk_ms(llm, messages) -> tuple[float, object]:
    """Milliseconds from the call to the first chunk of the answer (the stream is then closed)."""
    start = time.perf_counter()
    stream = llm.stream_chat(messages, max_new_tokens=2)
    chunk = next(stream)
    elapsed = (time.perf_counter() - start) * 1e3
    stream.close()
    return elapsed, chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/runtimes/chat_ttft")
    args = parser.parse_args()

    llm = mtp_edge.load(args.model, bundle=args.bundle, drafter=args.drafter, threads=args.threads)
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for turn, question in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": question})
        if turn > 1:
            kept, fresh = [], []
            for _ in range(args.repeats):
                llm.reset()  # rebuild the cache of the conversation so far, as turn t-1 left it
                llm.chat(messages[:-2], max_new_tokens=args.answer_tokens)
                ms, reused = first_chunk_ms(llm, messages)
                kept.append(ms)
                llm.reset()
                ms, whole = first_chunk_ms(llm, messages)
                fresh.append(ms)
            row = {
                "turn": turn,
                "prompt_tokens": reused.prompt_tokens,
                "cached_tokens": reused.cached_tokens,
                "prefilled_tokens": reused.prompt_tokens - reused.cached_tokens,
                "ttft_ms_kept_cache": round(statistics.median(kept), 1),
                "ttft_ms_fresh": round(statistics.median(fresh), 1),
                "fresh_prefilled_tokens": whole.prompt_tokens - whole.cached_tokens,
            }
            row["speedup"] = round(row["ttft_ms_fresh"] / row["ttft_ms_kept_cache"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        llm.reset()
        answer = llm.chat(messages, max_new_tokens=args.answer_tokens)
        messages.append({"role": "assistant", "content": answer.text})

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": llm.name,
        "bundle": args.bundle,
        "drafter": llm.generator.drafter.name if llm.generator.drafter else "none",
        "backend": llm.generator.session.name,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine
        "answer_tokens": args.answer_tokens,
        "repeats": args.repeats,
        "turns": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"Chat TTFT, {llm.name} on {report['backend']} ({report['drafter']} drafter), median of "
        f"{args.repeats}, {report['threads']} threads on {report['cores']} cores (load average "
        f"{report['load_average_1m_at_end']} at the end: absolute times vary with it, both columns "
        "alike)",
        "",
        "| turn | prompt tokens | cached | prefilled | TTFT kept cache (ms) | TTFT fresh (ms) | "
        "speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
            f"{r['prefilled_tokens']} | {r['ttft_ms_kept_cache']} | {r['ttft_ms_fresh']} | "
            f"{r['speedup']}x |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
