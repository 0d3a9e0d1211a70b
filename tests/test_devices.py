"""Device catalog, roofline prediction, the bench report, and mtp-profile (host and adb).

The adb path runs against tests/fake_adb/adb, a stand-in that records every command and answers
like one phone would (no phone is attached to the machine these tests run on).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from mtp_edge.cli import bench, devices, predict, profile
from mtp_edge.devices import cost as cost_module
from mtp_edge.devices import predict as roofline
from mtp_edge.devices.catalog import Device, catalog, find_device, host_device
from mtp_edge.devices.profile import merge_reports, runner_abi
from mtp_edge.manifest import Manifest

FAKE_ADB = Path(__file__).parent / "fake_adb"


def error_line(result) -> str:
    """The one `error:` line a failing command printed (after any progress lines)."""
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: "), result.output
    return last


@pytest.fixture(scope="module")
def model_dir(tiny_dir_seed5):
    return tiny_dir_seed5  # conftest.py's, shared


@pytest.fixture(scope="module")
def bundle(ngram_bundle_8da4w):
    """A tiny 8da4w bundle of model_dir with the n-gram drafter (no heads ship for a random
    model): conftest.py's, shared."""
    return ngram_bundle_8da4w


@pytest.fixture(scope="module")
def bundle_8bit(ngram_bundle_8da8w):
    """The same model as an 8da8w bundle named tiny-8da8w: conftest.py's, shared."""
    return ngram_bundle_8da8w


@pytest.fixture()
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {
            "id": "a",
            "category": "code",
            "prompt": "def add(a, b): return a + b",
            "max_new_tokens": 8,
        },
        {"id": "b", "category": "chat", "prompt": "hello hello hello", "max_new_tokens": 8},
        {"id": "c", "category": "qa", "prompt": "one two three one two", "max_new_tokens": 8},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- catalog -------------------------------------------------------------------------------------


def test_catalog_names_a_source_for_every_figure():
    devices = catalog()
    assert len(devices) >= 12
    assert {"phone", "laptop"} <= {d.kind for d in devices}
    assert len({d.name for d in devices}) == len(devices)
    for d in devices:
        assert d.bandwidth_gbs > 0 and d.cpu_int8_gops > 0, d.name
        for figure in ("memory_bandwidth_gbs", "ram_gb", "cpu", "cpu_int8_gops", "npu_int8_tops"):
            assert d.sources[figure].strip(), (d.name, figure)


def test_host_is_measured_live():
    host = find_device("host")
    assert host.measured and host.bandwidth_gbs > 0.1 and host.cpu_int8_gops > 0.1
    assert "measured" in host.sources["memory_bandwidth_gbs"]


