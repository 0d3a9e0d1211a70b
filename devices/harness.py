"""The measurement behind `mtp-bench`: plain vs speculative greedy decoding on one backend.

For every prompt both runs use the same session (same weights, same kernels), so the speedup is
the drafter's alone, and the outputs must be identical (lossless) or differ first at a numerical
near-tie, which the report demonstrates with the plain run's top-2 logit gap there.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.platforms import by_backend
from mtp_edge.runtime.backends import decoding_threads
from mtp_edge.runtime.drafters import Drafter
from mtp_edge.runtime.loop import (
    GenerationConfig,
    GenerationResult,
    first_divergence,
    generate,
    tau_of,
)
from mtp_edge.runtime.session import Session

# A (k+1)-token verify and single-token steps sum in different orders; in float32 through 30
# layers their logits differ by up to ~1e-3. A first divergence where the plain run's two best
# logits are closer than this is a tie broken by rounding, not a bug.
NEAR_TIE = 0.02


@dataclass
class Prompt:
    id: str
    category: str
    prompt: str
    max_new_tokens: int
    # a logged conversation of several messages (`prompt` is then its last user message)
    messages: list[dict] | None = None
    # a logged raw completion: `prompt` is the whole text the model saw, without a chat template
    raw: bool = False
    # its ids as logged, where its text does not encode back to them (mtp_edge/request_log.py)
    token_ids: list[int] | None = None

    @property
    def request(self) -> str | list[dict]:
        """What a generator encodes: the conversation where there is one, else the prompt."""
        return self.messages or self.prompt


def prompt_ids(encode: Callable, p: Prompt, vocab_size: int) -> list[int]:
    """The prompt's ids as `encode` (a Generator's, runtime/assemble.py) makes them; a logged
    raw completion as the server ran it: its logged ids, else its text without the chat
    template (`encode(..., raw=True)`), whatever the generator's chat setting."""
    if not p.raw:
        return encode(p.request)
    if p.token_ids is None:
        return encode(p.prompt, raw=True)
    if not all(0 <= i < vocab_size for i in p.token_ids):
        raise UserError(
            f"the logged raw prompt {p.id} holds token ids outside this model's vocabulary "
            f"(0..{vocab_size - 1}): bench the log with the model that served it"
        )
    return list(p.token_ids)


def is_request_log(path: Path) -> bool:
    """A folder of request logs, or a JSONL file whose first record holds "messages"."""
    if path.is_dir():
        return True
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        row = json.loads(first)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(row, dict) and "messages" in row and "id" not in row


def logged_prompts(path: Path) -> list[Prompt]:
    """A request log (mtp_edge/request_log.py) as a suite: each distinct request once, answered
    at about the length it was answered when logged (16..512 tokens). A raw completion (one
    user message marked "raw") is benched as the plain text it was, not in the chat template."""
    from mtp_edge.request_log import log_files, read_log

    if path.is_dir() and not log_files(path):
        raise UserError(
            f"{path} holds no request log (requests.jsonl files written by --log): "
            "mtp-bench --prompts takes a log folder or one .jsonl prompts file"
        )
    prompts, seen = [], set()
    for record in read_log(path):
        key = json.dumps(record.messages, sort_keys=True)  # "raw" included: another request
        users = [m["content"] for m in record.messages if m["role"] == "user"]
        if key in seen or not users or record.messages[-1]["role"] != "user":
            continue
        seen.add(key)
        length = min(max(len(record.answer_ids), 16), 512) if record.answer_ids else 128
        name = f"log-{len(prompts) + 1}"
        if len(record.messages) == 1 and record.messages[0].get("raw"):
            ids = record.messages[0].get("token_ids")
            if ids is not None and not (
                isinstance(ids, list)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            ):
                raise UserError(f'{record.where}: "token_ids" must be a list of token ids')
            if users[-1] or ids:  # a raw prompt of no text and no ids asks nothing
                prompts.append(Prompt(name, "log", users[-1], length, raw=True, token_ids=ids))
            continue
        messages = [{"role": m["role"], "content": m["content"]} for m in record.messages]
        conversation = messages if len(messages) > 1 else None
        prompts.append(Prompt(name, "log", users[-1], length, conversation))
    if not prompts:
        raise UserError(f"the request log {path} holds no request that ends with a user message")
    return prompts


FIELDS = 'expected {"id", "category", "prompt", "max_new_tokens"} per line'


