"""`mtp-profile`: the mtp-bench measurement on a device, next to the prediction for it.

`host` runs the harness here. A serial runs the native `mtp-runner` on an Android device over
adb: check the device, push the bundle and the runner to /data/local/tmp/mtp/, run one prompt
at a time (so that a device lost mid-run keeps every prompt measured before), pull each JSON,
and merge them into one report in the mtp-bench format.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import mtp_edge.runtime as runtime_package
from mtp_edge.devices.adb import Adb, DeviceLost
from mtp_edge.devices.catalog import catalog, find_device, host_device
from mtp_edge.devices.harness import Prompt, per_category, to_markdown
from mtp_edge.errors import UserError
from mtp_edge.files import write_atomic
from mtp_edge.manifest import Manifest
from mtp_edge.runtime.loop import tau_of

WORKDIR = "/data/local/tmp/mtp"
# runtime/native/build-android/mtp-runner, where the native runtime's Android build puts it
DEFAULT_RUNNER = Path(runtime_package.__file__).parent / "native" / "build-android" / "mtp-runner"
# ELF e_machine -> Android ABI
ELF_ABI = {0xB7: "arm64-v8a", 0x28: "armeabi-v7a", 0x3E: "x86_64", 0x03: "x86"}
# What `getprop ro.soc.model` (or ro.board.platform) says -> the catalog entry to predict with
SOC_TO_CATALOG = {
    "SM8650": "galaxy-s24-ultra",
    "SM8750": "galaxy-s25",
    "MT6989": "vivo-x100-pro",
    "Tensor G4": "pixel-9",
    "zumapro": "pixel-9",
}


def profile_device(
    device: str,
    bundle: str,
    prompts: list[Prompt],
    max_new_tokens: int | None,
    repeat: int,
    runner: str | None,
    catalog_name: str | None,
    json_out: str | None,
    progress: Callable[[str], None],
) -> dict:
    """Measure on `device` (host or an adb serial); the report, with the prediction beside it."""
    from mtp_edge.devices.predict import (
        acceptance_from,
        average,
        bundle_cost,
        calibrate,
        compare_with_measured,
        predict,
    )

    manifest = Manifest.load(bundle)
    host_device()  # measure the host before ExecuTorch takes its cores
    cost = bundle_cost(bundle)
    if device == "host":
        report, calibrations, cost = measure_host(
            bundle, prompts, max_new_tokens, repeat, progress, cost
        )
        calibration = average(calibrations)
        target = find_device(catalog_name or "host")
    else:
        report = measure_adb(
            device, bundle, prompts, max_new_tokens, repeat, runner, json_out, progress
        )
        if isinstance(report.get("k"), int):  # the k the device's runtime drafted
            cost = replace(cost, k=report["k"])
        target = catalog_match(report["device_info"]["soc"], catalog_name)
        progress("[calibrate] timing the bundle's programs on the host for the roofline")
        calibration = calibrate(bundle, cost)
    prediction = predict(cost, target, calibration, acceptance_from(report, manifest, cost.k))
    report["prediction"] = prediction
    report["calibration"] = asdict(calibration)
    if device == "host":
        report["host_validation"] = compare_with_measured(prediction, report)
    report["markdown"] = side_by_side(report, prediction)
    _write_json(json_out, report)
    return report


def measure_host(bundle, prompts, max_new_tokens, repeat, progress, cost) -> tuple:
    """The mtp-bench measurement on this machine, through the bundle's own session; the
    roofline's calibration is taken before every prompt and after the last, so that both follow
    the same changes in machine load. Returns the report, the calibrations and the cost at the
    k the runtime drafts here (fewer than the bundle's on a CPU without an int8 dot product),
    at which the calibration timed its verifications."""
    from mtp_edge.devices.harness import Suite, progress_line
    from mtp_edge.devices.predict import calibrate_session
    from mtp_edge.runtime.assemble import LoadOptions, assemble

    # The bundle's drafter with its drafting policy, as mtp-bench and the native runner run it.
    gen = assemble(LoadOptions(bundle=str(bundle)))
    session, drafter, config = gen.session, gen.drafter, gen.config
    cost = replace(cost, k=config.k)
    suite = Suite(config.k, repeat)
    calibrations = []
    # Each calibration at the middle of the next prompt's generation (its prompt and half its
    # answer): a call's attention grows with the context, so timings at a fixed context
    # predicted verifications of other lengths (at 256 against 118 measured, verify/decode 2.3
    # predicted for 1.4 on an AVX2 host).
    context = 256
    for i, p in enumerate(prompts):
        context = len(gen.encode(p.request)) + (max_new_tokens or p.max_new_tokens) // 2
        calibrations.append(calibrate_session(session, drafter, cost, context=context))
        row = suite.run_prompt(session, gen.encode, drafter, p, config, max_new_tokens)
        progress(f"[{i + 1}/{len(prompts)}] {progress_line(row)}")
    calibrations.append(calibrate_session(session, drafter, cost, context=context))
    report = {
        "bundle": bundle,
        "model": gen.name,
        "backend": session.name,
        "drafter": "none" if drafter is None else drafter.name,
        "k": config.k,
        "device_info": {"serial": "host", "description": host_device().cpu},
        **suite.body(),
    }
    return report, calibrations, cost


def measure_adb(device, bundle, prompts, max_new_tokens, repeat, runner, json_out, progress):
    adb = Adb(device)
    runner_path = Path(runner) if runner else DEFAULT_RUNNER
    if not runner_path.is_file():
        raise UserError(
            f"no native runner at {runner_path}: build it for Android (cmake with the NDK "
            "toolchain, android-arm64, into runtime/native/build-android/) or pass --runner PATH"
        )
    adb.check_attached()
    info = adb.info(WORKDIR)
    progress(f"[device] {info.describe()}")
    expected = runner_abi(runner_path) or "arm64-v8a"
    if info.abi != expected:
        raise UserError(
            f"device {device} is {info.abi}, but {runner_path.name} is built for {expected}: "
            f"build the runner for {info.abi} (or use an {expected} device)"
        )
    files = sorted(p for p in Path(bundle).iterdir() if p.is_file())
    libraries = runner_libraries(runner_path)
    need = sum(p.stat().st_size for p in [*files, *libraries]) + runner_path.stat().st_size
    if info.free_bytes < need * 1.1:
        raise UserError(
            f"device {device} has {info.free_bytes / 2**20:.0f} MB free in {WORKDIR}, the "
            f"bundle and runner need {need * 1.1 / 2**20:.0f} MB: free space on the device"
        )
    if (info.thermal_status or 0) >= 2 or (info.battery_celsius or 0) >= 40:
        progress("[device] warning: the device is warm; its numbers may be throttled")
    parts: list[dict] = []
    try:
        adb.shell(f"mkdir -p {WORKDIR}/bundle {WORKDIR}/prompts {WORKDIR}/out")
        for p in files:
            progress(f"[push] {p.name} ({p.stat().st_size / 2**20:.1f} MB)")
            adb.run("push", str(p), f"{WORKDIR}/bundle/{p.name}", timeout=900)
        adb.run("push", str(runner_path), f"{WORKDIR}/mtp-runner", timeout=300)
        adb.shell(f"chmod 755 {WORKDIR}/mtp-runner")
        if libraries:
            adb.shell(f"rm -rf {WORKDIR}/lib && mkdir -p {WORKDIR}/lib")
        for lib in libraries:
            progress(f"[push] lib/{lib.name} ({lib.stat().st_size / 2**20:.1f} MB)")
            adb.run("push", str(lib), f"{WORKDIR}/lib/{lib.name}", timeout=300)
        with tempfile.TemporaryDirectory() as tmp:
            for i, p in enumerate(prompts):
                parts.append(run_one(adb, Path(tmp), i, p, max_new_tokens, repeat))
                row = parts[-1]["prompts"][0] if parts[-1]["prompts"] else None
                if row:
                    progress(
                        f"[{i + 1}/{len(prompts)}] {row['id']}: plain "
                        f"{row['ar_tokens_per_s']:.1f} tok/s, spec "
                        f"{row['spec_tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}"
                    )
    except DeviceLost as e:
        partial = merge_reports(parts) if parts else {"prompts": []}
        partial["device_info"] = vars(info)
        partial["incomplete"] = {
            "reason": str(e),
            "prompts_measured": len(parts),
            "prompts_total": len(prompts),
        }
        out = json_out or f"mtp-profile-{device}-partial.json"
        _write_json(out, partial)
        raise DeviceLost(
            f"{e}; kept the {len(parts)} of {len(prompts)} prompts measured before, in {out}"
        ) from None
    report = merge_reports(parts)
    report["bundle"] = bundle
    report["device_info"] = vars(info)
    return report


def runner_libraries(runner: Path) -> list[Path]:
    """The shared libraries of a self-contained runner folder (`cmake --install`, e.g.
    runtime/native/cross/build-arm64.sh): RUNNER_DIR/lib/*.so*, which the runner finds through
    its run path $ORIGIN/lib once both are pushed side by side. None for a runner without."""
    return sorted(p for p in (runner.parent / "lib").glob("*.so*") if p.is_file())


def run_one(adb: Adb, tmp: Path, i: int, prompt: Prompt, max_new_tokens, repeat) -> dict:
    """One prompt through the runner on the device; its JSON, pulled back."""
    local = tmp / f"{i:03d}.jsonl"
    row = {"id": prompt.id, "category": prompt.category, "prompt": prompt.prompt}
    row["max_new_tokens"] = prompt.max_new_tokens
    local.write_text(json.dumps(row) + "\n")
    adb.run("push", str(local), f"{WORKDIR}/prompts/{local.name}")
    args = [
        "./mtp-runner",
        "--bundle bundle",
        f"--prompts prompts/{local.name}",
        f"--repeat {repeat}",
        f"--json out/{i:03d}.json",
    ]
    if max_new_tokens:
        args.insert(3, f"--max-new-tokens {max_new_tokens}")
    adb.shell(f"cd {WORKDIR} && " + " ".join(args), timeout=3600)
    pulled = tmp / f"{i:03d}.json"
    adb.run("pull", f"{WORKDIR}/out/{i:03d}.json", str(pulled))
    try:
        return json.loads(pulled.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"the runner's JSON for prompt {prompt.id} is unreadable: {e}") from None


def merge_reports(parts: list[dict]) -> dict:
    """One mtp-bench report from per-prompt runner reports (same bundle and settings)."""
    rows = [row for part in parts for row in part["prompts"]]
    first = parts[0]

    def total_rate(tokens_key: str, rate_key: str) -> float:
        tokens = sum(max(r[tokens_key] - 1, 0) for r in rows)
        seconds = sum(max(r[tokens_key] - 1, 0) / r[rate_key] for r in rows if r[rate_key] > 0)
        return tokens / seconds if seconds else 0.0

    steps = sum(r["verify_steps"] for r in rows)
    accepted = sum(r["spec_tokens"] - 1 for r in rows) - steps
    drafted = 0.0
    for part in parts:
        s = part["summary"]
        part_steps = sum(r["verify_steps"] for r in part["prompts"])
        part_accepted = sum(r["spec_tokens"] - 1 for r in part["prompts"]) - part_steps
        drafted += (
            part_accepted / s["acceptance_rate"]
            if s["acceptance_rate"]
            else first["k"] * part_steps
        )
    positions = len(first["summary"]["acceptance_by_position"])
    by_position = []
    for j in range(positions):
        pairs = [
            (
                p["summary"]["acceptance_by_position"][j],
                sum(r["verify_steps"] for r in p["prompts"]),
            )
            for p in parts
            if p["summary"]["acceptance_by_position"][j] is not None
        ]
        weight = sum(w for _, w in pairs)
        by_position.append(round(sum(a * w for a, w in pairs) / weight, 4) if weight else None)
    ar, sp = (
        total_rate("ar_tokens", "ar_tokens_per_s"),
        total_rate("spec_tokens", "spec_tokens_per_s"),
    )
    divergent = [r for r in rows if not r["identical"]]

    def median(key: str) -> float:
        return round(statistics.median(p["summary"][key] for p in parts), 4)

    summary = {
        "prompts": len(rows),
        "lossless": all(p["summary"]["lossless"] for p in parts),
        "divergences": len(divergent),
        "near_tie_divergences": sum(1 for r in divergent if r.get("near_tie")),
        "near_tie_tolerance": first["summary"].get("near_tie_tolerance"),
        "ar_tokens_per_s": round(ar, 3),
        "spec_tokens_per_s": round(sp, 3),
        "speedup": round(sp / ar, 4) if ar else 0.0,
        "tau": round(tau_of(sum(_step_tokens(r) for r in rows), steps), 4),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "acceptance_by_position": by_position,
        "ar_ms_per_step": median("ar_ms_per_step"),
        "verify_ms_per_step": median("verify_ms_per_step"),
        "verify_over_decode": median("verify_over_decode"),
        "draft_ms_per_step": median("draft_ms_per_step"),
        "draft_over_decode": median("draft_over_decode"),
        "ttft_ms_ar": median("ttft_ms_ar"),
        "ttft_ms_spec": median("ttft_ms_spec"),
    }
    return {
        "bundle": first.get("bundle"),
        "backend": first.get("backend"),
        "drafter": first.get("drafter"),
        "k": first.get("k"),
        "summary": summary,
        "per_category": per_category(rows),
        "prompts": rows,
    }


def _step_tokens(row: dict) -> int:
    """What a prompt's speculative verify steps gave (tau's numerator): the row's own count, or,
    from a runner that does not report it, the tokens after the first plus an ending eos."""
    if "step_tokens" in row:
        return row["step_tokens"]
    return row["spec_tokens"] - 1 + (row.get("stop_reason_spec") == "eos")


def runner_abi(path: Path) -> str | None:
    """The Android ABI an ELF executable is built for (None if it is not ELF)."""
    head = path.read_bytes()[:20]
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return ELF_ABI.get(int.from_bytes(head[18:20], "little"), f"ELF machine {head[18]}")


def catalog_match(soc: str, name: str | None):
    if name:
        return find_device(name)
    for key, device in SOC_TO_CATALOG.items():
        if key.lower() in soc.lower():
            return find_device(device)
    names = ", ".join(d.name for d in catalog())
    raise UserError(
        f"no catalog entry for SoC '{soc}': pass --as with one of {names} to predict with"
    )


def side_by_side(report: dict, prediction: dict) -> str:
    s = report["summary"]
    spec = prediction.get("speculative")
    lines = [
        to_markdown(report),
        f"Measured on {report['device_info'].get('serial')} vs the roofline prediction for "
        f"{prediction['device']}:",
        "",
        "| | plain tok/s | speculative tok/s | speedup |",
        "|---|---|---|---|",
        f"| measured | {s['ar_tokens_per_s']:.1f} | {s['spec_tokens_per_s']:.1f} | "
        f"{s['speedup']:.2f}x |",
        f"| predicted | {prediction['plain']['tokens_per_s']:.1f} | "
        + (f"{spec['tokens_per_s']:.1f} | {prediction['speedup']:.2f}x |" if spec else "— | — |"),
    ]
    validation = report.get("host_validation")
    if validation:
        from mtp_edge.devices.predict import PREDICTION_GOAL

        lines += [
            "",
            f"| quantity | error of the prediction | within ±{PREDICTION_GOAL:.0%} |",
            "|---|---|---|",
        ]
        for name, v in validation.items():
            error = "—" if v["error"] is None else f"{v['error']:+.1%}"
            lines.append(f"| {name} | {error} | {'yes' if v['within_goal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _write_json(path: str | None, report: dict) -> None:
    write_atomic(path, json.dumps({k: v for k, v in report.items() if k != "markdown"}, indent=2))
