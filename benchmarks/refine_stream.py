"""Heads refined on a request stream: trained from the shipped heads on 200 requests of a
themed stream, measured on 100 requests of the same stream that training never saw, against
the shipped heads and plain decoding, side by side in one run.

    python benchmarks/refine_stream.py --work DIR [--run NAME:key=value,... ...] [--floor P ...]
        [--threads 2] [--max-new-tokens 64] [--nice] [--shipped-only]
        [--model GGUF|HF_DIR --heads HEADS] [--out benchmarks/results/drafting/refine_stream]

The target is the default model with its shipped heads unless --model names another one; then
--heads gives the heads to start from (that model's general heads, from a plain mtp-train run),
and "shipped" below means those.

The stream is adapt_stream.py's (questions about Python standard-library modules, a theme
unlike the heads' training text) with more templates, so that it holds 400 distinct requests.
The split (fixed seed): 10 of the 50 modules are kept out of training; the 200 training
requests are drawn from the other 40 modules' 320; the 100 test requests are 50 of the 120
left of those 40 modules ("seen-module": an unseen request about a module training saw) and 50
about the 10 modules training never saw ("new-module"). No test request is a training request.

Steps, each skipped when its output is in --work already (so a stopped run continues; delete a
file to redo its step):
1. the stream: DIR/train.txt (mtp-train --prompts), DIR/test.jsonl (mtp-bench --prompts);
2. per --run (default: one, "main", with RUN_SETTINGS): mtp-train --init SHIPPED_HEADS
   --prompts DIR/train.txt --prompts-share S --k K --gen-max-new N, with --minutes M or with
   fixed amounts (--steps, --gen-tokens, --raw-tokens), -o DIR/NAME/heads.safetensors; the
   target's answers are cached next to it, so a stopped run continues where it was;
3. bundles: the shipped heads' (mtp-export --target android, the README's defaults) and one per
   run: the shipped bundle with the run's heads swapped in (mtp-export --update-heads, which
   leaves the target program as it is), or a full export with --heads where the run drafts at
   another k;
4. one mtp-bench over DIR/test.jsonl: the shipped bundle, each refined bundle, and each refined
   bundle with every --floor as its draft-confidence floor, each with its own plain decoding,
   prompts interleaved;
5. --out.md and --out.json: tau, verify/decode, draft/decode, speedup, lossless count, by
   setup and by module split, the training minutes and the exact commands.

Every command runs under `nice -n 19` when --nice is given (a shared machine); its progress
goes to the terminal and to DIR/logs/. --shipped-only skips training and benches the shipped
heads' bundle alone (DIR/bench-shipped.json): the baseline, when there is no time for more.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapt_stream import MODULES, TEMPLATES  # noqa: E402

# Four more ways to ask about a module: with adapt_stream's four, 8 x 50 = 400 requests.
MORE_TEMPLATES = [
    "How do I handle errors when using Python's {m} module?",
    "Show a common mistake people make with {m} in Python and how to avoid it.",
    "Compare {m} with another way of doing the same job in Python.",
    "Write a unit test for a small function that uses Python's {m} module.",
]
ALL_TEMPLATES = TEMPLATES + MORE_TEMPLATES
NEW_MODULES = 10  # modules kept out of training
TRAIN, SEEN_TEST, NEW_TEST = 200, 50, 50
SEED = 0


def split(seed: int = SEED) -> dict:
    """The training and test requests, with the modules each part is about."""
    rng = random.Random(seed)
    modules = list(MODULES)
    rng.shuffle(modules)
    new, seen = sorted(modules[:NEW_MODULES]), sorted(modules[NEW_MODULES:])

    def requests(mods):
        out = [(m, t.format(m=m)) for m in mods for t in ALL_TEMPLATES]
        rng.shuffle(out)
        return out

    pool = requests(seen)
    train, seen_test = pool[:TRAIN], pool[TRAIN : TRAIN + SEEN_TEST]
    new_test = requests(new)[:NEW_TEST]
    assert len({r for _, r in pool + requests(new)}) == len(MODULES) * len(ALL_TEMPLATES)
    assert not {r for _, r in train} & {r for _, r in seen_test + new_test}
    return {
        "train": train,
        "test": [("seen-module", m, r) for m, r in seen_test]
        + [("new-module", m, r) for m, r in new_test],
        "seen_modules": seen,
        "new_modules": new,
    }


def write_stream(work: Path, max_new_tokens: int) -> dict:
    s = split()
    train_txt, test_jsonl = work / "train.txt", work / "test.jsonl"
    if not train_txt.exists():
        train_txt.write_text("".join(r + "\n" for _, r in s["train"]))
    if not test_jsonl.exists():
        with test_jsonl.open("w") as f:
            for i, (category, _, request) in enumerate(s["test"], 1):
                row = {"id": f"{category}-{i:03d}", "category": category, "prompt": request,
                       "max_new_tokens": max_new_tokens}  # fmt: skip
                f.write(json.dumps(row) + "\n")
    train_modules = {m for m, _ in s["train"]}
    return {
        "distinct_requests": len(MODULES) * len(ALL_TEMPLATES),
        "templates": len(ALL_TEMPLATES),
        "modules": len(MODULES),
        "train_requests": len(s["train"]),
        "train_modules": len(train_modules),
        "test_requests": len(s["test"]),
        "test_seen_module": sum(c == "seen-module" for c, _, _ in s["test"]),
        "test_new_module": sum(c == "new-module" for c, _, _ in s["test"]),
        "new_modules": s["new_modules"],
        "test_requests_in_training": len({r for _, r in s["train"]} & {r for *_, r in s["test"]}),
        "train_file": str(train_txt),
        "test_file": str(test_jsonl),
    }


# A run's settings (--run NAME:key=value,...): minutes (> 0: mtp-train --minutes, one
# wall-clock budget; 0: the fixed amounts below, which a machine shared with other work does
# not distort), share (--prompts-share), k, steps, gen (--gen-tokens: response tokens written
# in all, the stream's answers taking up to share x gen of them, template answers the rest),
# raw (--raw-tokens: offline text), max_new (--gen-max-new: the longest answer written).
RUN_SETTINGS = {"minutes": 0.0, "share": 0.85, "k": 4, "steps": 600, "gen": 24000,
                "raw": 20000, "max_new": 96, "answers": 1}  # fmt: skip


def parse_run(text: str) -> dict:
    """NAME:setting=value,... (RUN_SETTINGS' keys, each optional)."""
    name, _, settings = text.partition(":")
    run = {"name": name, **RUN_SETTINGS}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        if key not in RUN_SETTINGS:
            raise SystemExit(
                f"error: --run {text}: unknown setting {key!r} ({', '.join(RUN_SETTINGS)})"
            )
        run[key] = type(RUN_SETTINGS[key])(value)
    return run


def shipped_heads(args) -> str:
    if args.model:
        return str(Path(args.heads).resolve())
    from mtp_edge.mtp import shipped_heads as find

    path = find("SmolLM2-135M-Instruct")
    if path is None:
        raise SystemExit("error: no heads ship for SmolLM2-135M-Instruct")
    return str(path)


def bin_(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class Runner:
    def __init__(self, work: Path, nice: bool):
        self.work, self.nice = work, nice
        self.commands: list[dict] = []
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def run(self, name: str, argv: list[str], output: Path) -> float | None:
        """Run argv (its progress shown and logged) unless `output` exists; its seconds."""
        shown = " ".join(shlex.quote(a) for a in argv)
        entry = {"step": name, "command": shown}
        self.commands.append(entry)
        if output.exists():
            print(f"[{name}] {output} exists: skipped", flush=True)
            return None
        full = (["nice", "-n", "19"] if self.nice else []) + argv
        log = self.work / "logs" / f"{name}.log"
        print(f"[{name}] {shown}\n[{name}] log: {log}", flush=True)
        start = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with log.open("w") as f:
            process = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for raw in process.stdout:
                f.write(raw.decode(errors="replace"))
                f.flush()
                sys.stdout.write(raw.decode(errors="replace"))
                sys.stdout.flush()
            code = process.wait()
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        entry["seconds"] = round(seconds, 1)
        entry["cpu_seconds"] = round(
            after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1
        )
        if code in (130, 143) and output.exists():  # mtp-bench stopped: what it measured, partial
            entry["stopped"] = True
            print(f"[{name}] stopped: reporting what it measured", flush=True)
        elif code != 0:
            raise SystemExit(f"error: step {name} failed (exit {code}); its log: {log}")
        print(f"[{name}] done in {seconds / 60:.1f} min", flush=True)
        return seconds


def model_args(args) -> list[str]:
    return ["-m", str(Path(args.model).resolve())] if args.model else []


def train(runner: Runner, run: dict, stream: dict, args) -> Path:
    threads = args.threads
    out = runner.work / run["name"] / "heads.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [bin_("mtp-train"), *model_args(args), "--init", shipped_heads(args),
            "--prompts", stream["train_file"],
            "--prompts-share", f"{run['share']:g}", "--k", str(run["k"]),
            "--gen-max-new", str(run["max_new"]), "--threads", str(threads), "-o", str(out),
            "--json", str(out.with_suffix(".summary.json"))]  # fmt: skip
    if run["answers"] != 1:
        argv += ["--answers-per-request", str(run["answers"])]
    if run["minutes"] > 0:
        argv += ["--minutes", f"{run['minutes']:g}"]
    else:
        argv += ["--steps", str(run["steps"]), "--gen-tokens", str(run["gen"]),
                 "--raw-tokens", str(run["raw"])]  # fmt: skip
    runner.run(f"train-{run['name']}", argv, out)
    return out


def export(runner: Runner, name: str, heads: Path | None, k: int, args) -> Path:
    bundle = runner.work / "bundles" / name
    shipped = runner.work / "bundles" / "shipped"
    if heads is not None and k == 4 and name != "shipped":  # the shipped bundle's k
        argv = [bin_("mtp-export"), "--update-heads", str(shipped), "--heads", str(heads)]
        runner.run(f"export-{name}", [*argv, "-o", str(bundle)], bundle / "manifest.json")
        return bundle
    argv = [bin_("mtp-export"), "--target", "android", *model_args(args), "-o", str(bundle)]
    if heads is None and args.model:
        heads = Path(shipped_heads(args))
    if heads is not None:
        argv += ["--heads", str(heads)]
    if k != 4:
        argv += ["--k", str(k)]
    runner.run(f"export-{name}", argv, bundle / "manifest.json")
    return bundle


def setups(shipped: Path, refined: dict[str, Path], floors: list[float]) -> list[str]:
    out = [str(shipped)] + [str(b) for b in refined.values()]
    out += [f"{b},draft_confidence={p:g}" for b in refined.values() for p in floors]
    return out


def terms(summary: dict) -> dict:
    keys = ["tau", "acceptance_rate", "verify_over_decode", "draft_over_decode", "speedup",
            "ar_tokens_per_s", "spec_tokens_per_s", "divergences", "prompts"]  # fmt: skip
    return {k: summary.get(k) for k in keys}


def describe(spec: str, start: str) -> tuple[str, float | None]:
    """A --compare spec's setup name and draft-confidence floor (None: the bundle's)."""
    path, *settings = spec.split(",")
    name = Path(path).name
    label = start if name == "shipped" else f"refined: {name}"
    floor = None
    for item in settings:
        key, _, value = item.partition("=")
        if key == "draft_confidence":
            floor = float(value)
    return label, floor


def report(args, stream: dict, runs: list[dict], bench: dict, runner: Runner, specs) -> None:
    rows = []
    # mtp-bench's runs come in the order of the setups: --bundle, then each --compare.
    # One setup alone: mtp-bench writes its report flat, not as a list of runs.
    for spec, entry in zip(specs, bench.get("runs", [bench]), strict=True):
        label, floor = describe(spec, "starting heads" if args.model else "shipped heads")
        s = entry["summary"]
        identical = sum(bool(p["identical"]) for p in entry["prompts"])
        rows.append({
            "setup": label,
            "draft_confidence": floor,
            "k": entry.get("k"),
            **terms(s),
            "identical": identical,
            "partial": entry.get("partial"),
            "per_split": {c: {"tau": v["tau"], "speedup": v["speedup"], "prompts": v["prompts"],
                              "identical": v["identical"]}
                          for c, v in entry["per_category"].items()},
        })  # fmt: skip
    trained = []
    for r in runs:
        path = runner.work / r["name"] / "heads.summary.json"
        summary = json.loads(path.read_text()) if path.exists() else {}
        ran = next((c for c in runner.commands if c["step"] == f"train-{r['name']}"), {})
        trained.append({
            **r,
            "wall_minutes": round(ran["seconds"] / 60, 1) if "seconds" in ran else None,
            "cpu_minutes": round(ran["cpu_seconds"] / 60, 1) if "cpu_seconds" in ran else None,
            "your_requests_tau": summary.get("your_requests_tau"),
            "heldout_tau": summary.get("heldout_tau"),
            "trained_steps": summary.get("steps"),
            "draft_vocab": summary.get("draft_vocab"),
            "train_tokens": summary.get("train_tokens"),
            "report": summary.get("report"),
        })  # fmt: skip
    result = {
        "goal": "tau >= 2.3 on the 100 test requests, speedup >= 1.8x over plain, lossless",
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "starting_heads": shipped_heads(args),
        "stream": stream,
        "runs": trained,
        "setups": rows,
        "commands": runner.commands,
        "command": "python benchmarks/refine_stream.py " + " ".join(map(shlex.quote, sys.argv[1:])),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    s = result["stream"]
    lines = [
        "# Heads refined on a request stream",
        "",
        f"Model: {result.get('model', 'default')}; starting heads: "
        f"{Path(result.get('starting_heads', 'shipped')).name}.",
        "",
        f"Stream: {s['distinct_requests']} distinct requests ({s['templates']} templates x "
        f"{s['modules']} Python standard-library modules). Training: {s['train_requests']} "
        f"requests about {s['train_modules']} modules. Test: {s['test_requests']} requests, none "
        f"in training ({s['test_requests_in_training']} shared): {s['test_seen_module']} about "
        f"modules training saw (seen-module), {s['test_new_module']} about the "
        f"{len(s['new_modules'])} it never saw (new-module: {', '.join(s['new_modules'])}).",
        "",
        "| setup | floor | tau | median tau per request, seen / new module | verify/decode | "
        "draft/decode | "
        "plain tok/s | spec tok/s | speedup | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["setups"]:
        split_tau = " / ".join(
            f"{r['per_split'][c]['tau']:.2f}"
            for c in ("seen-module", "new-module")
            if c in r["per_split"]
        )
        floor = "bundle's" if r["draft_confidence"] is None else f"{r['draft_confidence']:g}"
        lines.append(
            f"| {r['setup']} | {floor} | {r['tau']:.2f} | {split_tau} | "
            f"{r['verify_over_decode']:.2f} | {r['draft_over_decode']:.3f} | "
            f"{r['ar_tokens_per_s']:.1f} | {r['spec_tokens_per_s']:.1f} | "
            f"**{r['speedup']:.2f}x** | {r['identical']}/{r['prompts']} |"
        )
    for r in result["setups"]:
        if r.get("partial"):
            p = r["partial"]
            lines += ["", f"{r['setup']}: stopped ({p['stopped_by']}) after {p['prompts_done']} "
                      f"of {p['prompts']} test requests; the figures are over those."]  # fmt: skip
    lines += [
        "",
        "Training (from the starting heads, on the 200 training requests):",
        "",
        "| run | settings | training minutes (wall / CPU) | steps | draft vocab | tau on its "
        "held-out requests | held-out tau (all text) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:

        def fmt(v):
            return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

        lines.append(
            f"| {r['name']} | {', '.join(f'{k}={r[k]:g}' for k in RUN_SETTINGS)} | "
            f"{fmt(r['wall_minutes'])} / {fmt(r['cpu_minutes'])} | {fmt(r['trained_steps'])} | "
            f"{fmt(r['draft_vocab'])} | {fmt(r['your_requests_tau'])} | {fmt(r['heldout_tau'])} |"
        )
    lines += ["", "Commands:", "", "```bash", result["command"]]
    for c in result["commands"]:
        took = f"   # {c['seconds'] / 60:.1f} min" if "seconds" in c else ""
        lines.append(c["command"] + took)
    lines += ["```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="Where the stream, heads, bundles go.")
    parser.add_argument("--run", action="append", default=[],
                        help="NAME:minutes=M,share=S,k=K, a training run (repeatable; default "
                        "main with RUN_SETTINGS).")  # fmt: skip
    parser.add_argument(
        "--floor",
        action="append",
        type=float,
        default=[],
        help="Also bench each refined bundle with this draft-confidence floor.",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--nice", action="store_true", help="Run every command under nice -n 19.")
    parser.add_argument("--stream-only", action="store_true", help="Write the stream and stop.")
    parser.add_argument(
        "--shipped-only",
        action="store_true",
        help="No training: the shipped heads' bundle alone on the test requests (the baseline).",
    )
    parser.add_argument("--model", help="Another target than the default (GGUF or HF folder).")
    parser.add_argument("--heads", help="With --model: the heads to start from (its general ones).")
    parser.add_argument("--out", default="benchmarks/results/drafting/refine_stream")
    args = parser.parse_args()
    if bool(args.model) != bool(args.heads):
        parser.error("--model and --heads go together: the target and the heads to start from")
    for given in filter(None, (args.model, args.heads)):
        if not Path(given).exists():
            parser.error(f"{given}: no such file or folder")

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    stream = write_stream(work, args.max_new_tokens)
    print(f"[stream] {json.dumps(stream)}", flush=True)
    if args.stream_only:
        return
    runs = [] if args.shipped_only else [parse_run(r) for r in args.run or ["main"]]
    runner = Runner(work, args.nice)
    heads = {r["name"]: train(runner, r, stream, args) for r in runs}
    shipped = export(runner, "shipped", None, 4, args)
    refined = {r["name"]: export(runner, r["name"], heads[r["name"]], r["k"], args) for r in runs}
    bench_json = work / ("bench-shipped.json" if args.shipped_only else "bench.json")
    argv = [bin_("mtp-bench"), "--bundle", str(shipped)]
    specs = setups(shipped, refined, args.floor)
    for setup in specs[1:]:
        argv += ["--compare", setup]
    argv += ["--prompts", str(work / "test.jsonl"), "--threads", str(args.threads),
             "--max-new-tokens", str(args.max_new_tokens), "--json", str(bench_json),
             "--markdown", str(bench_json.with_suffix(".md"))]  # fmt: skip
    runner.run(bench_json.stem, argv, bench_json)
    report(args, stream, runs, json.loads(bench_json.read_text()), runner, specs)


if __name__ == "__main__":
    main()