def test_mtp_devices_lists_host_and_catalog():
    result = CliRunner().invoke(devices, ["--json", "-"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert rows[0]["name"] == "host" and rows[0]["measured"]
    assert len(rows) == len(catalog()) + 1


def test_unknown_device_is_one_line_error(bundle):
    result = CliRunner().invoke(predict, ["--bundle", str(bundle), "--device", "pixel-99"])
    assert "unknown device 'pixel-99'" in error_line(result)


# --- roofline ------------------------------------------------------------------------------------


def test_program_shape_is_read_from_the_pte(bundle, bundle_8bit):
    """The tiny llama: 2 layers, 4 query heads and 2 KV heads of 16 dims, cache of 96."""
    cost = cost_module.bundle_cost(bundle)
    t = cost.target
    assert (t.layers, t.q_heads, t.kv_heads, t.head_dim, t.cache_len) == (2, 4, 2, 16, 96)
    assert 0 < t.embedding_bytes < t.file_bytes
    assert cost.vocab == 97 and cost.hidden == 64
    # 8-bit weights stream more bytes than 4-bit ones (a tiny program is mostly structure)
    cost8 = cost_module.bundle_cost(bundle_8bit)
    assert cost8.target_bits == 8 and cost.target_bits == 4 + 16 / 32
    assert cost8.target.streamed_bytes > 1.25 * t.streamed_bytes


def test_cost_grows_with_tokens_and_context(bundle):
    cost = cost_module.bundle_cost(bundle)
    t = cost.target
    b1, f1 = cost.target_call(1, 0)
    b5, f5 = cost.target_call(5, 0)
    b1c, f1c = cost.target_call(1, 40)
    kv_per_position = 2 * t.layers * t.kv_heads * t.head_dim * 4
    assert b1c - b1 == pytest.approx(40 * kv_per_position)
    assert f1c - f1 == pytest.approx(4 * t.layers * t.q_heads * t.head_dim * 40)
    assert b5 > b1 and f5 > 4.9 * f1 - 1  # weights are read once, the math is per token


def synthetic_cost() -> cost_module.BundleCost:
    shape = cost_module.ProgramShape(
        file_bytes=110_000_000,
        embedding_bytes=10_000_000,
        embedding_rows=10_000,
        hidden=512,
        layers=10,
        kv_heads=2,
        head_dim=64,
        q_heads=8,
        cache_len=1024,
    )
    return cost_module.BundleCost("synthetic", shape, 4.0, 32.0, 10_000, 512, "ngram", None, 4)


def device(bandwidth_gbs: float, int8_gops: float) -> Device:
    return Device(
        "test", "test", "phone", "soc", "arm64-v8a", 8, bandwidth_gbs, "cpu", int8_gops,
        None, None, None, {}, measured=True,
    )  # fmt: skip


CALIBRATION = roofline.Calibration(
    bandwidth_gbs=50.0,
    compute_gops=1000.0,
    compute_efficiency=0.5,
    target_overhead_ms=1.0,
    draft_overhead_ms=0.0,
    plain_loop_ms=0.0,
    spec_loop_ms=0.0,
    measured_ms={},
)


def test_prediction_on_a_memory_bound_device():
    """Hand-computed: 100 MB of weights at 50 GB/s = 2 ms; 200 MFLOP at 1 Top/s = 0.2 ms."""
    cost = synthetic_cost()
    acceptance = {"tau": 2.5, "drafted_per_step": 4.0, "context": 0, "source": "test"}
    p = roofline.predict(cost, device(50, 2000), CALIBRATION, acceptance)
    b1, f1 = cost.target_call(1, 0)
    assert p["plain"]["ms"] == pytest.approx(1.0 + b1 / 50e9 * 1e3 + f1 / 1e12 * 1e3, abs=1e-3)
    assert p["plain"]["bound"] == "memory"
    b5, f5 = cost.target_call(5, 0)
    verify_ms = 1.0 + b5 / 50e9 * 1e3 + f5 / 1e12 * 1e3
    assert p["speculative"]["tokens_per_s"] == pytest.approx(2.5 / verify_ms * 1e3, rel=1e-3)
    assert p["speedup"] > 1.5  # a 5-token verify costs little more than 1 token


def test_a_verification_checks_what_its_step_drafted():
    """Where a confidence floor leaves 1.5 drafted tokens a step on average, the verification
    is a call of 2.5 tokens, not k + 1 = 5."""
    cost = synthetic_cost()
    acceptance = {"tau": 1.8, "drafted_per_step": 1.5, "context": 0, "source": "test"}
    starved = roofline.Calibration(**{**CALIBRATION.__dict__, "compute_gops": 20.0})
    p = roofline.predict(cost, device(50, 40), starved, acceptance)
    b, f = cost.target_call(2.5, 0)
    verify_ms = 1.0 + (b / 50e9 + f / 20e9) * 1e3
    assert p["speculative"]["verify_tokens"] == 2.5
    assert p["speculative"]["verify"]["ms"] == pytest.approx(verify_ms, abs=1e-3)
    full = roofline.predict(cost, device(50, 40), starved, {**acceptance, "drafted_per_step": 4.0})
    assert full["speculative"]["verify_tokens"] == 5
    assert full["speculative"]["verify"]["ms"] > 1.5 * p["speculative"]["verify"]["ms"]


def test_prediction_on_a_compute_starved_device():
    """With little compute the verify call is compute-bound and speculation stops paying."""
    cost = synthetic_cost()
    slow = roofline.Calibration(**{**CALIBRATION.__dict__, "compute_gops": 20.0})
    acceptance = {"tau": 1.3, "drafted_per_step": 4.0, "context": 0, "source": "test"}
    p = roofline.predict(cost, device(50, 40), slow, acceptance)
    assert p["speculative"]["verify"]["bound"] == "compute"
    assert p["speedup"] < 1.0


def test_the_host_calibration_keeps_one_runs_figures_together():
    """The least disturbed run's figures, all of them: not one run's bandwidth with another's
    overhead, which predicted plain decoding 36% too fast on a noisy run."""
    runs = [
        roofline.Calibration(
            **{**CALIBRATION.__dict__, **figures, "measured_ms": {"target_1_token": one}}
        )
        for one, figures in (
            (9.9, {"bandwidth_gbs": 38.0, "target_overhead_ms": 0.0}),
            (8.2, {"bandwidth_gbs": 30.0, "target_overhead_ms": 1.9}),
            (9.3, {"bandwidth_gbs": 33.0, "target_overhead_ms": 4.3}),
        )
    ]
    chosen = roofline.best(runs)
    assert (chosen.bandwidth_gbs, chosen.target_overhead_ms) == (30.0, 1.9)
    assert [r["target_1_token"] for r in chosen.measured_ms["runs"]] == [9.9, 8.2, 9.3]


def test_the_host_check_compares_verify_cost_too():
    cost = synthetic_cost()
    acceptance = {"tau": 2.0, "drafted_per_step": 4.0, "context": 0, "source": "test"}
    p = roofline.predict(cost, device(50, 2000), CALIBRATION, acceptance)
    measured = p["speculative"]["verify_over_decode"] * 1.2
    summary = {
        "ar_tokens_per_s": p["plain"]["tokens_per_s"],
        "spec_tokens_per_s": p["speculative"]["tokens_per_s"],
        "speedup": p["speedup"],
        "verify_over_decode": measured,
    }
    check = roofline.compare_with_measured(p, {"summary": summary})
    assert check["verify / decode"]["error"] == pytest.approx(-1 / 6, abs=1e-3)
    assert not check["verify / decode"]["within_goal"]  # 17% off: the goal is 15%
    assert check["speedup"]["within_goal"] and check["plain"]["error"] == 0


def test_catalog_device_uses_peak_times_efficiency():
    cost = synthetic_cost()
    phone = [d for d in catalog() if d.name == "galaxy-s24-ultra"][0]
    acceptance = {"tau": 2.0, "drafted_per_step": 4.0, "context": 64, "source": "test"}
    p = roofline.predict(cost, phone, CALIBRATION, acceptance)
    assert p["bandwidth_gbs_used"] == pytest.approx(76.8 * roofline.CATALOG_BANDWIDTH_EFFICIENCY)
    assert p["compute_gops_used"] == pytest.approx(phone.cpu_int8_gops * 0.5, abs=0.1)


def test_predict_cli_compares_with_the_bench_on_host(bundle, prompts, tmp_path):
    bench_json = tmp_path / "bench.json"
    args = ["--bundle", str(bundle), "--prompts", str(prompts), "--json", str(bench_json)]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    out = tmp_path / "predict.json"
    args = ["--bundle", str(bundle), "--device", "host", "--device", "pixel-9"]
    result = CliRunner().invoke(
        predict, [*args, "--from-bench", str(bench_json), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [p["device"] for p in data["predictions"]] == ["host", "pixel-9"]
    measured = json.loads(bench_json.read_text())["summary"]
    validation = data["host_validation"]
    assert validation["plain"]["measured"] == measured["ar_tokens_per_s"]
    assert validation["speculative"]["measured"] == measured["spec_tokens_per_s"]
    assert validation["plain"]["predicted"] > 0
    assert data["predictions"][0]["acceptance"]["tau"] == measured["tau"]
    ran = json.loads(bench_json.read_text())["k"]
    assert [p["k"] for p in data["predictions"]] == [ran, ran]
    # A measurement at another k (--k, or the k the runtime drafts on this CPU): predicted at it.
    other = json.loads(bench_json.read_text())
    other["k"] = ran - 1
    bench_json.write_text(json.dumps(other))
    result = CliRunner().invoke(
        predict, [*args, "--from-bench", str(bench_json), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert [p["k"] for p in json.loads(out.read_text())["predictions"]] == [ran - 1, ran - 1]


def test_predict_drafts_on_each_device_as_its_runtime_would(bundle_8bit, tmp_path, monkeypatch):
    """Without a measurement, each device is predicted at the k its runtime drafts: the 8da8w
    bundle's k on a CPU with an int8 dot product (the phone's, a VNNI host), fewer on an AVX2
    host (runtime/assemble.py k_for_this_cpu)."""
    bundle_k = Manifest.load(bundle_8bit, verify=False).drafter.k
    out = tmp_path / "predict.json"
    args = ["--bundle", str(bundle_8bit), "--device", "host", "--device", "pixel-9"]
    for path, host_k in (("avx2", 3), ("avx512-vnni", bundle_k)):
        monkeypatch.setenv("MTP_EDGE_INT8_PATH", path)
        result = CliRunner().invoke(predict, [*args, "--json", str(out)])
        assert result.exit_code == 0, result.output
        predictions = json.loads(out.read_text())["predictions"]
        assert [p["k"] for p in predictions] == [host_k, bundle_k], path


def test_own_int8_bundle_is_predicted_on_the_host_only(own_int8_bundle, tmp_path):
    """An 8da8w-avx2 bundle runs our own int8 kernel, whose speed the catalog's dot-product
    figures do not describe: a catalog device is a one-line refusal, `all` is the host alone."""
    quant = json.loads((own_int8_bundle / "manifest.json").read_text())["models"]["target"]
    assert quant["quant"]["head"] == "8da6w-avx2"  # the manifest says what --head-quant chose
    args = ["--bundle", str(own_int8_bundle), "--device", "pixel-9"]
    line = error_line(CliRunner().invoke(predict, args))
    assert "8da8w-avx2" in line and "--device host" in line
    out = tmp_path / "predict.json"
    args = ["--bundle", str(own_int8_bundle), "--device", "all", "--json", str(out)]
    result = CliRunner().invoke(predict, args)
    assert result.exit_code == 0, result.output
    assert [p["device"] for p in json.loads(out.read_text())["predictions"]] == ["host"]
    assert "host only" in result.stderr


def test_held_out_tau_at_a_smaller_k_adds_up_its_positions():
    """A bundle's heads were scored at their k; at a smaller k tau is 1 + that many positions'
    acceptance (the share of steps whose i-th drafted token was kept)."""
    recipe = {"k": 4, "heldout_acceptance": [0.5, 0.3, 0.2, 0.1], "heldout_tau": 2.1}
    manifest = SimpleNamespace(drafter=SimpleNamespace(recipe=recipe))
    assert roofline.acceptance_from(None, manifest, 4)["tau"] == 2.1
    assert roofline.acceptance_from(None, manifest, 3)["tau"] == pytest.approx(2.0)
    assert roofline.acceptance_from(None, manifest, 1)["tau"] == pytest.approx(1.5)
    assert "k = 3" in roofline.acceptance_from(None, manifest, 3)["source"]


def test_an_lm_head_in_our_kernel_is_predicted_on_the_host_only(bundle, copy_bundle):
    """An XNNPACK scheme whose head is ours (--head-quant 8da6w-avx2): the catalog's figures
    do not describe that kernel either (the manifest edited to say so)."""
    edited = copy_bundle(bundle, "head6")
    path = edited / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["models"]["target"]["quant"]["head"] = "8da6w-avx2"
    path.write_text(json.dumps(manifest))
    line = error_line(CliRunner().invoke(predict, ["--bundle", str(edited), "--device", "pixel-9"]))
    assert "its LM head in 8da6w-avx2" in line and "--device host" in line
    assert (
        CliRunner().invoke(predict, ["--bundle", str(bundle), "--device", "pixel-9"]).exit_code == 0
    )


def test_predict_refuses_a_file_that_is_not_a_bench_report(bundle, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = CliRunner().invoke(predict, ["--bundle", str(bundle), "--from-bench", str(bad)])
    assert "not an mtp-bench --json report" in error_line(result)


# --- the report ----------------------------------------------------------------------------------


def test_bench_report_with_compare_and_repeat(bundle, bundle_8bit, prompts, tmp_path):
    out = tmp_path / "report"
    args = ["--bundle", str(bundle), "--compare", str(bundle_8bit), "--prompts", str(prompts)]
    args += ["--repeat", "2", "--report", str(out), "--json", str(tmp_path / "bench.json")]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    # interleaved: every prompt on both bundles before the next prompt
    lines = [line for line in result.stderr.splitlines() if line.startswith("[")]
    order = [line.split()[1].rstrip(":") for line in lines if "/3]" in line]
    assert order == ["tiny-8da4w", "tiny-8da8w"] * 3
    page = (out / "report.md").read_text()
    pngs = [
        "speedup_tau_by_category.png",
        "acceptance_by_position.png",
        "tokens_per_s_per_prompt.png",
        "ttft_per_prompt.png",
    ]
    for png in pngs:
        assert f"]({png})" in page
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "memory read bandwidth measured now" in page and "mtp-bench" in page
    report = json.loads((out / "report.json").read_text())
    assert report["machine"]["memory_bandwidth_gbs"] > 0
    runs = report["runs"]
    assert [Path(r["bundle"]).name for r in runs] == ["tiny-8da4w", "tiny-8da8w"]
    assert not any("shared_with" in r["peer_textllmrunner"] for r in runs)  # two programs
    for r in runs:
        spread = r["summary"]["spread"]
        assert len(spread["ar_tokens_per_s"]["runs"]) == 2
        low, high = spread["ar_tokens_per_s"]["min"], spread["ar_tokens_per_s"]["max"]
        assert low <= r["summary"]["ar_tokens_per_s"] <= high
        assert all(len(row["ar_tokens_per_s_runs"]) == 2 for row in r["prompts"])
    assert not list(tmp_path.glob(".report*"))  # written via a temporary directory


def test_compare_k_values_of_one_bundle(bundle, prompts, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--bundle", str(bundle), "--compare", f"{bundle},k=2", "--prompts", str(prompts)]
    result = CliRunner().invoke(bench, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["k"] for r in runs] == [4, 2]
    # One target program: ExecuTorch's runner decodes it once, both setups report it.
    first, second = runs[0]["peer_textllmrunner"], runs[1]["peer_textllmrunner"]
    assert "shared_with" not in first and second.pop("shared_with").startswith(bundle.name)
    assert second == first
    bad = CliRunner().invoke(bench, ["--bundle", str(bundle), "--compare", f"{bundle},q=1"])
    assert "expected DIR[,k=N][,drafter=NAME][,draft_confidence=P]" in error_line(bad)
    bad = CliRunner().invoke(
        bench, ["--bundle", str(bundle), "--compare", f"{bundle},confidence=2"]
    )
    assert "not 'confidence=2'" in error_line(bad)


def test_compare_reports_a_bad_bundle_in_one_line(bundle, prompts, tmp_path):
    """Compared setups load in worker processes; a user error there still ends in one line."""
    missing = tmp_path / "no-such-bundle"
    args = ["--bundle", str(bundle), "--compare", str(missing), "--prompts", str(prompts)]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 2
    assert str(missing) in error_line(result)
    assert "Traceback" not in result.output


def test_compare_needs_a_first_bundle(prompts):
    result = CliRunner().invoke(bench, ["--compare", "x", "--prompts", str(prompts)])
    assert "--compare" in error_line(result)


def test_builtin_suite_meets_the_issue():
    from mtp_edge.devices.harness import load_prompts

    suite = load_prompts()
    categories = {p.category for p in suite}
    assert len(suite) >= 40 and len(categories) >= 7
    assert {
        "code",
        "chat",
        "summarization",
        "math",
        "translation",
        "structured",
        "qa",
    } <= categories


# --- mtp-profile on the host ---------------------------------------------------------------------


def test_profile_on_host_reports_measurement_and_prediction(bundle, prompts, tmp_path):
    out = tmp_path / "host.json"
    args = ["--device", "host", "--bundle", str(bundle), "--prompts", str(prompts)]
    result = CliRunner().invoke(profile, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["summary"]["prompts"] == 3 and len(report["prompts"]) == 3
    assert report["prediction"]["device"] == "host"
    assert set(report["host_validation"]) == {"plain", "speculative", "verify / decode", "speedup"}
    assert "predicted" in result.stdout and "measured" in result.stdout


# --- mtp-profile over adb (stand-in adb) ---------------------------------------------------------


@pytest.fixture()
def fake_adb(tmp_path, monkeypatch):
    """The stand-in adb first on PATH; returns (set_scenario, recorded_commands, device_root)."""
    log, root = tmp_path / "adb.log", tmp_path / "device"
    root.mkdir()
    monkeypatch.setenv("PATH", f"{FAKE_ADB}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("ADB", raising=False)
    monkeypatch.setenv("FAKE_ADB_LOG", str(log))
    monkeypatch.setenv("FAKE_ADB_ROOT", str(root))

    def scenario(name: str):
        monkeypatch.setenv("FAKE_ADB_SCENARIO", name)

    def commands() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    scenario("ok")
    return scenario, commands, root


@pytest.fixture()
def runner_binary(tmp_path) -> Path:
    """A file with the ELF header of an arm64 executable (the device never runs it here)."""
    path = tmp_path / "mtp-runner"
    header = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HH", 2, 0xB7)
    path.write_bytes(header + bytes(44))
    return path


def run_profile(bundle, prompts, runner_binary, tmp_path, *extra):
    args = ["--device", "FAKE123", "--bundle", str(bundle), "--prompts", str(prompts)]
    args += ["--runner", str(runner_binary), "--json", str(tmp_path / "device.json"), *extra]
    return CliRunner().invoke(profile, args)


def test_profile_over_adb_pushes_runs_and_pulls(bundle, prompts, runner_binary, tmp_path, fake_adb):
    _, commands, root = fake_adb
    result = run_profile(bundle, prompts, runner_binary, tmp_path, "--max-new-tokens", "16")
    assert result.exit_code == 0, result.output
    calls = [c[2:] for c in commands() if c[:2] == ["-s", "FAKE123"]]
    pushes = {c[2] for c in calls if c[0] == "push"}
    for f in Path(bundle).iterdir():
        assert f"/data/local/tmp/mtp/bundle/{f.name}" in pushes
    assert "/data/local/tmp/mtp/mtp-runner" in pushes
    shells = [c[1] for c in calls if c[0] == "shell"]
    assert "chmod 755 /data/local/tmp/mtp/mtp-runner" in shells
    runs = [s for s in shells if "./mtp-runner" in s]
    assert len(runs) == 3
    assert all(s.startswith("cd /data/local/tmp/mtp && ./mtp-runner --bundle bundle") for s in runs)
    assert all("--max-new-tokens 16" in s and "--repeat 1" in s for s in runs)
    assert [c[1] for c in calls if c[0] == "pull"] == [
        f"/data/local/tmp/mtp/out/{i:03d}.json" for i in range(3)
    ]
    # device checks before anything is pushed
    first_push = next(i for i, c in enumerate(calls) if c[0] == "push")
    asked = " ".join(c[1] for c in calls[:first_push] if c[0] == "shell")
    for check in ("ro.product.model", "ro.soc.model", "ro.product.cpu.abi", "df -k", "battery"):
        assert check in asked
    assert (root / "data/local/tmp/mtp/bundle/manifest.json").exists()
    report = json.loads((tmp_path / "device.json").read_text())
    assert report["device_info"]["model"] == "Pixel 9"
    assert report["summary"]["prompts"] == 3 and report["prediction"]["device"] == "pixel-9"
    assert "Pixel 9" in result.stderr and "pixel-9" in result.stdout


def test_profile_over_adb_with_the_real_runner(bundle, prompts, tmp_path, fake_adb):
    """The stand-in device runs what was pushed: a host build of the native mtp-runner on the
    pushed bundle and prompts; the pulled reports merge into one, lossless like the runner's."""
    from mtp_edge.runtime import native_runner

    set_scenario, commands, root = fake_adb
    set_scenario("exec")  # the stand-in reports an x86_64 device, like the host-built runner
    runner = native_runner.build(jobs=1)
    result = run_profile(bundle, prompts, runner, tmp_path, "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "device.json").read_text())
    assert [r["id"] for r in report["prompts"]] == ["a", "b", "c"]
    s = report["summary"]
    assert s["prompts"] == 3 and s["lossless"] and s["ar_tokens_per_s"] > 0
    assert all(r["identical"] or r["near_tie"] for r in report["prompts"])
    assert (root / "data/local/tmp/mtp/out/002.json").exists()


def test_merged_device_report_recomputes_totals(bundle, prompts, runner_binary, tmp_path, fake_adb):
    """The stand-in answers 40+i tok/s plain, 64+2i speculative for prompt i (32 decode tokens)."""
    result = run_profile(bundle, prompts, runner_binary, tmp_path)
    assert result.exit_code == 0, result.output
    s = json.loads((tmp_path / "device.json").read_text())["summary"]
    plain_seconds = sum(32 / (40 + i) for i in range(3))
    spec_seconds = sum(32 / (64 + 2 * i) for i in range(3))
    assert s["ar_tokens_per_s"] == pytest.approx(96 / plain_seconds, rel=1e-3)
    assert s["spec_tokens_per_s"] == pytest.approx(96 / spec_seconds, rel=1e-3)
    assert s["tau"] == pytest.approx(2.0) and s["acceptance_by_position"] == [0.5, 0.25, 0.15, 0.1]


@pytest.mark.parametrize(
    "scenario, fragment",
    [
        ("no-device", "no device FAKE123 attached"),
        ("unauthorized", "unauthorized: unlock it and accept"),
        ("offline", "is offline"),
        ("wrong-abi", "device FAKE123 is x86_64, but mtp-runner is built for arm64-v8a"),
        ("low-storage", "MB free in /data/local/tmp/mtp"),
    ],
)
def test_profile_device_errors(
    bundle, prompts, runner_binary, tmp_path, fake_adb, scenario, fragment
):
    set_scenario, commands, _ = fake_adb
    set_scenario(scenario)
    result = run_profile(bundle, prompts, runner_binary, tmp_path)
    assert fragment in error_line(result)
    assert not [c for c in commands() if "push" in c]  # refused before pushing anything


def test_device_lost_mid_run_keeps_what_was_measured(
    bundle, prompts, runner_binary, tmp_path, fake_adb
):
    set_scenario, _, _ = fake_adb
    set_scenario("lost-after-2")
    result = run_profile(bundle, prompts, runner_binary, tmp_path)
    line = error_line(result)
    assert "lost" in line and "kept the 2 of 3 prompts" in line
    partial = json.loads((tmp_path / "device.json").read_text())
    assert [r["id"] for r in partial["prompts"]] == ["a", "b"]
    assert partial["incomplete"]["prompts_measured"] == 2
    assert partial["summary"]["prompts"] == 2


def test_no_adb_on_path(bundle, prompts, runner_binary, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no adb here
    monkeypatch.delenv("ADB", raising=False)
    result = run_profile(bundle, prompts, runner_binary, tmp_path)
    assert "adb is not installed" in error_line(result)


def test_missing_runner_says_how_to_build_it(bundle, prompts, tmp_path, fake_adb):
    result = run_profile(bundle, prompts, tmp_path / "nowhere", tmp_path)
    assert "no native runner" in error_line(result) and "--runner" in error_line(result)


def test_runner_abi_from_elf_header(runner_binary, tmp_path):
    assert runner_abi(runner_binary) == "arm64-v8a"
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\n")
    assert runner_abi(script) is None


def test_merge_of_one_part_is_that_part():
    part = {
        "bundle": "b",
        "backend": "executorch",
        "drafter": "mtp",
        "k": 2,
        "summary": {
            "lossless": True,
            "near_tie_tolerance": 0.02,
            "acceptance_rate": 0.5,
            "acceptance_by_position": [0.6, 0.4],
            **dict.fromkeys(
                ["ar_ms_per_step", "verify_ms_per_step", "verify_over_decode", "draft_ms_per_step"]
                + ["draft_over_decode", "ttft_ms_ar", "ttft_ms_spec"],
                1.0,
            ),
        },
        "prompts": [
            {
                "id": "x",
                "category": "c",
                "ar_tokens": 11,
                "spec_tokens": 11,
                "ar_tokens_per_s": 10.0,
                "spec_tokens_per_s": 20.0,
                "speedup": 2.0,
                "tau": 2.0,
                "verify_steps": 5,
                "identical": True,
            }
        ],
    }
    merged = merge_reports([part])["summary"]
    assert merged["ar_tokens_per_s"] == pytest.approx(10.0)
    assert merged["speedup"] == pytest.approx(2.0)
    assert merged["tau"] == pytest.approx(2.0)
    assert merged["acceptance_rate"] == pytest.approx(0.5)
    assert merged["acceptance_by_position"] == [0.6, 0.4]


def test_manifest_still_loads_after_profile(bundle):
    Manifest.load(bundle)  # the bundle is read, never changed, by the commands above
    assert host_device() is host_device()  # measured once per process


# --- the CPU's int8 path ---------------------------------------------------------------------

# /proc/cpuinfo lines of real machines (shortened to the flags that decide)
CPUINFO_AVX2_EPYC = (
    "model name\t: AMD EPYC\n"
    "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes\n"
)
CPUINFO_ICELAKE = "flags\t\t: sse4_1 avx avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16\n"
CPUINFO_ALDER_LAKE = "flags\t\t: sse4_1 avx avx2 fma avx_vnni\n"
CPUINFO_SKYLAKE_X = "flags\t\t: sse4_1 avx avx2 avx512f avx512bw avx512vl\n"
CPUINFO_PI5 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 asimddp lrcpc\n"
CPUINFO_X4 = "Features\t: fp asimd asimddp sve sve2 i8mm bf16 asimdhp\n"
CPUINFO_SME = "Features\t: fp asimd asimddp i8mm bf16 sme sme2\n"
CPUINFO_A53 = "Features\t: fp asimd evtstrm crc32 cpuid\n"


@pytest.mark.parametrize(
    "text, name, dot, rows",
    [
        (CPUINFO_AVX2_EPYC, "avx2", False, 4),
        (CPUINFO_ICELAKE, "avx512-vnni", True, 5),
        (CPUINFO_ALDER_LAKE, "avx-vnni", True, 5),
        (CPUINFO_SKYLAKE_X, "avx512", False, 8),
        (CPUINFO_PI5, "neon-dot", True, 4),
        (CPUINFO_X4, "i8mm", True, 4),
        (CPUINFO_SME, "sme", True, 4),
        (CPUINFO_A53, "neon", False, None),
        ("model name\t: something\n", "unknown", False, None),
    ],
)
def test_int8_path_from_cpuinfo(text, name, dot, rows):
    from mtp_edge.machine import int8_path

    path = int8_path(text)
    assert (path.name, path.dot_product, path.xnnpack_rows) == (name, dot, rows)
    assert path.blockwise_rows == (3 if name == "avx2" else None)


@pytest.mark.parametrize(
    "path, scheme, k, expected",
    [
        ("avx2", "8da8w", None, 3),  # no dot product, a 4-row tile: k + 1 within it
        ("sse4", "8da8w", None, 3),
        ("avx512", "8da8w", None, 4),  # an 8-row tile holds 5 rows
        ("avx512-vnni", "8da8w", None, 4),  # a dot product: the bundle's k
        ("i8mm", "8da8w", None, 4),
        ("neon", "8da8w", None, 4),  # tile not known: the bundle's k
        ("avx2", "8da4w", None, 2),  # 4-bit in groups: the groupwise GEMM's 3-row tile
        ("avx512", "8da4w", None, 4),  # its tile there not known: the bundle's k
        ("avx512-vnni", "8da4w", None, 4),
        ("avx2", "8da8w", 4, 4),  # a k given is never changed
    ],
)
def test_a_bundle_s_k_fits_this_cpu_s_int8_tile(
    ngram_bundle_8da8w, ngram_bundle_8da4w, monkeypatch, path, scheme, k, expected
):
    from dataclasses import replace

    from tiny import setup_options

    from mtp_edge.runtime.assemble import assemble

    bundle = {"8da8w": ngram_bundle_8da8w, "8da4w": ngram_bundle_8da4w}[scheme]
    monkeypatch.setenv("MTP_EDGE_INT8_PATH", path)
    assert assemble(replace(setup_options(bundle, 96), k=k)).config.k == expected


def test_an_int8_path_that_is_none_is_one_line(ngram_bundle_8da8w, monkeypatch):
    from click.testing import CliRunner

    from mtp_edge.cli import run

    monkeypatch.setenv("MTP_EDGE_INT8_PATH", "avx3")
    result = CliRunner().invoke(run, ["--bundle", str(ngram_bundle_8da8w), "--prompt", "x"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "error: MTP_EDGE_INT8_PATH=avx3 is not an int8 path: use one of avx512-vnni, avx-vnni, "
        "avx512, avx2, sse4, sme, i8mm, neon-dot, neon, unknown, or unset it to read the CPU's "
        "flags"
    )


def test_host_reports_its_int8_path_and_rates():
    from mtp_edge.machine import INT8_PATHS, int8_path

    host = host_device()
    assert host.int8_path == int8_path().name and host.int8_path in INT8_PATHS
    assert host.cpu_int8_gops > 0.1 and host.cpu_fp32_gflops > 0.1
    assert "cpu_int8_path" in host.sources


def test_catalog_says_which_int8_path_each_device_has():
    from mtp_edge.machine import INT8_PATHS

    for d in catalog():
        assert d.int8_path in INT8_PATHS and d.sources["cpu_int8_path"].strip(), d.name
        # every catalogued phone has a dot product (SDOT or SMMLA); so do the x86 laptops (VNNI)
        assert INT8_PATHS[d.int8_path].dot_product, d.name
    by_name = {d.name: d.int8_path for d in catalog()}
    assert by_name["raspberry-pi-5"] == "neon-dot" and by_name["galaxy-s24-ultra"] == "i8mm"


def test_devices_table_says_when_there_is_no_dot_product():
    from dataclasses import replace

    from mtp_edge.devices.catalog import devices_table

    table = devices_table([replace(device(30, 100), int8_path="avx2")])
    assert "avx2 (no dot product)" in table
    assert "| i8mm |" in devices_table([replace(device(30, 100), int8_path="i8mm")])


def default_like_cost() -> cost_module.BundleCost:
    """SmolLM2-135M's shape at 8da8w: 30 layers, 9 query / 3 KV heads of 64, ~138 MB streamed."""
    shape = cost_module.ProgramShape(
        file_bytes=166_000_000,
        embedding_bytes=28_500_000,
        embedding_rows=49_152,
        hidden=576,
        layers=30,
        kv_heads=3,
        head_dim=64,
        q_heads=9,
        cache_len=2048,
    )
    return cost_module.BundleCost("default-like", shape, 8.0, 8.0, 49_152, 576, "ngram", None, 4)


def test_verify_cost_follows_the_int8_rate():
    """Same bandwidth and overhead, the int8 rate of an AVX2-only host against a 4x faster one
    (VNNI's VPDPBUSD does four int8 multiply-adds where AVX2's VPMADDWD path does one after
    widening): a 5-token verification costs ~1.7 decoding steps on the first, ~1.2 on the
    second, and the verification is compute-bound only on the first."""
    cost = default_like_cost()
    acceptance = {"tau": 1.8, "drafted_per_step": 4.0, "context": 150, "source": "test"}

    def at(int8_gops: float) -> dict:
        figures = {"compute_gops": int8_gops, "bandwidth_gbs": 30.0, "target_overhead_ms": 1.5}
        c = roofline.Calibration(**{**CALIBRATION.__dict__, **figures})
        return roofline.predict(cost, device(30, int8_gops), c, acceptance)

    avx2, vnni = at(215.0), at(860.0)
    assert avx2["speculative"]["verify_over_decode"] == pytest.approx(1.7, abs=0.08)
    assert vnni["speculative"]["verify_over_decode"] == pytest.approx(1.2, abs=0.05)
    assert avx2["speculative"]["verify"]["bound"] == "compute"
    assert vnni["speculative"]["verify"]["bound"] == "memory"
    assert vnni["speedup"] > avx2["speedup"] * 1.3
    ratios = [at(r)["speculative"]["verify_over_decode"] for r in (100, 200, 400, 800, 1600)]
    assert ratios == sorted(ratios, reverse=True)


def test_bench_note_blames_the_int8_path_only_without_a_dot_product():
    from mtp_edge.machine import int8_bottleneck_note, int8_path

    avx2, vnni = int8_path(CPUINFO_AVX2_EPYC), int8_path(CPUINFO_ICELAKE)
    note = int8_bottleneck_note(1.74, avx2)
    assert note and "avx2 has no int8 dot product" in note and "1.74" in note
    assert int8_bottleneck_note(1.74, vnni) is None  # memory or attention, not int8 arithmetic
    assert int8_bottleneck_note(1.1, avx2) is None  # verification already cheap
