"""Which platform's 8da8w (per-channel) logits are off: ARM64 (qemu) or x86?

For a few prompts of the built-in suite, the last-row logits after prefill of the bundle's
target.pte from `mtp-logits` on x86 and on ARM64 under qemu, against two references run
eagerly in PyTorch on the same tokens: the model quantized exactly as the exporter does it
(exportable_copy: torchao int8 per-token dynamic activations x per-channel int8 weights, 8-bit
embedding, the export attention and norms) before lowering, and the float32 model. Prints and
writes OUT.md / OUT.json: max |difference| and top-2 tokens of each pair.

    python benchmarks/arm64_reference.py --bundle /tmp/default-android \
        --prompt math-01 --prompt translation-01 --out /tmp/arm64_reference
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from mtp_edge.checkpoints import load_model
from mtp_edge.devices.harness import load_prompts
from mtp_edge.exporter.executorch import export_program, exportable_copy
from mtp_edge.manifest import Manifest
from mtp_edge.quantize.schemes import QuantScheme
from mtp_edge.runtime import native_runner
from mtp_edge.runtime.assemble import LoadOptions, assemble

SYSROOT = "/usr/aarch64-linux-gnu"
DEVICE_DIR = native_runner.SOURCE_DIR / "build-arm64" / "device"


def program_logits(command: list[str], spec: dict, out: Path) -> np.ndarray:
    """The last row of a prefill of each session, from mtp-logits."""
    subprocess.run([*command, str(out)], input=json.dumps(spec), text=True, check=True,
                   stdout=subprocess.DEVNULL, timeout=3600)  # fmt: skip
    return np.fromfile(out, dtype="<f4").reshape(len(spec["sessions"]), -1)


def eager_logits(model, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids]), torch.tensor([0]))
    return logits[0, -1].float().numpy()


def nudged(model, seed: int = 0):
    """`model` with its embedding output scaled by 1 +- 2^-23 per element (fixed signs): a
    float32 rounding-sized change, to show how far such noise alone carries the logits."""
    generator = torch.Generator().manual_seed(seed)

    def hook(_module, _inputs, output):
        signs = torch.randint(0, 2, output.shape, generator=generator) * 2 - 1
        return output * (1 + signs * 2.0**-23)

    model.embed_tokens.register_forward_hook(hook)
    return model


def top2(row: np.ndarray) -> list:
    first, second = np.argsort(row)[::-1][:2]
    return [int(first), int(second), round(float(row[first] - row[second]), 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--model", default="default", help="the checkpoint the bundle came from")
    parser.add_argument("--prompt", action="append", required=True, help="prompt id (repeat)")
    parser.add_argument("--cpu", default="max,sme=off", help="qemu-aarch64 -cpu")
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="export and compare the model cut to its first N layers instead of "
        "the bundle's target.pte (the same scheme): less error compounding",
    )
    parser.add_argument(
        "--nudges",
        type=int,
        default=0,
        help="also count, over N nudged copies (seeds 1..N), how many land within "
        "1e-3 of x86's and of ARM64's logits",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    manifest = Manifest.load(args.bundle)
    quant = manifest.models["target"].quant
    by_id = {p.id: p for p in load_prompts()}
    encode = assemble(LoadOptions(bundle=args.bundle, drafter="none")).encode
    tokens = {i: encode(by_id[i].prompt) for i in args.prompt}

    work = Path(tempfile.mkdtemp(prefix="arm64-reference-"))
    fp32 = load_model(args.model).model.float().eval()
    program = Path(args.bundle) / "target.pte"
    if args.layers:
        fp32.layers = fp32.layers[: args.layers]
        program = work / f"target-{args.layers}-layers.pte"
        print(f"[export] {args.layers} layer(s), {quant['scheme']}", file=sys.stderr)
        export_program(fp32, program, quant=quant["scheme"], group_size=quant["group_size"],
                       embedding_quant=quant["embedding"], max_seq_len=manifest.max_seq_len,
                       max_chunk=manifest.max_chunk, bos_id=manifest.bos_id,
                       eos_ids=list(manifest.eos_ids),
                       attention_kernel=quant["attention"])  # fmt: skip
    spec = {
        "program": str(program), "max_seq_len": manifest.max_seq_len,
        "max_chunk": manifest.max_chunk, "vocab": manifest.vocab_size, "row_exact": True,
        "sessions": [[{"tokens": tokens[i], "start": 0, "prefill": True}] for i in args.prompt],
    }  # fmt: skip
    print("[x86] mtp-logits", file=sys.stderr)
    x86 = program_logits([str(native_runner.BUILD_DIR / "mtp-logits")], spec, work / "x86.f32")
    print(f"[arm64] mtp-logits under qemu-aarch64 -cpu {args.cpu}", file=sys.stderr)
    qemu = ["qemu-aarch64", "-cpu", args.cpu, "-L", SYSROOT, str(DEVICE_DIR / "mtp-logits")]
    arm = program_logits(qemu, spec, work / "arm64.f32")

    print("[eager] quantized and float32 references", file=sys.stderr)
    torch.set_num_threads(1)
    scheme = QuantScheme(quant["scheme"], quant["group_size"], quant["embedding"])
    quantized = exportable_copy(fp32, scheme, manifest.max_seq_len, quant["attention"])
    noisy = nudged(exportable_copy(fp32, scheme, manifest.max_seq_len, quant["attention"]))
    fp32.setup_cache(manifest.max_seq_len)

    rows = []
    for n, i in enumerate(args.prompt):
        logits = {
            "x86": x86[n], "arm64": arm[n],
            "eager_q": eager_logits(quantized, tokens[i]),
            "eager_q_nudged": eager_logits(noisy, tokens[i]), "fp32": eager_logits(fp32, tokens[i]),
        }  # fmt: skip
        pairs = [("x86", "eager_q"), ("arm64", "eager_q"), ("x86", "arm64"),
                 ("eager_q", "eager_q_nudged"), ("x86", "fp32"), ("arm64", "fp32"),
                 ("eager_q", "fp32")]  # fmt: skip
        rows.append({
            "prompt": i, "tokens": len(tokens[i]),
            "max_logit": round(float(np.abs(logits["eager_q"]).max()), 3),
            "max_abs_diff": {f"{a}-{b}": round(float(np.abs(logits[a] - logits[b]).max()), 6)
                             for a, b in pairs},
            "mean_abs_diff": {f"{a}-{b}": round(float(np.abs(logits[a] - logits[b]).mean()), 6)
                              for a, b in pairs},
            "top2": {name: top2(row) for name, row in logits.items()},
        })  # fmt: skip
    for seed in range(1, args.nudges + 1):
        copy = exportable_copy(fp32, scheme, manifest.max_seq_len, quant["attention"])
        nudged(copy, seed)
        for n, (i, row) in enumerate(zip(args.prompt, rows, strict=True)):
            row_logits = eager_logits(copy, tokens[i])
            counts = row.setdefault("nudges_equal", {"x86": 0, "arm64": 0, "of": args.nudges})
            counts["x86"] += bool(np.abs(row_logits - x86[n]).max() < 1e-3)
            counts["arm64"] += bool(np.abs(row_logits - arm[n]).max() < 1e-3)
    command = " ".join(["python", "benchmarks/arm64_reference.py", *sys.argv[1:]])
    result = {"bundle": args.bundle, "layers": args.layers or "all", "quant": quant,
              "cpu": args.cpu, "command": command, "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    pairs = list(r["rows"][0]["max_abs_diff"])
    nudges = "nudges_equal" in r["rows"][0]
    lines = [
        f"Layers: {r['layers']}. Each cell: max / mean |difference| of the last-row logits.",
        "",
        "| prompt | tokens | max logit | "
        + " | ".join(pairs)
        + " | top-2 (id, id, gap): x86 / ARM64 / eager quantized / nudged / fp32 |"
        + (" nudged copies equal to x86 / ARM64 |" if nudges else ""),
        "|---|---|---|" + "---|" * len(pairs) + "---|" + ("---|" if nudges else ""),
    ]
    for row in r["rows"]:
        tops = " / ".join(
            str(tuple(row["top2"][k]))
            for k in ("x86", "arm64", "eager_q", "eager_q_nudged", "fp32")
        )
        diffs = " | ".join(f"{row['max_abs_diff'][p]} / {row['mean_abs_diff'][p]}" for p in pairs)
        counts = row.get("nudges_equal")
        extra = f" {counts['x86']} / {counts['arm64']} of {counts['of']} |" if counts else ""
        lines.append(
            f"| {row['prompt']} | {row['tokens']} | {row['max_logit']} | {diffs} | {tops} |{extra}"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
