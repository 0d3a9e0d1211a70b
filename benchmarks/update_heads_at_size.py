"""A heads-only update measured on a real bundle of a larger model: the bundle exported in full
with one set of heads, then `mtp-export --update-heads` with another, timed (wall, CPU, peak
memory), its integrity checked and the updated bundle benched for losslessness.

    python benchmarks/update_heads_at_size.py -m /tmp/qwen2.5-1.5b-shaped --work DIR \
        [--prompts 8] [--max-new-tokens 24] [--out benchmarks/results/formats/heads_update_1.5b]

The model is typically one of a published shape with random weights
(benchmarks/shaped_model.py): the update's cost depends on the shapes, and a random target
still shows whether speculative output stays identical to plain. The heads are random too
(benchmarks/random_heads.py, seeds 0 and 1, shaped as mtp-train makes them). Steps, each
skipped when its output is in --work already:
1. DIR/heads-0.safetensors and DIR/heads-1.safetensors;
2. DIR/bundle: mtp-export --target android -m MODEL --heads heads-0 (the full export);
3. DIR/updated: mtp-export --update-heads DIR/bundle --heads heads-1 (always run again when
   --redo-update is given: the figure this script is for);
4. the checks: the updated manifest verified against every file's sha256, its target program
   the same bytes as the bundle's, its drafter program not, and the heads' record naming
   heads-1;
5. mtp-bench on DIR/updated over the first prompt of each category of the built-in suite:
   how many answers are identical to plain decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKS = ("every_file_matches_its_sha256", "target_program_unchanged",
          "target_program_hard_linked", "drafter_program_changed", "heads_recorded")  # fmt: skip


def bin_(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def timed(argv: list[str], log: Path) -> dict:
    """Run argv (output to `log`), with its own wall seconds, CPU seconds and peak RSS."""
    print("$ " + " ".join(map(shlex.quote, argv)), flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        process = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"error: {argv[0]} failed (exit {code}); its output: {log}")
    return {
        "command": " ".join(map(shlex.quote, argv)),
        "wall_s": round(seconds, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
    }


def suite_prompts(path: Path, max_new: int) -> int:
    """The first prompt of each category of the built-in suite, `max_new` tokens each."""
    rows, seen = [], set()
    for line in (HERE.parent / "mtp_edge" / "prompts.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["category"] not in seen:
            seen.add(row["category"])
            rows.append({**row, "max_new_tokens": max_new})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True, help="an HF directory or a .gguf file")
    parser.add_argument("--work", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--redo-update", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/formats/heads_update_1.5b")
    args = parser.parse_args()
    if not Path(args.model).exists():
        parser.error(f"{args.model}: no such file or folder")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": str(Path(args.model).resolve())}

    heads = [work / f"heads-{seed}.safetensors" for seed in (0, 1)]
    for seed, path in enumerate(heads):
        if not path.exists():
            argv = [sys.executable, str(HERE / "random_heads.py"), "-m", args.model,
                    "--seed", str(seed), "--out", str(path)]  # fmt: skip
            timed(argv, work / f"heads-{seed}.log")

    bundle, updated = work / "bundle", work / "updated"
    if not (bundle / "manifest.json").exists():
        argv = [bin_("mtp-export"), "--target", "android", "-m", args.model,
                "--heads", str(heads[0]), "-o", str(bundle)]  # fmt: skip
        result["export"] = timed(argv, work / "export.log")
    if args.redo_update and updated.exists():
        shutil.rmtree(updated)
    if not (updated / "manifest.json").exists():
        argv = [bin_("mtp-export"), "--update-heads", str(bundle), "--heads", str(heads[1]),
                "-o", str(updated)]  # fmt: skip
        result["update"] = timed(argv, work / "update.log")

    from mtp_edge.manifest import Manifest

    before = Manifest.load(bundle, verify=False)
    after = Manifest.load(updated, verify=True)  # every file against its sha256
    recipe = after.drafter.recipe
    result["checks"] = {
        "every_file_matches_its_sha256": True,
        "target_program_unchanged": after.models["target"].sha256
        == before.models["target"].sha256,
        "target_program_hard_linked": (updated / after.models["target"].file).stat().st_ino
        == (bundle / before.models["target"].file).stat().st_ino,
        "drafter_program_changed": after.models["drafter"].sha256
        != before.models["drafter"].sha256,
        "heads_recorded": recipe.get("heads_file") == heads[1].name,
        "update_stages": after.export_log.get("heads_update"),
        "target_program_gb": round((bundle / before.models["target"].file).stat().st_size / 1e9, 2),
    }

    prompts = work / "prompts.jsonl"
    count = suite_prompts(prompts, args.max_new_tokens)
    bench_json = work / "bench.json"
    argv = [bin_("mtp-bench"), "--bundle", str(updated), "--prompts", str(prompts),
            "--threads", str(args.threads), "--json", str(bench_json)]  # fmt: skip
    result["bench"] = timed(argv, work / "bench.log")
    report = json.loads(bench_json.read_text())
    result["bench"].update({
        "prompts": count,
        "identical": sum(bool(p["identical"]) for p in report["prompts"]),
        "tau": report["summary"]["tau"],
    })  # fmt: skip
    result["command"] = "python benchmarks/update_heads_at_size.py " + " ".join(
        map(shlex.quote, sys.argv[1:])
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # "heads_update_1.5b" has no suffix to replace: the extensions are appended
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = ["# Heads-only update on a real bundle", "", f"Model: `{r['model']}`", ""]
    lines += ["| step | wall s | CPU s | peak RSS GB |", "|---|---|---|---|"]
    for step in ("export", "update", "bench"):
        if step in r:
            s = r[step]
            lines.append(f"| {step} | {s['wall_s']} | {s['cpu_s']} | {s['peak_rss_gb']} |")
    c = r["checks"]
    lines += ["", f"Target program: {c['target_program_gb']} GB."]
    for key in CHECKS:
        lines.append(f"- {key.replace('_', ' ')}: {'yes' if c[key] else 'NO'}")
    stages = c.get("update_stages") or {}
    if stages.get("stages"):
        lines += ["", "The update's stages (the manifest's export_log.heads_update):", ""]
        lines += ["| stage | seconds | peak RSS MB |", "|---|---|---|"]
        for s in stages["stages"]:
            lines.append(f"| {s['stage']} | {s['seconds']} | {s.get('peak_rss_mb', '-')} |")
    b = r["bench"]
    lines += ["", f"mtp-bench on the updated bundle: {b['identical']}/{b['prompts']} answers "
              f"identical to plain decoding (tau {b['tau']:.2f}; random heads)."]  # fmt: skip
    lines += ["", "Commands:", "", "```bash", r["command"]]
    lines += [r[s]["command"] for s in ("export", "update", "bench") if s in r]
    lines += ["```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
