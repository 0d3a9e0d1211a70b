"""mtp-train's writer and labeller on each eager path (fp32, int8) on this machine, next to the
path the run's probe chooses: tokens/s of batched writing (--gen-batch rows, greedy) and of
labelling (one teacher-forced sequence at a time), each on a fixed, small amount of
work (a machine shared with other jobs: the paths' ratio is the result, not the rates).

    python benchmarks/train_paths.py [-m MODEL] [--gen-batch 8] [--prompt-tokens 16] [--steps 4]
        [--label-tokens 32] [--json OUT] [--markdown OUT]

The goal it checks: the chosen path within 1.2x of the fastest one measured here.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time

import click
import torch

from mtp_edge.checkpoints import load_model
from mtp_edge.train import Sequence, generate_batch, int8_writer, label_sequences
from mtp_edge.train.corpus import kinded_prompts
from mtp_edge.train.engines import PROBE_LABEL_ROWS, choose, probe_paths


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
    return (
        f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs, "
        f"flags: {' '.join(f for f in wanted if f in flags) or 'none of ' + '/'.join(wanted)}"
    )


def writing_rate(model, prompts, steps: int) -> float:
    """Tokens/s of writing `prompts` together for `steps` tokens each, prefills included."""
    began = time.perf_counter()
    outs = generate_batch(model, prompts, steps, [])
    return sum(map(len, outs)) / (time.perf_counter() - began)


def labelling_rate(model, sequences) -> float:
    label_sequences(model, sequences[:1])  # sizes the cache
    began = time.perf_counter()
    label_sequences(model, sequences)
    return sum(len(s.tokens) for s in sequences) / (time.perf_counter() - began)


@click.command()
@click.option("-m", "--model", default="default")
@click.option("--prompt-tokens", default=16, help="Tokens of each prompt written from.")
@click.option("--steps", default=4, help="Tokens each row writes.")
@click.option("--label-tokens", default=32, help="Tokens of the sequence labelled.")
@click.option("--gen-batch", default=8, help="Rows written together.")
@click.option("--json", "json_out", default=None)
@click.option("--markdown", default=None)
def main(model, prompt_tokens, steps, label_tokens, gen_batch, json_out, markdown):
    loaded = load_model(model)
    target = loaded.model.requires_grad_(False)
    tok = loaded.tokenizer
    stream = kinded_prompts(777)
    prompts = [tok.encode_prompt(next(stream)[1])[:prompt_tokens] for _ in range(gen_batch)]
    text = (tok.encode(next(stream)[1]) for _ in range(100))
    sequences = [Sequence(next(ids for ids in text if len(ids) >= label_tokens)[:label_tokens], 0)]
    began = time.perf_counter()
    probe = {}
    for role, rows in (("writer", gen_batch), ("labeller", PROBE_LABEL_ROWS)):
        measured = probe_paths(target, rows)
        probe[role] = {"measured_ms_per_token": {k: v * 1e3 for k, v in measured.items()}}
        probe[role]["chosen"], probe[role]["why"] = choose(measured)
    probe_s = time.perf_counter() - began
    print(f"probe {probe_s:.1f} s: {json.dumps(probe)}", flush=True)
    rates = {}
    for path in ("fp32", "int8"):
        model_ = target if path == "fp32" else int8_writer(target)
        with torch.inference_mode():
            write = writing_rate(model_, prompts, steps)
            label = labelling_rate(model_, sequences)
        rates[path] = {"writer_tok_s": round(write, 2), "labeller_tok_s": round(label, 2)}
        print(path, rates[path], flush=True)
    result = {"model": loaded.name, "cpu": cpu(), "threads": torch.get_num_threads(),
              "gen_batch": gen_batch, "probe_s": round(probe_s, 2), "probe": probe,
              "rates": rates}  # fmt: skip
    lines = [
        f"# mtp-train's writer and labeller paths: {loaded.name}",
        "",
        f"Machine: {result['cpu']}; torch threads {result['threads']}; shared with other jobs.",
        f"Probe ({probe_s:.1f} s): writer -> {probe['writer']['chosen']} "
        f"({probe['writer']['why']}); labeller -> {probe['labeller']['chosen']} "
        f"({probe['labeller']['why']}).",
        "",
        f"| path | writer tok/s (batch {gen_batch}) | labeller tok/s |",
        "|---|---|---|",
    ]
    for path, r in rates.items():
        lines.append(f"| {path} | {r['writer_tok_s']} | {r['labeller_tok_s']} |")
    for role, key in (("writer", "writer_tok_s"), ("labeller", "labeller_tok_s")):
        best = max(r[key] for r in rates.values())
        chosen = rates[probe[role]["chosen"]][key]
        result[f"{role}_chosen_vs_fastest"] = round(best / max(chosen, 1e-9), 3)
        lines.append(
            f"\n{role}: the chosen path ({probe[role]['chosen']}) is {best / chosen:.2f}x from "
            "the fastest measured (goal: <= 1.2x)."
        )
    print("\n".join(lines))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2)
    if markdown:
        with open(markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
