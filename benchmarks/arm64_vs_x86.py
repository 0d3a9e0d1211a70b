"""ARM64 (the cross-built native runner under qemu-aarch64) vs x86 (the host's native runner) on
one bundle: the same prompt ids, plain and speculative, token by token. Where the plain tokens
differ, the x86 (Python, bit-identical to the x86 runner) plain run's top-2 logit gap at the
first different token says whether it is a near-tie. Emulated: its speeds say nothing about a
phone, only the tokens count. Writes OUT.md (table + command) and OUT.json.

    python benchmarks/arm64_vs_x86.py --bundle /tmp/default-android --prompts 16 \
        --max-new-tokens 48 --out benchmarks/results/devices/arm64_vs_x86

`--kernels` instead records which int8 instructions XNNPACK runs under each qemu CPU model
(qemu's translation log, classified by encoding) into OUT_kernels.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from mtp_edge.devices.harness import NEAR_TIE, load_prompts
from mtp_edge.manifest import Manifest
from mtp_edge.runtime import native_runner
from mtp_edge.runtime.assemble import LoadOptions, assemble
from mtp_edge.runtime.loop import GenerationConfig, first_divergence, generate

SYSROOT = "/usr/aarch64-linux-gnu"
DEVICE_DIR = native_runner.SOURCE_DIR / "build-arm64" / "device"
# (mask, value) of A64 encodings of the instructions that tell XNNPACK's int8 kernels apart
ENCODINGS = {
    "sdot/udot (dot product)": [(0xBF20FC00, 0x0E809400), (0xBF20FC00, 0x2E809400),
                                (0xBFC0F400, 0x0F80E000), (0xBFC0F400, 0x2F80E000)],
    "smmla/ummla/usmmla (i8mm)": [(0xFFE0F400, 0x4E80A400), (0xFFE0FC00, 0x6E80A400)],
    "smstart/smstop (SME)": [(0xFFFFF1FF, 0xD503417F)],
    "SME outer products (smopa/fmopa...)": [(0xFE000000, 0x80000000)],
}  # fmt: skip
BYTE_LINE = re.compile(r"^0x[0-9a-f]+:\s+([0-9a-f]{8})\s+\.byte")
MNEMONIC = re.compile(r"^0x[0-9a-f]+:\s+[0-9a-f]{8}\s+(\w+)")


def runner_report(command: list[str], bundle: str, ids_file: Path, args, json_out: Path) -> dict:
    flags = ["--bundle", bundle, "--prompts", str(ids_file), "--json", str(json_out)]
    flags += ["--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    subprocess.run([*command, *flags], check=False, stdout=subprocess.DEVNULL)
    return json.loads(json_out.read_text())


def compare(args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    generator = assemble(LoadOptions(bundle=args.bundle, drafter="none"))
    prompts = load_prompts()
    by_category = collections.defaultdict(list)
    for p in prompts:
        by_category[p.category].append(p)
    per = -(-args.prompts // len(by_category))  # the same number from each category
    chosen = [p for group in by_category.values() for p in group[:per]][: args.prompts]
    encoded = {p.id: generator.encode(p.prompt) for p in chosen}
    work = Path(tempfile.mkdtemp(prefix="arm64-vs-x86-"))
    ids_file = work / "prompts.jsonl"
    rows = [{"id": p.id, "category": p.category, "prompt_ids": encoded[p.id]} for p in chosen]
    ids_file.write_text("".join(json.dumps(r) + "\n" for r in rows))

    print("[x86] native runner", file=sys.stderr)
    host_runner = str(native_runner.build())
    x86 = runner_report([host_runner], args.bundle, ids_file, args, work / "x86.json")
    print(f"[arm64] qemu-aarch64 -cpu {args.cpu}", file=sys.stderr)
    qemu = [
        "qemu-aarch64",
        "-cpu",
        args.cpu,
        "-L",
        SYSROOT,
        str(Path(args.device_dir) / "mtp-runner"),
    ]
    arm = runner_report(qemu, args.bundle, ids_file, args, work / "arm64.json")
    print("[x86] Python plain runs for the top-2 gaps", file=sys.stderr)
    m = Manifest.load(args.bundle)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_ids=tuple(m.eos_ids))
    python = [generate(generator.session, encoded[p.id], None, config) for p in chosen]

    table, same = [], 0
    for p, a, x, py in zip(chosen, arm["prompts"], x86["prompts"], python, strict=True):
        j = first_divergence(x["ar_token_ids"], a["ar_token_ids"])
        gap = None if j is None or j >= len(py.top2_gaps) else py.top2_gaps[j]
        same += j is None
        table.append({
            "id": p.id, "category": p.category, "tokens": len(x["ar_token_ids"]),
            "plain_identical": j is None, "first_divergence": j,
            "x86_top2_gap": None if gap is None else round(gap, 5),
            "near_tie": None if j is None else gap is not None and gap < NEAR_TIE,
            "python_equals_x86_runner": py.token_ids == x["ar_token_ids"],
            "arm64_spec_equals_plain": a["spec_token_ids"] == a["ar_token_ids"],
            "x86_spec_equals_plain": x["spec_token_ids"] == x["ar_token_ids"],
        })  # fmt: skip
    command = " ".join(["python", "benchmarks/arm64_vs_x86.py", *sys.argv[1:]])
    result = {
        "bundle": args.bundle, "drafter": arm["drafter"], "k": arm["k"], "cpu": args.cpu,
        "max_new_tokens": args.max_new_tokens, "command": command,
        "plain_identical": same, "prompts": len(chosen), "rows": table,
        "arm64_summary": arm["summary"], "x86_summary": x86["summary"],
    }  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    a, x = r["arm64_summary"], r["x86_summary"]
    lines = [
        "# ARM64 (qemu) vs x86: tokens of the same bundle",
        "",
        f"Bundle `{r['bundle']}`, drafter {r['drafter']} (k={r['k']}), {r['prompts']} prompts of "
        f"the built-in suite (chat template, encoded once on x86), {r['max_new_tokens']} new "
        f"tokens, ARM64 under `qemu-aarch64 -cpu {r['cpu']}`.",
        "",
        f"- plain tokens ARM64 == x86: **{r['plain_identical']}/{r['prompts']}**; of the "
        f"differences, {sum(bool(row['near_tie']) for row in r['rows'])} at a near-tie (x86 "
        f"top-2 gap < {NEAR_TIE})",
        f"- speculative == plain: ARM64 {a['prompts'] - a['divergences']}/{a['prompts']}, "
        f"x86 {x['prompts'] - x['divergences']}/{x['prompts']}",
        f"- tau: ARM64 {a['tau']:.2f}, x86 {x['tau']:.2f} (emulated speeds mean nothing)",
        "",
        "| prompt | category | tokens | ARM64 == x86 | first difference | x86 top-2 gap there "
        "| ARM64 spec == plain | x86 spec == plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        gap = "—" if row["x86_top2_gap"] is None else f"{row['x86_top2_gap']:.5f}"
        where = "—" if row["first_divergence"] is None else str(row["first_divergence"])
        lines.append(
            f"| {row['id']} | {row['category']} | {row['tokens']} | "
            f"{'yes' if row['plain_identical'] else 'no'} | {where} | {gap} | "
            f"{'yes' if row['arm64_spec_equals_plain'] else 'NO'} | "
            f"{'yes' if row['x86_spec_equals_plain'] else 'NO'} |"
        )
    return "\n".join([*lines, "", "Command:", "", "```bash", r["command"], "```", ""])


def kernels(args) -> None:
    """Which int8 instructions the runner executes under each CPU model: every block qemu
    translates is logged (-d in_asm) and the instructions its disassembler cannot name are
    classified by encoding."""
    ids = "1,2,3,4,5,6,7,8"
    lines = [
        "# XNNPACK's int8 kernels on ARM64 under qemu, by CPU model",
        "",
        f"`mtp-runner --bundle {args.bundle} --prompt-ids {ids} --max-new-tokens 8 --drafter "
        "ngram` under `qemu-aarch64 -cpu MODEL -d in_asm`: distinct translated instructions of "
        "each kind (qemu 7.2's disassembler prints them as `.byte`; classified by encoding), "
        "and the plain tokens.",
        "",
        "| -cpu | " + " | ".join(ENCODINGS) + " | smlal (NEON, no dot product) | tokens |",
        "|---|" + "---|" * (len(ENCODINGS) + 2),
    ]
    for cpu in args.cpus.split(";"):
        with tempfile.TemporaryDirectory() as tmp:
            log, report = Path(tmp) / "asm.log", Path(tmp) / "r.json"
            runner = str(Path(args.device_dir) / "mtp-runner")
            command = ["qemu-aarch64", "-cpu", cpu, "-d", "in_asm", "-D", str(log), "-L", SYSROOT]
            command += [runner, "--bundle", args.bundle, "--prompt-ids", ids, "--drafter", "ngram"]
            command += ["--max-new-tokens", "8", "--json", str(report)]
            subprocess.run(command, check=False, capture_output=True)
            counts, smlal = collections.Counter(), 0
            for text in log.read_text(errors="replace").splitlines():
                if name := MNEMONIC.match(text):
                    smlal += name.group(1) in ("smlal", "smlal2")
                if word := BYTE_LINE.match(text):
                    value = int(word.group(1), 16)
                    for kind, patterns in ENCODINGS.items():
                        if any(value & mask == bits for mask, bits in patterns):
                            counts[kind] += 1
                            break
            tokens = json.loads(report.read_text())["prompts"][0]["ar_token_ids"]
        cells = " | ".join(str(counts[k]) for k in ENCODINGS)
        lines.append(f"| `{cpu}` | {cells} | {smlal} | {tokens} |")
        print(lines[-1], file=sys.stderr)
    command = " ".join(["python", "benchmarks/arm64_vs_x86.py", *sys.argv[1:]])
    text = "\n".join([*lines, "", "Command:", "", "```bash", command, "```", ""])
    Path(args.out + "_kernels.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--device-dir", default=str(DEVICE_DIR), help="build-arm64.sh's folder")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu", default="max,sme=off", help="qemu -cpu model")
    parser.add_argument("--out", default="benchmarks/results/devices/arm64_vs_x86")
    parser.add_argument("--kernels", action="store_true", help="record the kernels per CPU")
    parser.add_argument("--cpus", default="cortex-a53;cortex-a76;max,sme=off;max")
    args = parser.parse_args()
    if not (Path(args.device_dir) / "mtp-runner").is_file():
        sys.exit(
            f"error: no ARM64 runner in {args.device_dir}: run runtime/native/cross/build-arm64.sh"
        )
    kernels(args) if args.kernels else compare(args)


if __name__ == "__main__":
    main()
