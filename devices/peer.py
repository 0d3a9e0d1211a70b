"""The peer baselines, plain and greedy: ExecuTorch's own TextLLMRunner decoding our target .pte,
and llama.cpp's llama-bench decoding the GGUF the bundle was exported from (`--llama-cpp`).

They are what a user of those tools gets from the same model, so they keep our own plain
decoding honest: our Python loop should not be slower than the vendor's C++ runner.
"""

from __future__ import annotations

from pathlib import Path


def textllmrunner_baseline(pte: Path, tokenizer_json: Path, prompts: list[tuple[str, int]]) -> dict:
    """Decode each (prompt text, max_new_tokens) with TextLLMRunner; aggregate tokens/s.

    Returns {"tokens_per_s", "prompts", "generated_tokens"} or {"error": why} when the runner
    cannot run the program.
    """
    outputs = _forward_outputs(pte)
    if outputs != 1:
        # TextLLMRunner asserts on a second output and aborts the whole process.
        return {
            "error": f"TextLLMRunner reads single-output programs; {pte.name} returns {outputs} "
            "(logits and the hidden states the MTP drafter reads): re-export the bundle, whose "
            "forward then returns the logits alone"
        }
    try:
        import executorch.kernels.quantized  # noqa: F401  (registers the quantized kernels)
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

        from mtp_edge.runtime.executorch_ops import load_kernels

        load_kernels()  # our programs' attention op (runtime/executorch_ops.py)
        runner = TextLLMRunner(str(pte), str(tokenizer_json))
    except Exception as e:  # the runner is optional: report why it is absent, keep going
        return {"error": f"TextLLMRunner could not load {pte.name}: {e}"}
    tokens, seconds, ttft, skipped = 0, 0.0, [], 0
    for text, max_new in prompts:
        stats = []
        runner.reset()
        config = GenerationConfig(echo=False, max_new_tokens=max_new, temperature=0.0)
        try:
            runner.generate(
                text, config, token_callback=lambda _: None, stats_callback=stats.append
            )
        except UnicodeDecodeError:
            # The runner hands its callback each token's bytes as a Python str, and a token
            # holding part of a multi-byte character cannot be one: that prompt is not timed.
            skipped += 1
            continue
        except RuntimeError as e:
            return {"error": f"TextLLMRunner failed: {e}"}
        if not stats:
            skipped += 1
            continue
        s = stats[-1]
        tokens += max(s.num_generated_tokens - 1, 0)
        seconds += (s.inference_end_ms - s.first_token_ms) / 1e3
        ttft.append(s.first_token_ms - s.inference_start_ms)
    if skipped == len(prompts):
        return {"error": "TextLLMRunner could not pass any answer's text to Python (split UTF-8)"}
    return {
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else 0.0,
        "prompts": len(prompts) - skipped,
        "skipped_prompts": skipped,  # answers with a character split across tokens
        "generated_tokens": tokens + len(prompts) - skipped,
        "ttft_ms_median": sorted(ttft)[len(ttft) // 2],
    }


def _forward_outputs(pte: Path) -> int:
    from executorch.runtime import Runtime

    return Runtime.get().load_program(pte).metadata("forward").num_outputs()


# llama.cpp's benchmark tool, and where a build puts it under a llama.cpp directory.
LLAMA_BENCH = "llama-bench"
LLAMA_BENCH_PLACES = ("", "bin", "build/bin")


def find_llama_bench(directory: str | None) -> Path | None:
    """llama.cpp's llama-bench: in `directory` (or its bin/, build/bin/) when given, else on
    PATH; None when not given and not on PATH. A directory without it is a user error."""
    import os
    import shutil

    from mtp_edge.errors import UserError

    if directory is None:
        found = shutil.which(LLAMA_BENCH)
        return Path(found) if found else None
    for place in LLAMA_BENCH_PLACES:
        tool = Path(directory) / place / LLAMA_BENCH
        if tool.is_file() and os.access(tool, os.X_OK):
            return tool
    raise UserError(
        f"--llama-cpp {directory}: no executable {LLAMA_BENCH} there nor in its bin/ or "
        "build/bin/: give the directory of a llama.cpp build (cmake --build build --target "
        "llama-bench), or leave --llama-cpp out"
    )


def llama_cpp_baseline(
    tool: Path, gguf: Path, threads: int, new_tokens: int, depth: int, repetitions: int = 3
) -> dict:
    """Plain decoding of `gguf` by llama.cpp: llama-bench's token generation of `new_tokens`
    tokens after `depth` tokens of context (the suite's mean prompt length), `threads` threads.

    Returns {"tokens_per_s", "stddev", "depth", "new_tokens", "threads", "build", "command"} or
    {"error": why}: the peer is optional and never stops the benchmark."""
    import json
    import subprocess

    command = [
        str(tool), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(new_tokens),
        "-d", str(depth), "-r", str(repetitions), "-o", "json",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"llama.cpp's {tool.name} did not run: {e}"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return {"error": f"llama.cpp's {tool.name} failed on {gguf.name}: {last}"}
    try:
        rows = json.loads(done.stdout)
        row = next(r for r in rows if r.get("n_gen") == new_tokens)
        speed, spread = float(row["avg_ts"]), float(row.get("stddev_ts", 0.0))
    except (ValueError, StopIteration, KeyError, TypeError):
        return {"error": f"llama.cpp's {tool.name} printed no token-generation result"}
    return {
        "tokens_per_s": round(speed, 3),
        "stddev": round(spread, 3),
        "depth": depth,
        "new_tokens": new_tokens,
        "threads": threads,
        "build": f"{row.get('build_commit', '?')} ({row.get('build_number', '?')})",
        "command": " ".join(command),
    }


def llama_cpp_peer(
    bundle: str | None, directory: str | None, gguf: str | None, threads: int, report: dict
) -> dict:
    """The llama.cpp peer for a report: `gguf`, else the GGUF the bundle was exported from;
    {"note": why} when it is skipped."""
    from mtp_edge.errors import UserError
    from mtp_edge.manifest import Manifest

    tool = find_llama_bench(directory)
    if tool is None:
        return {"note": "llama.cpp not measured: no llama-bench on PATH (give --llama-cpp DIR)"}
    if gguf is None:
        assert bundle is not None  # the caller gives one or the other
        source = Manifest.load(bundle, verify=False).source
        if source is None:
            return {"note": "llama.cpp not measured: the bundle does not record its source "
                    "model (exported before it did): give --gguf"}  # fmt: skip
        if source.get("format") != "gguf":
            return {"note": f"llama.cpp not measured: the bundle was exported from "
                    f"{source['path']}, not a GGUF file: give --gguf"}  # fmt: skip
        gguf = source["path"]
    path = Path(gguf)
    if not path.is_file():
        raise UserError(f"--gguf {gguf} does not exist: give the GGUF file the bundle was "
                        "exported from")  # fmt: skip
    rows = report.get("prompts", [])
    depth = round(sum(r["prompt_tokens"] for r in rows) / len(rows)) if rows else 0
    new_tokens = max((r["ar_tokens"] for r in rows), default=96)
    return llama_cpp_baseline(tool, path, threads, new_tokens, depth)
