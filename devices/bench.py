"""`mtp-bench`: measure one setup here, or several side by side in worker processes."""

from __future__ import annotations

from collections.abc import Callable

from mtp_edge.devices.harness import Prompt, Suite, bench_report, progress_line
from mtp_edge.devices.isolated import IsolatedSetup
from mtp_edge.logs import progress_bar
from mtp_edge.runtime.assemble import LoadOptions, assemble


def bench(
    setups: list[LoadOptions],
    prompts: list[Prompt],
    repeat: int,
    max_new_tokens: int | None,
    command: str,
    progress: Callable[[str], None],
) -> list[dict]:
    """Each setup's report. One setup runs here; several run in a worker process each
    (devices/isolated.py: runtimes in one process slow each other down), prompt by prompt in
    turn so that machine drift hits all alike."""
    if len(setups) == 1:
        gen = assemble(setups[0])
        suite = Suite(gen.config.k, repeat)
        with progress_bar(len(prompts), "prompts", unit="prompt") as bar:
            for i, p in enumerate(prompts):
                row = suite.run_prompt(
                    gen.session, gen.encode, gen.drafter, p, gen.config, max_new_tokens
                )
                progress(f"[{i + 1}/{len(prompts)}] {progress_line(row)}")
                bar.update(1)
        return [bench_report(gen, suite, command, prompts, max_new_tokens, progress)]
    runs = []
    try:
        for options in setups:
            runs.append(IsolatedSetup(options, repeat, max_new_tokens))
        with progress_bar(len(prompts) * len(runs), "prompts", unit="run") as bar:
            for i, p in enumerate(prompts):
                for run in runs:
                    row = run.run_prompt(p)
                    progress(f"[{i + 1}/{len(prompts)}] {run.label}: {progress_line(row)}")
                    bar.update(1)
        return [run.report(command, prompts) for run in runs]
    finally:
        for run in runs:
            run.close()
