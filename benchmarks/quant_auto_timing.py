"""The timing and choice of `mtp-export --quant auto` on bundles already exported: each bundle
(a candidate scheme) at each k, plain and speculative, the way the search times them (a worker
process per setup, prompts in turn, every pass repeated), then `pick`'s choice and the table.
What the search would decide among these bundles on this machine, without exporting again.

    python benchmarks/quant_auto_timing.py BUNDLE [BUNDLE ...] [--ks 2,3,4,5] [--repeat 3]
        [--max-new-tokens 48] [--out PREFIX]   # PREFIX.json and PREFIX.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mtp_edge.api import auto_timer
from mtp_edge.exporter.choose import SearchPlan, bundle_size_mb, candidate_row, pick, table
from mtp_edge.manifest import Manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--ks", default="2,3,4,5")
    parser.add_argument("--repeat", type=int, default=SearchPlan.repeat)
    parser.add_argument("--max-new-tokens", type=int, default=SearchPlan.max_new_tokens)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    plan = SearchPlan(max_new_tokens=args.max_new_tokens, repeat=args.repeat)
    bundles = [Path(b) for b in args.bundles]
    manifests = [Manifest.load(b) for b in bundles]
    setups = [(b, k) for b in bundles for k in ks]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    summaries, prompts = auto_timer(lambda line: print(line, file=sys.stderr))(setups, plan)
    rows = []
    for (bundle, k), summary in zip(setups, summaries, strict=True):
        m = manifests[bundles.index(bundle)]
        rows.append(
            candidate_row(
                m.models["target"].quant["scheme"], k, m, bundle_size_mb(bundle, m), summary
            )
        )
        rows[-1]["label"] = f"{bundle.name} k={k}"
    choice = pick(rows)
    lines = table(rows, choice)
    chosen = rows[choice["chosen"]]["label"] if choice["chosen"] is not None else "none"
    command = "python benchmarks/quant_auto_timing.py " + " ".join(sys.argv[1:])
    after = Path("/proc/loadavg").read_text().split()[:3] if load else []
    text = "\n".join(
        [
            f"# --quant auto's timing on exported bundles, {started}",
            "",
            plan.describe(prompts)
            + f"; load average before {' '.join(load)}, after {' '.join(after)}",
            "",
            "```text",
            *lines,
            "```",
            "",
            f"Chosen: {chosen}: {choice['why']}",
            "",
            f"Command: `{command}`",
        ]
    )
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text + "\n")
        body = {
            "rows": rows,
            "choice": {**choice, "excluded": {str(i): r for i, r in choice["excluded"].items()}},
        }
        body.update(command=command, started=started, load_before=load, load_after=after)
        Path(args.out + ".json").write_text(json.dumps(body, indent=1) + "\n")


if __name__ == "__main__":
    main()
