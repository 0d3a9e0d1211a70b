"""`mtp-bench`: measure one setup here, or several side by side in worker processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mtp_edge.devices.harness import Prompt, Suite, bench_report, progress_line
from mtp_edge.devices.workers import IsolatedSetup
from mtp_edge.errors import Terminated
from mtp_edge.logs import progress_bar
from mtp_edge.runtime.assemble import LoadOptions, assemble


class Stopped(Exception):
    """The measurement was stopped (Ctrl-C, SIGTERM) after some prompts: `reports` are what was
    measured, each marked partial; `cause` is the interrupt to re-raise once they are written."""

    def __init__(self, reports: list[dict], cause: BaseException):
        super().__init__("stopped")
        self.reports, self.cause = reports, cause


def mark_partial(report: dict, done: int, total: int, cause: BaseException) -> dict:
    report["partial"] = {
        "prompts_done": done,
        "prompts": total,
        "stopped_by": "SIGINT" if isinstance(cause, KeyboardInterrupt) else _signal_name(cause),
    }
    return report


def partial_markdown(report: dict) -> str:
    """The Markdown report of an interrupted run, saying so first."""
    from mtp_edge.devices.harness import to_markdown

    p = report["partial"]
    note = (
        f"**Partial**: stopped by {p['stopped_by']} after {p['prompts_done']} of "
        f"{p['prompts']} prompts; the figures cover those prompts only.\n\n"
    )
    return note + to_markdown(report)


def _signal_name(cause: BaseException) -> str:
    import signal

    return signal.Signals(cause.signum).name if isinstance(cause, Terminated) else "interrupt"


def bench(
    setups: list[LoadOptions],
    prompts: list[Prompt],
    repeat: int,
    max_new_tokens: int | None,
    command: str,
    progress: Callable[[str], None],
    peer: bool = True,
    after_prompt: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Each setup's report. One setup runs here; several run in a worker process each
    (devices/workers.py: runtimes in one process slow each other down), prompt by prompt in
    turn so that machine drift hits all alike. Interrupted after at least one prompt, it raises
    `Stopped` with the reports of the prompts done (no peer baselines: they take minutes).
    `peer` False leaves the peer baselines out of the finished reports too. `after_prompt`
    is called with the first setup's row after every prompt (the llama.cpp peer's rounds)."""
    if len(setups) == 1:
        gen = assemble(setups[0])
        suite = Suite(gen.config.k, repeat)
        try:
            with progress_bar(len(prompts), "prompts", unit="prompt") as bar:
                for i, p in enumerate(prompts):
                    row = suite.run_prompt(
                        gen.session, gen.encode, gen.drafter, p, gen.config, max_new_tokens
                    )
                    progress(f"[{i + 1}/{len(prompts)}] {progress_line(row)}")
                    bar.update(1)
                    if after_prompt is not None:
                        after_prompt(row)
        except (KeyboardInterrupt, Terminated) as cause:
            done = len(suite.rows)
            if done == 0:
                raise
            report = bench_report(
                gen, suite, command, prompts[:done], max_new_tokens, progress, peer=False
            )
            raise Stopped([mark_partial(report, done, len(prompts), cause)], cause) from None
        return [bench_report(gen, suite, command, prompts, max_new_tokens, progress, peer)]
    runs = []
    try:
        for options in setups:
            runs.append(IsolatedSetup(options, repeat, max_new_tokens))
        try:
            with progress_bar(len(prompts) * len(runs), "prompts", unit="run") as bar:
                for i, p in enumerate(prompts):
                    rows = []
                    for run in runs:
                        rows.append(run.run_prompt(p))
                        progress(f"[{i + 1}/{len(prompts)}] {run.label}: {progress_line(rows[-1])}")
                        bar.update(1)
                    if after_prompt is not None:
                        after_prompt(rows[0])
        except (KeyboardInterrupt, Terminated) as cause:
            if len(runs) < len(setups):
                raise
            # Each worker reports over the prompts it measured (one may still be measuring the
            # prompt it was sent when the stop came: it finishes it first).
            reports = [run.report(command, peer=False) for run in runs]
            if any(report is None for report in reports):
                raise
            for run, report in zip(runs, reports, strict=True):
                mark_partial(report, run.done, len(prompts), cause)
            raise Stopped(reports, cause) from None
        return _reports_sharing_peers(runs, setups, command, peer)
    finally:
        for run in runs:
            run.close()


def _reports_sharing_peers(runs, setups: list[LoadOptions], command: str, peer: bool) -> list:
    """Each worker's report, the ExecuTorch TextLLMRunner peer measured once per target program:
    setups that differ only in their drafter (a bundle and its copies with other heads, one
    bundle at several floors) decode the same .pte, and the peer takes minutes a setup."""
    reports, measured = [], {}
    for run, options in zip(runs, setups, strict=True):
        key = _peer_key(options) if peer else None
        first = measured.get(key) if key is not None else None
        report = run.report(command, peer and first is None)
        if first is not None and report is not None and "peer_textllmrunner" in first[1]:
            report["peer_textllmrunner"] = {
                **first[1]["peer_textllmrunner"],
                "shared_with": first[0],
            }
        elif key is not None and report is not None:
            measured[key] = (run.label, report)
        reports.append(report)
    return reports


def _peer_key(options: LoadOptions) -> tuple | None:
    """What the TextLLMRunner peer of a setup decodes: the bundle's target program and tokenizer
    (by their sha256) and whether prompts are chat-wrapped. None: not a bundle, or unreadable
    (its own worker then measures, or reports why not)."""
    if not options.bundle:
        return None
    from mtp_edge.manifest import Manifest, sha256

    try:
        bundle = Path(options.bundle)
        target = Manifest.load(bundle, verify=False).models["target"].sha256
        return (target, sha256(bundle / "tokenizer.json"), options.chat)
    except Exception:
        return None
