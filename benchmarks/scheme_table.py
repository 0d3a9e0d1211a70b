"""Scheme x T table: what one ExecuTorch/XNNPACK forward call of the default model costs for each
quantization scheme and call width T, and what that gives plain and speculative decoding.

Speculation pays only where verifying k+1 tokens costs about one decoding step, so the number
that matters is verify(T) / decode(1), measured here at a realistic position (after a prefill).
All programs are loaded at once and measured round-robin, so that load from other processes on
the machine falls on every scheme alike. Each program has the row-exact `verify` method for 5
tokens, and calls of 2..16 tokens go through it as in decoding (windows of 5), so the T >= 2
columns are what a verification costs, exactness included.

    python benchmarks/scheme_table.py [--threads 2] [--rounds 40] [--work DIR] [--schemes A,B]

`--work DIR` keeps the exported .pte files there and reuses them on the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mtp_edge.checkpoints import load_model
from mtp_edge.devices.harness import load_prompts
from mtp_edge.exporter.executorch import export_program
from mtp_edge.quantize.quality import perplexity
from mtp_edge.runtime.drafters import NgramDrafter
from mtp_edge.runtime.executorch_session import ExecuTorchSession
from mtp_edge.runtime.loop import GenerationConfig, first_divergence, generate
from mtp_edge.runtime.session import EagerSession, prefill
from mtp_edge.texts import heldout_text

WIDTHS = (1, 2, 5, 8, 16)
PREFILL = 64  # tokens in the cache when the widths are timed
HELDOUT_TOKENS = 1024
MAX_SEQ_LEN, MAX_CHUNK = 2048, 128
RESULTS = Path(__file__).parent / "results/verification"
QUIET = 0.1  # most cores' worth of CPU other processes may use during a kept measurement


@dataclass
class Scheme:
    name: str
    quant: str
    group_size: int
    embedding: str = "8w"
    head: str | None = None  # LM head scheme (None: as the other linears)
    head_group: int | None = None


SCHEMES = [
    Scheme("fp32", "fp32", 0, "none"),
    Scheme("8da4w g32", "8da4w", 32),
    Scheme("8da4w g64", "8da4w", 64),
    Scheme("8da4w channelwise", "8da4w", 0),
    Scheme("8da8w channelwise", "8da8w", 0),
    Scheme("8da4w g32, head 8da8w cw", "8da4w", 32, head="8da8w", head_group=0),
    Scheme("8da4w cw, head 8da8w cw", "8da4w", 0, head="8da8w", head_group=0),
]
# Schemes that cannot be offered with ExecuTorch 1.5.1 / torchao 0.18 on this machine, and why.
NOT_AVAILABLE = {
    "int8 / int4 weight-only": "XnnpackPartitioner lowers the linear but drops the weight "
    "dequantization (logits off by ~400); outside XNNPACK: `Missing out variants: "
    "{'torchao::dequantize_affine'}`",
    "8da8w per-group": "XNNPACK lowering: `Only 4b group quantization is supported`",
    "torchao low-bit kernels (intx_packing_format=opaque_torchao_*)": "`TorchAO kernel "
    "library is not loaded` (not built for x86 in torchao 0.18; the ExecuTorch 1.5.1 wheel "
    "registers no torchao::_linear_8bit_act_* kernels either)",
    "KleidiAI (opaque_aten_kleidiai)": "`requires torch.backends.kleidiai.is_available()`: "
    "Arm only",
}


def export_all(schemes: list[Scheme], work: Path, lm) -> dict[str, dict]:
    info = {}
    for s in schemes:
        path = work / (s.name.replace(" ", "_").replace(",", "") + ".pte")
        if not path.exists():
            print(f"[export] {s.name}", flush=True)
            tmp = path.with_suffix(".partial")
            export_program(
                lm.model,
                tmp,
                quant=s.quant,
                group_size=s.group_size,
                embedding_quant=s.embedding,
                max_seq_len=MAX_SEQ_LEN,
                max_chunk=MAX_CHUNK,
                bos_id=lm.tokenizer.bos_id,
                eos_ids=list(lm.tokenizer.eos_ids),
                head_quant=s.head,
                head_group_size=s.head_group,
                verify_width=5,
                progress=lambda m: print(f"  {m}", flush=True),
            )
            tmp.rename(path)
        info[s.name] = {"path": path, "size_mb": round(path.stat().st_size / 1e6, 1)}
    return info


class OutsideLoad:
    """CPU time that other processes used since `reset` (Linux /proc), in cores.

    The machine is shared: a measurement taken while someone else computes says nothing about
    the scheme, so such rounds are repeated instead of averaged in.
    """

    def __init__(self):
        self.reset()

    @staticmethod
    def _read() -> tuple[float, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7))  # user nice system irq softirq steal
        own = sum(
            int(x) for x in Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[11:13]
        )
        return (busy - own) / os.sysconf("SC_CLK_TCK"), time.perf_counter()

    def reset(self) -> None:
        self.start = self._read()

    def cores(self) -> float:
        (other0, t0), (other1, t1) = self.start, self._read()
        return (other1 - other0) / (t1 - t0)


def time_widths(sessions: dict, context: list[int], rounds: int) -> tuple[dict, int]:
    """Median ms of forward(T tokens at position PREFILL) over `rounds` quiet rounds, each
    round-robin over schemes and widths; also returns how many rounds were thrown away."""
    for session in sessions.values():
        prefill(session, context[:PREFILL])
        for _ in range(3):  # warm caches and thread pools
            session.forward(context[PREFILL : PREFILL + 1], PREFILL)
    samples = {(name, t): [] for name in sessions for t in WIDTHS}
    load, kept, dropped = OutsideLoad(), 0, 0
    while kept < rounds and dropped < 20 * rounds:
        load.reset()
        times = {}
        for name, session in sessions.items():
            for t in WIDTHS:
                start = time.perf_counter()
                session.forward(context[PREFILL : PREFILL + t], PREFILL)
                times[(name, t)] = time.perf_counter() - start
        if load.cores() > QUIET:
            dropped += 1
            continue
        kept += 1
        for key, seconds in times.items():
            samples[key].append(seconds)
        print(f"[time] {kept}/{rounds} quiet rounds ({dropped} dropped)", end="\r", flush=True)
    print()
    medians = {
        name: {t: statistics.median(samples[(name, t)]) * 1e3 for t in WIDTHS} for name in sessions
    }
    return medians, dropped


def decode_speed(sessions: dict, prompts: list[list[int]], new_tokens: int) -> dict[str, dict]:
    """Plain and n-gram speculative greedy decoding per scheme, prompts interleaved; a pair of
    runs disturbed by other processes is run again (up to 5 times)."""
    totals = {name: {"ar": [0, 0.0], "spec": [0, 0.0], "peak": 0.0, "tau": []} for name in sessions}
    lossless = {name: True for name in sessions}
    config = GenerationConfig(max_new_tokens=new_tokens, k=4)
    load = OutsideLoad()
    for prompt in prompts:
        for name, session in sessions.items():
            for _ in range(5):
                load.reset()
                plain = generate(session, prompt, None, config)
                spec = generate(session, prompt, NgramDrafter(), config)
                if load.cores() <= QUIET:
                    break
            j = first_divergence(plain.token_ids, spec.token_ids)
            lossless[name] &= j is None  # verify rows are bitwise single steps: no tolerance
            for key, result in (("ar", plain), ("spec", spec)):
                totals[name][key][0] += result.stats.generated_tokens - 1
                totals[name][key][1] += result.stats.decode_seconds
            totals[name]["peak"] = max(totals[name]["peak"], plain.stats.decode_tokens_per_s)
            totals[name]["tau"].append(spec.stats.tau)
    return {
        name: {
            "plain_tokens_per_s": round(t["ar"][0] / t["ar"][1], 1),
            "peak_plain_tokens_per_s": round(t["peak"], 1),
            "ngram_spec_tokens_per_s": round(t["spec"][0] / t["spec"][1], 1),
            "ngram_tau": round(statistics.mean(t["tau"]), 2),
            "lossless": lossless[name],
        }
        for name, t in totals.items()
    }


def to_markdown(report: dict) -> str:
    lines = [
        "# Scheme x T: one forward call of SmolLM2-135M on ExecuTorch / XNNPACK",
        "",
        f"{report['threads']} threads, cache of {MAX_SEQ_LEN}, calls at position {PREFILL}; "
        f"median of {report['rounds']} round-robin rounds (a shared 2-core machine: "
        f"{report['rounds_dropped_for_outside_load']} more rounds were dropped because other "
        f"processes used over {QUIET} of a core meanwhile).",
        "",
        "| scheme | .pte MB | T=1 | T=2 | T=5 | T=8 | T=16 | plain tok/s (peak) "
        "| ngram spec tok/s (tau) | spec lossless | perplexity (x fp32) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fp32_ppl = report["perplexity_fp32"]
    for name, row in report["schemes"].items():
        ms = row["ms"]
        ratios = " | ".join(f"{ms[str(t)] / ms['1']:.2f}x" for t in WIDTHS[1:])
        d = row["decode"]
        lines.append(
            f"| {name} | {row['size_mb']:.0f} | {ms['1']:.2f} ms | {ratios} "
            f"| {d['plain_tokens_per_s']:.0f} ({d['peak_plain_tokens_per_s']:.0f}) "
            f"| {d['ngram_spec_tokens_per_s']:.0f} ({d['ngram_tau']:.2f}) "
            f"| {'yes' if d['lossless'] else 'NO'} "
            f"| {row['perplexity']:.2f} ({row['perplexity'] / fp32_ppl:.3f}) |"
        )
    lines += ["", "Not offered:", ""]
    lines += [f"- {name}: {why}" for name, why in NOT_AVAILABLE.items()]
    lines += ["", "Reproduce:", "", f"    {report['command']}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8, help="suite prompts for decode speed")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--work", type=Path, help="keep and reuse the .pte files here")
    parser.add_argument("--schemes", help="comma-separated scheme names (default: all)")
    parser.add_argument(
        "--out", default="scheme_x_T", help="results/verification/<OUT>.json and .md"
    )
    args = parser.parse_args()
    schemes = SCHEMES
    if args.schemes:
        wanted = [name.strip() for name in args.schemes.split(",")]
        schemes = [s for s in SCHEMES if s.name in wanted]
        unknown = set(wanted) - {s.name for s in schemes}
        if unknown:
            raise SystemExit(f"unknown schemes {sorted(unknown)}: {[s.name for s in SCHEMES]}")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    lm = load_model("default")
    work = args.work or Path(tempfile.mkdtemp(prefix="scheme-table-"))
    work.mkdir(parents=True, exist_ok=True)
    info = export_all(schemes, work, lm)
    vocab = lm.config.vocab_size
    sessions = {
        name: ExecuTorchSession(i["path"], MAX_SEQ_LEN, vocab, MAX_CHUNK)
        for name, i in info.items()
    }
    suite = load_prompts()
    by_category = {p.category: p for p in suite}  # the last prompt of each category
    prompts = [lm.tokenizer.encode_prompt(p.prompt) for p in list(by_category.values())]
    context = [t for p in prompts for t in p]
    print(f"[time] widths {WIDTHS} x {len(sessions)} schemes", flush=True)
    ms, dropped = time_widths(sessions, context, args.rounds)
    print(f"[decode] {args.prompts} prompts x {len(sessions)} schemes, plain and ngram", flush=True)
    decode = decode_speed(sessions, prompts[: args.prompts], args.new_tokens)
    heldout = lm.tokenizer.encode(heldout_text())[:HELDOUT_TOKENS]
    print(f"[quality] perplexity on {len(heldout)} held-out tokens", flush=True)
    ppl = {name: perplexity(run.forward, heldout, MAX_CHUNK) for name, run in sessions.items()}
    eager = EagerSession(lm.model.float(), MAX_SEQ_LEN, MAX_CHUNK)
    ppl_fp32 = perplexity(eager.forward, heldout, MAX_CHUNK)

    report = {
        "model": lm.name,
        "threads": args.threads,
        "rounds": args.rounds,
        "position": PREFILL,
        "max_seq_len": MAX_SEQ_LEN,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rounds_dropped_for_outside_load": dropped,
        "perplexity_fp32": round(ppl_fp32, 3),
        "command": "python benchmarks/scheme_table.py "
        f"--threads {args.threads} --rounds {args.rounds} --prompts {args.prompts} "
        f"--new-tokens {args.new_tokens}"
        + (f" --schemes '{args.schemes}' --out {args.out}" if args.schemes else ""),
        "schemes": {
            name: {
                "settings": {k: v for k, v in asdict(scheme).items() if k != "name"},
                "size_mb": info[name]["size_mb"],
                "ms": {str(t): round(v, 3) for t, v in ms[name].items()},
                "verify_over_decode": {
                    str(t): round(v / ms[name][1], 3) for t, v in ms[name].items()
                },
                "decode": decode[name],
                "perplexity": round(ppl[name], 3),
            }
            for name, scheme in zip(sessions, schemes, strict=True)
        },
        "not_available": NOT_AVAILABLE,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = to_markdown(report)
    (RESULTS / f"{args.out}.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
