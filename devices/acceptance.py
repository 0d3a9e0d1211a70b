"""A drafter's acceptance, measured by greedy speculative decoding: what the quality report
compares before quantization (eager fp32 target and drafter) and after it (the exported bundle).
"""

from __future__ import annotations

import torch

from mtp_edge.logs import progress_bar
from mtp_edge.runtime.loop import GenerationConfig, generate, tau_of
from mtp_edge.runtime.session import Session


def measure_acceptance(
    session: Session,
    drafter,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    desc: str = "acceptance",
) -> dict:
    """Acceptance rate, tau and acceptance per draft position over greedy runs of `prompts`."""
    drafted = accepted = generated = steps = 0
    per_position_drafted = [0] * k
    per_position_accepted = [0] * k
    for prompt in progress_bar(desc=desc, unit="prompt", iterable=prompts):
        stats = generate(session, prompt, drafter, GenerationConfig(max_new_tokens, k)).stats
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
        generated += stats.step_tokens  # the first token comes from the prefill
        steps += stats.verify_steps
        for i, (d, a) in enumerate(
            zip(stats.drafted_per_position, stats.accepted_per_position, strict=True)
        ):
            if i < k:
                per_position_drafted[i] += d
                per_position_accepted[i] += a
    return {
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tau": round(tau_of(generated, steps), 4),
        "acceptance_per_position": [
            round(a / d, 4) if d else 0.0
            for a, d in zip(per_position_accepted, per_position_drafted, strict=True)
        ],
    }


ACCEPTANCE_PROMPTS, ACCEPTANCE_TOKENS = 6, 48  # held-out snippets x tokens each


def measure_bundle_acceptance(directory, target, draft, heldout: list[int], progress) -> dict:
    """The export quality report's drafter entry: acceptance when the eager fp32 target and
    drafter decode held-out text greedily, and when the exported bundle does (same prompts,
    same k). `target` is the LoadedModel exported, `draft` what its drafter was made from (the
    MTP head or the draft LoadedModel), `heldout` the held-out text's tokens."""
    from mtp_edge.runtime.assemble import build_drafter
    from mtp_edge.runtime.backends import backend
    from mtp_edge.runtime.bundle import open_bundle, target_session
    from mtp_edge.runtime.session import EagerSession

    bundle = open_bundle(directory)
    m = bundle.manifest
    kind, k = m.drafter.kind, m.drafter.k
    if kind == "none" or not backend(m.backend).available():
        return {}
    # 64-token snippets and 48 new tokens, or less where the bundle's context is shorter.
    length = min(64, m.max_seq_len // 2)
    new_tokens = min(ACCEPTANCE_TOKENS, m.max_seq_len - length - k - 1)
    if new_tokens < 1:
        return {}
    progress(f"[quality] {kind} drafter acceptance")
    prompts = [heldout[i * 256 : i * 256 + length] for i in range(ACCEPTANCE_PROMPTS)]
    seq_len = length + new_tokens + k + 1
    # The drafter alone, as exported: no prompt lookup before it, no confidence floor.
    after = build_drafter(kind, None, bundle, m.max_seq_len)
    report = {
        "prompts": f"{ACCEPTANCE_PROMPTS} held-out snippets of {length} tokens, "
        f"{new_tokens} greedy tokens each, k={k}",
        "exported": measure_acceptance(
            target_session(bundle), after, prompts, k, new_tokens, "acceptance, exported"
        ),
    }
    if target.model is None or any(
        type(p) is not torch.nn.Parameter for p in target.model.parameters()
    ):
        # The export quantized the target as it read it: no float model to compare with, and
        # torchao's eager kernels would take minutes per prompt.
        report["fp32"] = "not measured: the float target was never held (quantized while loading)"
        return {"drafter_acceptance": report}
    before = build_drafter(kind, target, None, seq_len, loaded=draft)
    eager = EagerSession(target.model, seq_len)
    fp32 = measure_acceptance(eager, before, prompts, k, new_tokens, "acceptance, fp32")
    return {"drafter_acceptance": {"prompts": report["prompts"], "fp32": fp32, **report}}
