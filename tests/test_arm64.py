"""The native runtime cross-built for ARM64 (runtime/native/cross/build-arm64.sh) and run under
qemu-aarch64: its C++ unit tests pass; on tiny bundles its speculative output equals its plain
output for every drafter, and its plain tokens are x86's (or differ only at a near-tie); every
weight scheme's verification rows are bitwise its one-token steps; and `mtp-profile --device`
runs it through an emulated device (runtime/native/cross/qemu-adb). Without the cross compiler,
qemu or the aarch64 executorch wheel every test here is skipped, saying what to install.

qemu runs with `-cpu max,sme=off` (NEON dot product, i8mm, SVE2): with SME on, qemu 7.2 gives
other logits (see runtime/native/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import test_devices
import test_native
from click.testing import CliRunner
from test_executorch import CHUNK, MAX_SEQ_LEN, PROMPT, SCHEMES, VOCAB, exported, programs_in
from test_native import python_runs, run_native, suite_ids

from mtp_edge.cli import profile
from mtp_edge.devices.harness import NEAR_TIE
from mtp_edge.devices.profile import runner_abi
from mtp_edge.runtime import native_runner
from mtp_edge.runtime.loop import first_divergence

CROSS = native_runner.SOURCE_DIR / "cross"
SYSROOT = "/usr/aarch64-linux-gnu"
QEMU_CPU = "max,sme=off"
INSTALL = "apt-get install -y g++-aarch64-linux-gnu qemu-user"
# The wheel's download cache, the user's (taken before test_native's fixture points
# XDG_CACHE_HOME at a temporary directory): downloaded once, not once per run.
ARM64_CACHE = os.environ.get("MTP_ARM64_CACHE") or str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp-edge" / "arm64"
)

# Fixtures shared by name: the host runner and tiny bundles of test_native, the tiny n-gram
# bundle and prompts of test_devices (whose roofline calibration runs on the host, where a
# bundle drafter's probe ids would exceed the tiny MTP bundles' vocabulary).
runner, verified_stamps = test_native.runner, test_native.verified_stamps
mtp_bundle, draft_lm_bundle = test_native.mtp_bundle, test_native.draft_lm_bundle
model_dir, bundle, prompts = test_devices.model_dir, test_devices.bundle, test_devices.prompts


@pytest.fixture(scope="module")
def device_dir() -> Path:
    """The self-contained ARM64 folder (mtp-runner, mtp-logits, mtp-native-tests, lib/)."""
    for tool, package in (
        ("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu"),
        ("qemu-aarch64", "qemu-user"),
    ):
        if shutil.which(tool) is None:
            pytest.skip(f"{package} is not installed: {INSTALL}")
    done = subprocess.run(
        [str(CROSS / "build-arm64.sh"), "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "MTP_ARM64_CACHE": ARM64_CACHE},
    )
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.returncode != 0 and "could not download" in last:
        pytest.skip(last)  # no wheel cached and no registry to fetch it from
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


def qemu(device_dir: Path, program: str, *args: str, cpu: str = QEMU_CPU, **kwargs):
    command = ["qemu-aarch64", "-cpu", cpu, "-L", SYSROOT, str(device_dir / program), *args]
    return subprocess.run(command, capture_output=True, timeout=900, **kwargs)


@pytest.fixture(scope="module")
def arm64_runner(device_dir, tmp_path_factory) -> Path:
    """An executable that runs the ARM64 mtp-runner under qemu, for test_native's helpers."""
    path = tmp_path_factory.mktemp("qemu") / "mtp-runner"
    runner = device_dir / "mtp-runner"
    path.write_text(f'#!/bin/sh\nexec qemu-aarch64 -cpu {QEMU_CPU} -L {SYSROOT} {runner} "$@"\n')
    path.chmod(0o755)
    return path


