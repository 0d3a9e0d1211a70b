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
    tokens after `depth` tokens of context, `threads` threads, `repetitions` timed runs.

    Returns {"tokens_per_s", "stddev", "seconds", "tokens", "depth", "new_tokens", "threads",
    "build", "command"} or {"error": why}: the peer is optional and never stops the benchmark."""
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
        samples = [float(ns) for ns in row.get("samples_ns") or [row["avg_ns"]] * repetitions]
    except (ValueError, StopIteration, KeyError, TypeError):
        return {"error": f"llama.cpp's {tool.name} printed no token-generation result"}
    return {
        "tokens_per_s": round(speed, 3),
        "stddev": round(spread, 3),
        "seconds": sum(samples) / 1e9,
        "tokens": new_tokens * len(samples),
        "depth": depth,
        "new_tokens": new_tokens,
        "threads": threads,
        "build": f"{row.get('build_commit', '?')} ({row.get('build_number', '?')})",
        "command": " ".join(command),
    }


def llama_cpp_source(
    bundle: str | None, directory: str | None, gguf: str | None, model: str | None = None
):
    """What the llama.cpp peer decodes with: (llama-bench, the GGUF: `gguf`, else the one the
    bundle was exported from, else `model` when it is a GGUF file or the default model), or
    {"note": why} when it is skipped, or None where nothing names a GGUF (a model directory
    without --gguf). A --gguf that names no file is a user error, raised before anything is
    measured."""
    from mtp_edge.errors import UserError
    from mtp_edge.manifest import Manifest

    if gguf is not None and not Path(gguf).is_file():
        raise UserError(f"--gguf {gguf} does not exist: give the GGUF file the bundle was "
                        "exported from")  # fmt: skip
    if gguf is None and bundle is None:
        if model == "default":
            from mtp_edge.checkpoints import default_model_path

            gguf = str(default_model_path())
        elif model is not None and Path(model).is_file() and model.endswith(".gguf"):
            gguf = model
        else:
            return None
    tool = find_llama_bench(directory)
    if tool is None:
        return {"note": "llama.cpp not measured: no llama-bench on PATH (give --llama-cpp DIR)"}
    if gguf is None:
        source = Manifest.load(bundle, verify=False).source
        if source is None:
            return {"note": "llama.cpp not measured: the bundle does not record its source "
                    "model (exported before it did): give --gguf"}  # fmt: skip
        if source.get("format") != "gguf":
            return {"note": f"llama.cpp not measured: the bundle was exported from "
                    f"{source['path']}, not a GGUF file: give --gguf"}  # fmt: skip
        gguf = source["path"]
        if not Path(gguf).is_file():
            return {"note": f"llama.cpp not measured: the bundle's source {gguf} is not there "
                    "(moved or deleted): give --gguf"}  # fmt: skip
    return tool, Path(gguf)


class LlamaCppRounds:
    """The llama.cpp peer timed prompt by prompt, right after our setups decoded the prompt:
    llama-bench generates as many tokens as our plain decoding did, after as many tokens of
    context as the prompt has. Where the host's speed drifts within a run (a neighbour on the
    VM, the clock, another job) both sides of the comparison see the same drift; timed once at
    the end, llama.cpp alone saw the host's state then (ratios moved by 0.2 between runs)."""

    def __init__(self, tool: Path, gguf: Path, threads: int, repetitions: int = 1):
        self.tool, self.gguf, self.threads, self.repetitions = tool, gguf, threads, repetitions
        self.runs: list[dict] = []
        self.error: str | None = None

    def after(self, row: dict) -> dict | None:
        """Time llama.cpp on the shape of the prompt whose first setup's row is `row`; the run,
        or None once llama.cpp has failed (the first failure is reported, not retried)."""
        if self.error is not None:
            return None
        new_tokens = max(row["ar_tokens"] - 1, 1)  # as our plain rate: after the first token
        run = llama_cpp_baseline(
            self.tool, self.gguf, self.threads, new_tokens, row["prompt_tokens"], self.repetitions
        )
        if "error" in run:
            self.error = run["error"]
            return None
        self.runs.append(run)
        return run

    def result(self) -> dict:
        """{"tokens_per_s" (all tokens over all seconds, as our plain rate), "stddev" (of the
        prompts' rates), "prompts", "depth" and "new_tokens" (means), "threads", "build",
        "interleaved", "tokens_per_s_by_prompt", "command" (the first prompt's)} or
        {"error": why}."""
        import statistics

        if self.error is not None:
            return {"error": self.error}
        if not self.runs:
            return {"error": "llama.cpp was not timed: no prompt was measured"}
        # one rate a prompt, so that the list lines up with the report's prompts
        rates = [r["tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0 for r in self.runs]
        seconds = sum(r["seconds"] for r in self.runs)
        n = len(self.runs)
        return {
            "tokens_per_s": round(sum(r["tokens"] for r in self.runs) / seconds, 3)
            if seconds > 0
            else 0.0,
            "stddev": round(statistics.stdev(rates), 3) if len(rates) > 1 else 0.0,
            "prompts": n,
            "depth": round(sum(r["depth"] for r in self.runs) / n),
            "new_tokens": round(sum(r["new_tokens"] for r in self.runs) / n),
            "threads": self.threads,
            "build": self.runs[0]["build"],
            "interleaved": True,
            # prompt by prompt, in the suite's order: beside our rows, a paired comparison
            "tokens_per_s_by_prompt": [round(r, 3) for r in rates],
            "command": self.runs[0]["command"],
        }