def _prompt_row(line: str, where: str) -> Prompt:
    """One line of a prompts file, checked as it is read: a wrong field is the file's fault,
    named with its file:line, not an error later in the run."""
    try:
        row = json.loads(line)
    except ValueError as e:
        raise UserError(f"{where}: not a JSON line ({e}): {FIELDS}") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: not a JSON object: {FIELDS}")
    if not isinstance(row.get("id"), str | int) or isinstance(row["id"], bool):
        raise UserError(f'{where}: every prompt needs an "id" (a string naming it in the report)')
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        got = "nothing" if "prompt" not in row else json.dumps(prompt)[:60]
        raise UserError(f'{where}: "prompt" must be a non-empty string, got {got}')
    category = row.get("category", "default")
    if not isinstance(category, str) or not category:
        raise UserError(f'{where}: "category" must be a non-empty string, got {category!r}')
    n = row.get("max_new_tokens", 128)
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UserError(
            f'{where}: "max_new_tokens" must be a whole number >= 1, got {json.dumps(n)} '
            "(leave it out for 128)"
        )
    return Prompt(str(row["id"]), category, prompt, n)


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Prompts from a JSONL file ({"id", "category", "prompt", "max_new_tokens"} per line), or
    from a request log (a folder of them, or one log file); the built-in suite when no path is
    given."""
    if path is not None and Path(path).exists() and is_request_log(Path(path)):
        return logged_prompts(Path(path))
    if path is None:
        text = resources.files("mtp_edge").joinpath("prompts.jsonl").read_text(encoding="utf-8")
        where = "the built-in suite"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): save the prompts file "
                "as UTF-8"
            ) from None
        except OSError as e:
            raise UserError(f"cannot read prompts file {path}: {e.strerror}") from None
        where = str(path)
    # Lines at "\n" only, as editors number them (splitlines also splits at U+2028 and others,
    # which a JSON string may hold).
    prompts = [
        _prompt_row(line, f"{where}:{n}")
        for n, line in enumerate(text.split("\n"), 1)
        if line.strip()
    ]
    if not prompts:
        raise UserError(f"{where} holds no prompts")
    return prompts


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def _decode_tokens(result: GenerationResult) -> int:
    return max(result.stats.generated_tokens - 1, 0)


def compare_runs(plain: GenerationResult, spec: GenerationResult) -> dict:
    """Per-prompt verdict: identical, or the first divergence and whether it is a near-tie."""
    j = first_divergence(plain.token_ids, spec.token_ids)
    if j is None:
        return {"identical": True, "first_divergence": None, "top2_gap": None, "near_tie": None}
    gap = plain.top2_gaps[j] if j < len(plain.top2_gaps) else None
    near_tie = gap is not None and gap < NEAR_TIE
    return {"identical": False, "first_divergence": j, "top2_gap": gap, "near_tie": near_tie}


def run_suite(
    session: Session,
    encode: Callable[[str], list[int]],
    drafter: Drafter | None,
    prompts: list[Prompt],
    config: GenerationConfig,
    max_new_tokens: int | None = None,
    repeat: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run every prompt plain and speculative (greedy), `repeat` times; returns the report body."""
    suite = Suite(config.k, repeat)
    for i, p in enumerate(prompts):
        row = suite.run_prompt(session, encode, drafter, p, config, max_new_tokens)
        if progress:
            progress(f"[{i + 1}/{len(prompts)}] {progress_line(row)}")
    return suite.body()


def progress_line(row: dict) -> str:
    return (
        f"{row['id']}: plain {row['ar_tokens_per_s']:.1f} tok/s, "
        f"spec {row['spec_tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}, "
        f"{'identical' if row['identical'] else 'DIFFERS'}"
    )