def test_build_script_names_what_is_missing(tmp_path):
    """Without the cross compiler: one line naming the packages, exit 2, nothing built."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cmake", "python3", "dirname", "nproc"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": str(bin_dir)}
    done = subprocess.run(
        ["/bin/bash", str(CROSS / "build-arm64.sh"), "--build-dir", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2 and not (tmp_path / "b").exists()
    assert done.stderr.strip() == f"error: g++-aarch64-linux-gnu is not installed: {INSTALL}"


def test_cross_build_is_arm64_and_self_contained(device_dir):
    assert runner_abi(device_dir / "mtp-runner") == "arm64-v8a"
    libraries = {p.name for p in (device_dir / "lib").iterdir()}
    assert {"libmtp_edge.so", "libexecutorch.so", "libexecutorch_backend_xnnpack.so"} <= libraries
    readelf = subprocess.run(
        ["aarch64-linux-gnu-readelf", "-d", str(device_dir / "mtp-runner")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "[$ORIGIN/lib]" in readelf  # finds lib/ wherever the folder is copied
    done = qemu(device_dir, "mtp-native-tests", text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "all native core tests passed" in done.stdout


def plain_ids(report: dict) -> list[list[int]]:
    return [row["ar_token_ids"] for row in report["prompts"]]


@pytest.mark.parametrize(
    "bundle_name,drafters",
    [
        ("mtp_bundle", ("bundle", "ngram", "mtp+ngram", "none")),
        ("draft_lm_bundle", ("bundle", "draft-lm+ngram")),
        # our int8 and 6-bit kernels' plain C++ versions (ARM) against their AVX2 ones (x86)
        ("own_int8_bundle", ("bundle", "mtp+ngram")),
    ],
)
def test_arm64_speculative_equals_plain_and_x86(
    request, runner, arm64_runner, tmp_path, bundle_name, drafters
):
    """Under qemu, each drafter's speculative tokens are the plain tokens on 6 built-in
    prompts; the plain tokens are the x86 runner's, or first differ where the x86 (Python)
    plain run's two best logits nearly tie."""
    bundle_dir = request.getfixturevalue(bundle_name)
    suite = suite_ids(bundle_dir)[::8]  # 6 prompts of 6 categories: qemu is slow (the
    # default bundle on 16 prompts is benchmarks/arm64_vs_x86.py's)
    reports = {}
    for drafter in drafters:
        # "bundle": no --drafter, the bundle's own drafting policy
        flags = () if drafter == "bundle" else ("--drafter", drafter)
        report = run_native(arm64_runner, bundle_dir, suite, tmp_path, *flags)
        reports[drafter] = report
        assert report["summary"]["lossless"], drafter
        for row in report["prompts"]:
            assert row["spec_token_ids"] == row["ar_token_ids"], (drafter, row["id"])
    arm64 = plain_ids(reports["bundle"])
    assert all(plain_ids(r) == arm64 for r in reports.values())
    x86 = plain_ids(run_native(runner, bundle_dir, suite, tmp_path, "--drafter", "none"))
    if x86 != arm64:
        python = python_runs(bundle_dir, suite, None)
        for (prompt_id, result), theirs, ours in zip(python, x86, arm64, strict=True):
            j = first_divergence(theirs, ours)
            if j is not None:
                assert result.token_ids == theirs, prompt_id
                gap = result.top2_gaps[j] if j < len(result.top2_gaps) else None
                assert gap is not None and gap < NEAR_TIE, (prompt_id, j, gap)


