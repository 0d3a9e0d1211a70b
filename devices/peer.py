"""The peer baseline: ExecuTorch's own TextLLMRunner decoding our target .pte, plain and greedy.

It is what a user of ExecuTorch's tools gets from the same program, so it keeps our own plain
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