class Suite:
    """Accumulates prompt results into the report body, one prompt at a time, so that callers
    can interleave several bundles prompt by prompt (`mtp-bench --compare`)."""

    def __init__(self, k: int, repeat: int = 1):
        self.k, self.repeat = k, repeat
        self.rows: list[dict] = []
        # per repeat pass: decode tokens and seconds of plain and speculative runs
        self.passes = [
            {"ar_tokens": 0, "ar_s": 0.0, "spec_tokens": 0, "spec_s": 0.0} for _ in range(repeat)
        ]
        self.steps = self.drafted = self.accepted = 0
        self.step_tokens = 0  # what the speculative verify steps gave (tau's numerator)
        self.drafted_steps = self.fallback_steps = 0
        self.accepted_pos = [0] * k
        self.drafted_pos = [0] * k
        self.ttft_ar: list[float] = []
        self.ttft_spec: list[float] = []
        # The plain and speculative results of the last prompt's last pass (their token ids).
        self.last_runs: tuple[GenerationResult, GenerationResult] | None = None

    def run_prompt(self, session, encode, drafter, p: Prompt, config, max_new_tokens=None) -> dict:
        ids = prompt_ids(encode, p, session.vocab_size)
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens or p.max_new_tokens,
            k=config.k,
            adaptive_k=config.adaptive_k,
            fallback=config.fallback,
            sampling=config.sampling,
            eos_ids=config.eos_ids,
        )
        ar_rates, spec_rates = [], []
        for totals in self.passes:
            # Interleaved, so that machine drift affects both alike.
            plain = generate(session, ids, None, cfg)
            spec = generate(session, ids, drafter, cfg)
            ar_rates.append(plain.stats.decode_tokens_per_s)
            spec_rates.append(spec.stats.decode_tokens_per_s)
            totals["ar_tokens"] += _decode_tokens(plain)
            totals["ar_s"] += plain.stats.decode_seconds
            totals["spec_tokens"] += _decode_tokens(spec)
            totals["spec_s"] += spec.stats.decode_seconds
            self.ttft_ar.append(plain.stats.ttft_ms)
            self.ttft_spec.append(spec.stats.ttft_ms)
        self.last_runs = (plain, spec)
        s = spec.stats
        self.steps += s.verify_steps
        self.step_tokens += s.step_tokens
        self.drafted += s.drafted_tokens
        self.accepted += s.accepted_tokens
        self.drafted_steps += s.drafted_steps
        self.fallback_steps += s.fallback_steps
        for j in range(self.k):
            if j < len(s.accepted_per_position):
                self.accepted_pos[j] += s.accepted_per_position[j]
            if j < len(s.drafted_per_position):
                self.drafted_pos[j] += s.drafted_per_position[j]
        row = {
            "id": p.id,
            "category": p.category,
            "prompt_tokens": len(ids),
            "ar_tokens": plain.stats.generated_tokens,
            "spec_tokens": s.generated_tokens,
            "ar_tokens_per_s": round(statistics.median(ar_rates), 3),
            "spec_tokens_per_s": round(statistics.median(spec_rates), 3),
            "speedup": round(_rate(statistics.median(spec_rates), statistics.median(ar_rates)), 4),
            "tau": round(s.tau, 4),
            "acceptance_rate": round(s.acceptance_rate, 4),
            "verify_steps": s.verify_steps,
            "step_tokens": s.step_tokens,
            "drafted_steps": s.drafted_steps,
            "fallback_steps": s.fallback_steps,
            "draft_ms_per_step": round(s.draft_seconds * 1e3 / max(s.verify_steps, 1), 4),
            "verify_ms_per_step": round(s.verify_seconds * 1e3 / max(s.verify_steps, 1), 4),
            "ar_ms_per_step": round(
                plain.stats.verify_seconds * 1e3 / max(plain.stats.verify_steps, 1), 4
            ),
            "ttft_ms_ar": round(statistics.median(self.ttft_ar[-self.repeat :]), 3),
            "ttft_ms_spec": round(statistics.median(self.ttft_spec[-self.repeat :]), 3),
            "stop_reason_ar": plain.stop_reason,
            "stop_reason_spec": spec.stop_reason,
            **compare_runs(plain, spec),
        }
        if self.repeat > 1:
            row["ar_tokens_per_s_runs"] = [round(r, 3) for r in ar_rates]
            row["spec_tokens_per_s_runs"] = [round(r, 3) for r in spec_rates]
        self.rows.append(row)
        return row

    def body(self) -> dict:
        rows = self.rows
        ar_step = statistics.median(r["ar_ms_per_step"] for r in rows)
        verify_step = statistics.median(r["verify_ms_per_step"] for r in rows)
        draft_step = statistics.median(r["draft_ms_per_step"] for r in rows)
        ar_runs = [_rate(t["ar_tokens"], t["ar_s"]) for t in self.passes]
        spec_runs = [_rate(t["spec_tokens"], t["spec_s"]) for t in self.passes]
        ar, sp = statistics.median(ar_runs), statistics.median(spec_runs)
        divergent = [r for r in rows if not r["identical"]]
        summary = {
            "prompts": len(rows),
            "lossless": all(r["near_tie"] for r in divergent),
            "divergences": len(divergent),
            "near_tie_divergences": sum(1 for r in divergent if r["near_tie"]),
            "near_tie_tolerance": NEAR_TIE,
            "ar_tokens_per_s": round(ar, 3),
            "spec_tokens_per_s": round(sp, 3),
            "speedup": round(_rate(sp, ar), 4),
            "tau": round(tau_of(self.step_tokens, self.steps), 4),
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            # speculative steps that verified drafts, and those the fallback kept plain
            "drafted_steps": self.drafted_steps,
            "fallback_steps": self.fallback_steps,
            "verify_steps": self.steps,
            "acceptance_by_position": [
                round(a / d, 4) if d else None
                for a, d in zip(self.accepted_pos, self.drafted_pos, strict=True)
            ],
            # What speculation costs per step, against one plain decoding step (medians):
            "ar_ms_per_step": round(ar_step, 4),
            "verify_ms_per_step": round(verify_step, 4),
            "verify_over_decode": round(_rate(verify_step, ar_step), 4),
            "draft_ms_per_step": round(draft_step, 4),
            "draft_over_decode": round(_rate(draft_step, ar_step), 4),
            "ttft_ms_ar": round(statistics.median(self.ttft_ar), 3),
            "ttft_ms_spec": round(statistics.median(self.ttft_spec), 3),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
        if self.repeat > 1:
            # Each pass over the suite is one measurement; the headline is their median.
            speedups = [_rate(s, a) for a, s in zip(ar_runs, spec_runs, strict=True)]
            summary["repeats"] = self.repeat
            summary["spread"] = {
                name: {
                    "min": round(min(v), 4),
                    "max": round(max(v), 4),
                    "runs": [round(x, 4) for x in v],
                }
                for name, v in (
                    ("ar_tokens_per_s", ar_runs),
                    ("spec_tokens_per_s", spec_runs),
                    ("speedup", speedups),
                )
            }
        return {"summary": summary, "per_category": per_category(rows), "prompts": rows}


def per_category(rows: list[dict]) -> dict:
    out = {}
    for category in sorted({r["category"] for r in rows}):
        group = [r for r in rows if r["category"] == category]
        ar = statistics.median(r["ar_tokens_per_s"] for r in group)
        sp = statistics.median(r["spec_tokens_per_s"] for r in group)
        out[category] = {
            "prompts": len(group),
            "ar_tokens_per_s": round(ar, 3),
            "spec_tokens_per_s": round(sp, 3),
            "speedup": round(statistics.median(r["speedup"] for r in group), 4),
            "tau": round(statistics.median(r["tau"] for r in group), 4),
            "identical": sum(r["identical"] for r in group),
        }
    return out


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 / (1024 if sys.platform == "darwin" else 1)


def to_markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        f"# mtp-bench: {report.get('bundle') or report.get('model')}",
        "",
        f"backend **{report.get('backend')}**, drafter **{report.get('drafter')}**, "
        f"k={report.get('k')}, draft confidence floor {report.get('draft_confidence', 0)}, "
        f"{_fallback_words(report)}{s['prompts']} prompts, greedy",
        "",
        "| plain tok/s | speculative tok/s | speedup | tau | acceptance | verify/decode "
        "| draft/decode | lossless |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['ar_tokens_per_s']:.1f} | {s['spec_tokens_per_s']:.1f} | {s['speedup']:.2f}x "
        f"| {s['tau']:.2f} | {s['acceptance_rate']:.2f} | {s['verify_over_decode']:.2f} "
        f"| {s['draft_over_decode']:.3f} | {s['lossless']} "
        f"({s['divergences']} divergences, {s['near_tie_divergences']} near-ties) |",
        "",
        "| category | prompts | plain tok/s | spec tok/s | speedup | tau | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in report["per_category"].items():
        lines.append(
            f"| {name} | {c['prompts']} | {c['ar_tokens_per_s']:.1f} | "
            f"{c['spec_tokens_per_s']:.1f} | {c['speedup']:.2f}x | {c['tau']:.2f} | "
            f"{c['identical']}/{c['prompts']} |"
        )
    peer = report.get("peer_textllmrunner")
    if peer:
        lines += [
            "",
            "Peer baseline, ExecuTorch TextLLMRunner on the same target .pte (plain): "
            + (f"{peer['tokens_per_s']:.1f} tok/s" if "error" not in peer else peer["error"])
            + (f" (measured once, with {peer['shared_with']})" if "shared_with" in peer else ""),
        ]
    llama = llama_peer_line(report)
    if llama:
        lines += ["", llama]
    note = _int8_note(report)
    if note:
        lines += ["", note]
    if report.get("command"):
        lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def llama_peer_line(report: dict) -> str | None:
    """The report's llama.cpp peer in a line (the terminal's table and `--report`'s page)."""
    llama = report.get("peer_llama_cpp")
    if not llama:
        return None
    if "tokens_per_s" in llama:
        ratio = report["summary"]["ar_tokens_per_s"] / llama["tokens_per_s"]
        text = (
            f"{llama['tokens_per_s']:.1f} tok/s; our plain decoding {ratio:.2f}x it (timed prompt "
            f"by prompt beside ours): +-{llama['stddev']:.1f}, llama-bench on each of "
            f"{llama['prompts']} prompts' length and context timed right after ours decoded it "
            f"(means {llama['new_tokens']} and {llama['depth']}), {llama['threads']} threads, "
            f"build {llama['build']}" + (f"; {llama['note']}" if "note" in llama else "")
        )
    else:
        text = llama.get("error") or llama.get("note", "")
    return "Peer baseline, llama.cpp on the same GGUF (plain): " + text


def _int8_note(report: dict) -> str | None:
    """When this CPU's int8 path made the verifications dear (mtp_edge/machine.py): ExecuTorch
    bundles, whose linear layers run XNNPACK's 8-bit GEMMs on this machine's CPU."""
    from mtp_edge.machine import int8_bottleneck_note

    ratio = report["summary"].get("verify_over_decode")
    if not ratio or report.get("backend") != "executorch" or not report.get("bundle"):
        return None
    from mtp_edge.manifest import Manifest

    try:
        quant = Manifest.load(report["bundle"], verify=False).models["target"].quant
    except Exception:  # a report re-read without its bundle: no note
        return None
    return int8_bottleneck_note(ratio) if str(quant.get("scheme")).startswith("8da") else None


def _fallback_words(report: dict) -> str:
    """How often the fallback kept a speculative step plain, for the report's header."""
    if "fallback" not in report:
        return ""  # a report from before the fallback, or from the native runner
    if report["fallback"] is False:
        return "fallback off, "
    s = report["summary"]
    return (
        f"fallback on ({s['fallback_steps']} of {s['verify_steps']} steps kept plain, "
        f"{s['drafted_steps']} drafted), "
    )


def _target_sha256(bundle: str) -> str:
    from mtp_edge.manifest import Manifest

    return Manifest.load(bundle, verify=False).models["target"].sha256


def bench_report(
    gen, suite: Suite, command: str, prompts, max_new_tokens, progress, peer: bool = True
) -> dict:
    """One setup's mtp-bench report (`gen`: runtime/assemble.py's Generator); for an ExecuTorch
    bundle with ExecuTorch's TextLLMRunner decoding the same .pte as the peer baseline (unless
    `peer` is False: a report of an interrupted run)."""

    report = {
        "bundle": gen.bundle,
        # What identifies the bundle measured wherever it is later moved or copied, and not a
        # bundle re-exported in place (mtp-predict --from-bench checks it)
        **({"target_sha256": _target_sha256(gen.bundle)} if gen.bundle is not None else {}),
        "model": gen.name,
        "backend": gen.session.name,
        "drafter": "none" if gen.drafter is None else gen.drafter.name,
        "k": gen.config.k,
        "draft_confidence": gen.draft_confidence,
        "fallback": gen.config.fallback is not False,  # on unless turned off: it runs greedy
        "threads": decoding_threads(gen.session.name),
        "command": command,
        **suite.body(),
    }
    row = by_backend(gen.session.name)
    if peer and gen.bundle is not None and row is not None and row.textllmrunner_peer:
        from mtp_edge.devices.peer import textllmrunner_baseline

        progress("[peer] ExecuTorch TextLLMRunner, plain decoding of the same target .pte")
        bundle_dir = Path(gen.bundle)
        runs = [
            (p.prompt if p.raw else gen.render(p.request), max_new_tokens or p.max_new_tokens)
            for p in prompts
        ]
        report["peer_textllmrunner"] = textllmrunner_baseline(
            bundle_dir / "target.pte", bundle_dir / "tokenizer.json", runs
        )
    return report