def test_arm64_tokens_do_not_depend_on_the_cpu_model(mtp_bundle, device_dir, tmp_path):
    """XNNPACK picks other int8 kernels per CPU (cortex-a53: NEON mlal; cortex-a76: dot
    product; max,sme=off: i8mm): the same plain and speculative tokens on each."""
    suite = suite_ids(mtp_bundle)[:2]
    lines = [
        json.dumps({"id": i, "category": c, "prompt_ids": ids, "max_new_tokens": 16})
        for i, c, ids in suite
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    seen = {}
    for cpu in ("cortex-a53", "cortex-a76", QEMU_CPU):
        out = tmp_path / f"{cpu}.json"
        args = ["--bundle", mtp_bundle, "--prompts", str(tmp_path / "p.jsonl"), "--json", str(out)]
        done = qemu(device_dir, "mtp-runner", *args, cpu=cpu, text=True)
        assert done.returncode == 0, (cpu, done.stderr[-2000:])
        report = json.loads(out.read_text())
        seen[cpu] = [(r["ar_token_ids"], r["spec_token_ids"]) for r in report["prompts"]]
    assert seen["cortex-a53"] == seen["cortex-a76"] == seen[QEMU_CPU]


def row_calls(tokens: list[int]) -> list[list[dict]]:
    """The calls of test_executorch's row test: one-token steps after a prefill; the same tokens
    in calls of widths 2, 5, 3, 2; three one-token steps and one 3-token call at the cache's end."""
    start = 2 * len(PROMPT)
    prefill = {"tokens": PROMPT * 2, "start": 0, "prefill": True}
    steps = [prefill] + [{"tokens": [t], "start": start + i} for i, t in enumerate(tokens)]
    wide, done = [prefill], 0
    for width in (2, 5, 3, 2):
        wide.append({"tokens": tokens[done : done + width], "start": start + done})
        done += width
    end = MAX_SEQ_LEN - 3
    end_steps = [{"tokens": [t], "start": end + i} for i, t in enumerate(tokens[:3])]
    return [steps, wide, end_steps, [{"tokens": tokens[:3], "start": end}]]


def logits_of(command: list[str], spec: dict, out: Path) -> list[np.ndarray]:
    """Each session's rows of logits (prefill rows dropped), from mtp-logits."""
    done = subprocess.run(
        [*command, str(out)], input=json.dumps(spec), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)["rows"]
    flat = np.fromfile(out, dtype="<f4").reshape(-1, VOCAB)
    sessions, at = [], 0
    for calls, session_rows in zip(spec["sessions"], rows, strict=True):
        parts = []
        for call, n in zip(calls, session_rows, strict=True):
            if not call.get("prefill"):
                parts.append(flat[at : at + n])
            at += n
        sessions.append(np.concatenate(parts))
    return sessions


@pytest.mark.parametrize(
    "name,kernel", [(name, "mtp") for name in SCHEMES] + [("8da4w-g32", "executorch")]
)
def test_arm64_verify_rows_are_bitwise_one_token_steps(
    device_dir, tmp_path, tmp_path_factory, name, kernel
):
    """test_executorch's row test, on ARM64 under qemu through the native core: every row of a
    multi-token call equals bit for bit the one-token call at its position. The ARM64 logits are
    also close to the x86 build's (not equal: other kernels, other rounding)."""
    programs_in(tmp_path_factory)
    tokens = [(11 * i + 3) % VOCAB for i in range(12)]
    spec = {
        "program": str(exported(name, kernel)[0]),
        "max_seq_len": MAX_SEQ_LEN,
        "max_chunk": CHUNK,
        "vocab": VOCAB,
        "row_exact": kernel == "mtp",
        "sessions": row_calls(tokens),
    }
    arm = ["qemu-aarch64", "-cpu", QEMU_CPU, "-L", SYSROOT, str(device_dir / "mtp-logits")]
    steps, wide, end_steps, end_wide = logits_of(arm, spec, tmp_path / "arm64.f32")
    assert np.array_equal(wide, steps), name
    assert np.array_equal(end_wide, end_steps), name
    native_runner.build(jobs=1)
    x86 = logits_of([str(native_runner.BUILD_DIR / "mtp-logits")], spec, tmp_path / "x86.f32")[0]
    assert np.abs(steps - x86).max() <= 0.05 * np.abs(x86).max(), name


def test_mtp_profile_through_the_emulated_device(
    bundle, prompts, device_dir, tmp_path, monkeypatch
):
    """`mtp-profile --device qemu-arm64` with ADB set to the stand-in: the runner folder (runner
    and lib/) and the bundle are pushed, each prompt runs on the ARM64 runner under qemu, and the
    pulled reports merge into one lossless report."""
    root = tmp_path / "device"
    monkeypatch.setenv("ADB", str(CROSS / "qemu-adb"))
    monkeypatch.setenv("MTP_QEMU_ADB_ROOT", str(root))
    monkeypatch.setenv("MTP_QEMU_CPU", QEMU_CPU)
    out = tmp_path / "device.json"
    args = ["--device", "qemu-arm64", "--bundle", str(bundle), "--prompts", str(prompts)]
    args += ["--runner", str(device_dir / "mtp-runner"), "--as", "pixel-9", "--json", str(out)]
    result = CliRunner().invoke(profile, [*args, "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    pushed = root / "data/local/tmp/mtp"
    assert runner_abi(pushed / "mtp-runner") == "arm64-v8a"
    for lib in (device_dir / "lib").iterdir():
        assert (pushed / "lib" / lib.name).read_bytes() == lib.read_bytes()
    report = json.loads(out.read_text())
    assert report["device_info"]["abi"] == "arm64-v8a"
    assert report["device_info"]["model"] == f"qemu-aarch64 -cpu {QEMU_CPU}"
    assert [r["id"] for r in report["prompts"]] == ["a", "b", "c"]
    assert report["summary"]["lossless"]
    assert all(r["spec_token_ids"] == r["ar_token_ids"] for r in report["prompts"])
