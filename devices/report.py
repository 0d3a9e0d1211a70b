"""`mtp-bench --report DIR`: a Markdown page with PNG plots, the machine, and the command.

One or several bench reports (`--compare`) go side by side: speedup and tau per category,
acceptance by draft position, plain vs speculative tokens/s per prompt, time to first token.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from mtp_edge.devices.catalog import host_device
from mtp_edge.devices.harness import llama_peer_line
from mtp_edge.files import atomic_directory


def machine_description() -> dict:
    """CPU, cores, RAM and memory bandwidth (measured now), and the library versions."""
    from importlib.metadata import version

    import torch

    host = host_device()
    return {
        "cpu": host.soc,
        "cores": os.cpu_count(),
        "ram_gb": host.ram_gb,
        "memory_bandwidth_gbs": host.bandwidth_gbs,
        "int8_matmul_gops": host.cpu_int8_gops,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "executorch": version("executorch"),
        "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads(),
    }


def label(report: dict) -> str:
    name = Path(report.get("bundle") or report.get("model") or "?").name
    fallback = ", no fallback" if report.get("fallback") is False else ""
    return f"{name} ({report.get('drafter')}, k={report.get('k')}{fallback})"


def write_report(out_dir: str | Path, reports: list[dict], command: str, machine: dict) -> Path:
    """Write report.md, report.json and the PNGs into `out_dir` (via a temporary directory,
    renamed into place, so an interrupted run leaves no half report)."""
    out = Path(out_dir)
    with atomic_directory(out, suffix="") as tmp:
        plots = make_plots(tmp, reports)
        (tmp / "report.json").write_text(
            json.dumps({"machine": machine, "command": command, "runs": reports}, indent=2) + "\n"
        )
        (tmp / "report.md").write_text(markdown(reports, command, machine, plots))
    return out / "report.md"


def make_plots(directory: Path, reports: list[dict]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    files = {}
    names = [label(r) for r in reports]
    width = 0.8 / len(reports)

    # 1. speedup and tau per category
    categories = sorted({c for r in reports for c in r["per_category"]})
    x = np.arange(len(categories))
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for i, (r, name) in enumerate(zip(reports, names, strict=True)):
        pc = r["per_category"]
        for ax, key in zip(axes, ("speedup", "tau"), strict=True):
            values = [pc.get(c, {}).get(key, 0) for c in categories]
            ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_ylabel("speedup (spec / plain tok/s)")
    axes[1].set_ylabel("tau (tokens per verify)")
    axes[1].set_xticks(x, categories, rotation=20)
    axes[0].legend(fontsize=8)
    axes[0].set_title("Speedup and tau per category (medians over the category's prompts)")
    files["category"] = _save(fig, directory / "speedup_tau_by_category.png")

    # 2. acceptance by draft position
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, name in zip(reports, names, strict=True):
        acc = r["summary"]["acceptance_by_position"]
        ax.plot(range(1, len(acc) + 1), [a or 0 for a in acc], marker="o", label=name)
    ax.set_xticks(range(1, max(len(r["summary"]["acceptance_by_position"]) for r in reports) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (kept / drafted)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position")
    ax.legend(fontsize=8)
    files["acceptance"] = _save(fig, directory / "acceptance_by_position.png")

    # 3. tokens/s per prompt and 4. time to first token: one colour per run, plain as a bar
    # marker, speculative as a dot, runs side by side around each prompt.
    ids = [row["id"] for row in reports[0]["prompts"]]
    x = np.arange(len(ids))
    for key, (plain_key, spec_key, ylabel, title, name) in {
        "tokens": (
            "ar_tokens_per_s",
            "spec_tokens_per_s",
            "decode tokens/s",
            "Plain vs speculative decoding speed per prompt",
            "tokens_per_s_per_prompt.png",
        ),
        "ttft": (
            "ttft_ms_ar",
            "ttft_ms_spec",
            "time to first token (ms)",
            "Time to first token (prefill) per prompt",
            "ttft_per_prompt.png",
        ),
    }.items():
        fig, ax = plt.subplots(figsize=(max(8, len(ids) * 0.45), 4.5))
        for i, (r, run) in enumerate(zip(reports, names, strict=True)):
            rows = {row["id"]: row for row in r["prompts"]}
            xs = x + (i - (len(reports) - 1) / 2) * 0.25
            color = f"C{i}"
            for field, marker, size, what in (
                (plain_key, "_", 12, "plain"),
                (spec_key, "o", 5, "speculative"),
            ):
                values = [rows[p].get(field, np.nan) if p in rows else np.nan for p in ids]
                ax.plot(xs, values, marker, color=color, ms=size, mew=2, label=f"{what}, {run}")
        llama = llama_by_prompt(reports[0]) if key == "tokens" else None
        if llama is not None:
            ax.plot(x, llama, "x", color="black", ms=6, mew=1.5, label="llama.cpp plain, same GGUF")
        ax.set_xticks(x, ids, rotation=90, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
        files[key] = _save(fig, directory / name)
    return files


def llama_by_prompt(report: dict) -> list[float] | None:
    """llama.cpp's rate on each of the report's prompts, where it was timed beside them."""
    rates = (report.get("peer_llama_cpp") or {}).get("tokens_per_s_by_prompt")
    return rates if rates and len(rates) == len(report["prompts"]) else None


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def markdown(reports: list[dict], command: str, machine: dict, plots: dict[str, str]) -> str:
    lines = [
        "# mtp-bench report",
        "",
        f"Command: `{command}`",
        "",
        "## Machine",
        "",
        f"- CPU: {machine['cpu']}, {machine['cores']} cores; threads used: {machine['threads']}",
        f"- RAM: {machine['ram_gb']} GB; memory read bandwidth measured now: "
        f"{machine['memory_bandwidth_gbs']} GB/s; int8 matmul: {machine['int8_matmul_gops']} Gop/s",
        f"- {machine['os']}, Python {machine['python']}, torch {machine['torch']}, "
        f"ExecuTorch {machine['executorch']}",
        "",
        "## Summary",
        "",
        "| run | prompts | plain tok/s | spec tok/s | speedup | tau | acceptance "
        "| verify/decode | draft/decode | TTFT plain / spec ms | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        s = r["summary"]
        lines.append(
            f"| {label(r)} | {s['prompts']} | {_spread(s, 'ar_tokens_per_s')} | "
            f"{_spread(s, 'spec_tokens_per_s')} | {_spread(s, 'speedup', 'x')} | {s['tau']:.2f} | "
            f"{s['acceptance_rate']:.2f} | {s['verify_over_decode']:.2f} | "
            f"{s['draft_over_decode']:.3f} | {s['ttft_ms_ar']:.0f} / {s['ttft_ms_spec']:.0f} | "
            f"{'yes' if s['lossless'] else 'NO'} ({s['divergences']} divergences, "
            f"{s['near_tie_divergences']} near-ties) |"
        )
    if any("spread" in r["summary"] for r in reports):
        lines += [
            "",
            f"Medians over {reports[0]['summary'].get('repeats')} passes over the suite; "
            "[min–max] across passes.",
        ]
    if len(reports) > 1:
        lines += [
            "",
            "The runs were interleaved prompt by prompt (plain, then speculative, for each "
            "bundle in turn), so machine drift affects all alike.",
        ]
    lines += [
        "",
        "## Plots",
        "",
        f"![speedup and tau per category]({plots['category']})",
        "",
        f"![acceptance by draft position]({plots['acceptance']})",
        "",
        f"![tokens/s per prompt]({plots['tokens']})",
        "",
        f"![time to first token]({plots['ttft']})",
        "",
    ]
    for r in reports:
        lines += [
            f"## Per category: {label(r)}",
            "",
            "| category | prompts | plain tok/s | spec tok/s | speedup | tau | identical |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, c in r["per_category"].items():
            lines.append(
                f"| {name} | {c['prompts']} | {c['ar_tokens_per_s']:.1f} | "
                f"{c['spec_tokens_per_s']:.1f} | {c['speedup']:.2f}x | {c['tau']:.2f} | "
                f"{c['identical']}/{c['prompts']} |"
            )
        peer = r.get("peer_textllmrunner")
        if peer:
            lines += [
                "",
                "Peer baseline, ExecuTorch TextLLMRunner on the same target .pte (plain): "
                + (f"{peer['tokens_per_s']:.1f} tok/s" if "error" not in peer else peer["error"]),
            ]
        llama = llama_peer_line(r)
        if llama:
            lines += ["", llama]
        lines.append("")
    return "\n".join(lines)


def _spread(summary: dict, key: str, unit: str = "") -> str:
    value = f"{summary[key]:.2f}{unit}" if unit else f"{summary[key]:.1f}"
    spread = summary.get("spread", {}).get(key)
    if spread:
        value += f" [{spread['min']:.2f}–{spread['max']:.2f}]"
    return value
