"""A drafter's acceptance, measured by greedy speculative decoding: what the quality report
compares before quantization (eager fp32 target and drafter) and after it (the exported bundle).
"""

from __future__ import annotations

from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.session import Session


def measure_acceptance(
    session: Session, drafter, prompts: list[list[int]], k: int, max_new_tokens: int
) -> dict:
    """Acceptance rate, tau and acceptance per draft position over greedy runs of `prompts`."""
    drafted = accepted = generated = steps = 0
    per_position_drafted = [0] * k
    per_position_accepted = [0] * k
    for prompt in prompts:
        stats = generate(session, prompt, drafter, GenerationConfig(max_new_tokens, k)).stats
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
        generated += stats.generated_tokens - 1  # the first token comes from the prefill
        steps += stats.verify_steps
        for i, (d, a) in enumerate(
            zip(stats.drafted_per_position, stats.accepted_per_position, strict=True)
        ):
            if i < k:
                per_position_drafted[i] += d
                per_position_accepted[i] += a
    return {
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tau": round(generated / steps, 4) if steps else 0.0,
        "acceptance_per_position": [
            round(a / d, 4) if d else 0.0
            for a, d in zip(per_position_accepted, per_position_drafted, strict=True)
        ],
    }
