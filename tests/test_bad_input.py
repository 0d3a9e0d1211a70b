"""Bad input, as a new user gives it: bundles edited or broken, paths that leave the bundle, output
paths that cannot be written, signals, options out of range. Each class must end in exactly one
`error: ...` line on stderr that names the problem (and a remedy), no traceback, the exit code
(2: the user's mistake, 1: a fault of ours, 128 + N: signal N), and nothing left behind.
(Models, text and sampling values: tests/test_bad_input_models.py; the native reader:
tests/test_native.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtp_edge.cli import OneLineErrors, bench, export, predict, run, train
from mtp_edge.errors import Fault, UserError
from mtp_edge.manifest import Manifest

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tiny_dir_seed5):
    return tiny_dir_seed5  # conftest.py's, shared


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    """A tiny fp32 bundle with the n-gram drafter: quick to export, real ExecuTorch programs."""
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    args = ["--model", str(model_dir), "--out", str(out), "--quant", "fp32", "--drafter", "ngram",
            "--max-seq-len", str(MAX_SEQ_LEN), "--quality-tokens", "0"]  # fmt: skip
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def bundle(exported, tmp_path):
    """A copy of the bundle to break."""
    copy = tmp_path / "bundle"
    shutil.copytree(exported, copy)
    return copy


def edit_manifest(bundle: Path, edit) -> None:
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    replaced = edit(manifest)  # edits in place; a list replaces the whole manifest
    path.write_text(json.dumps(replaced if isinstance(replaced, list) else manifest))


def error_line(result, code: int = 2) -> str:
    """The one error line on stderr (progress lines may precede it), no traceback; the code."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1, result.stderr
    return lines[-1]


def run_bundle(bundle, *extra):
    args = ["--bundle", str(bundle), "--prompt", "the cat", "--max-new-tokens", "4", *extra]
    return CliRunner().invoke(run, args)


def leftovers(directory: Path, before: set) -> set:
    return {p.name for p in directory.iterdir()} - before


# --- the bundle: every file hashed, names inside it, a manifest of the declared shape -----------


def test_an_edited_vocabulary_is_refused(bundle):
    """Two vocabulary entries swapped: the bundle would answer with the other word."""
    path = bundle / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    (a, i), (b, j) = list(vocab.items())[40:42]
    vocab[a], vocab[b] = j, i
    path.write_text(json.dumps(data))
    line = error_line(run_bundle(bundle))
    assert "tokenizer.json does not match its sha256" in line and "re-export" in line


def test_an_edited_tokenizer_meta_is_refused(bundle):
    path = bundle / "tokenizer_meta.json"
    meta = json.loads(path.read_text())
    meta["eos_ids"] = [5]
    path.write_text(json.dumps(meta))
    assert "tokenizer_meta.json does not match its sha256" in error_line(run_bundle(bundle))


def test_a_bundle_without_tokenizer_hashes_is_refused(bundle):
    edit_manifest(bundle, lambda m: m["models"].pop("tokenizer"))
    line = error_line(run_bundle(bundle))
    assert "no sha256 for tokenizer.json" in line and "re-export" in line


@pytest.mark.parametrize("name", ["../outside/target.pte", "/etc/passwd",
                                  "../../../../etc/passwd", "sub/target.pte", ".."])  # fmt: skip
def test_file_names_that_leave_the_bundle_are_refused(bundle, name):
    edit_manifest(bundle, lambda m: m["models"]["target"].update(file=name))
    line = error_line(run_bundle(bundle))
    assert f"'{name}' is not a plain file name inside the bundle" in line


def test_a_symlink_out_of_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere.pte"
    shutil.move(bundle / "target.pte", outside)
    (bundle / "target.pte").symlink_to(outside)
    assert "links outside the bundle" in error_line(run_bundle(bundle))


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda m: m.pop("models"), "missing key 'models'"),
        (lambda m: [], "not a manifest object"),
        (lambda m: m.update(max_seq_len="lots"), "'max_seq_len' must be an integer"),
        (lambda m: m["drafter"].update(kind="oracle"), "'drafter.kind' is 'oracle'"),
        (lambda m: m.update(backend="tpu"), "backend 'tpu' is not supported"),
        (lambda m: m.update(format_version=99), "format version 99"),
    ],
)
def test_malformed_manifests_are_one_line(bundle, edit, key):
    edit_manifest(bundle, edit)
    assert key in error_line(run_bundle(bundle))


def test_predict_reads_a_malformed_manifest_in_one_line(bundle):
    edit_manifest(bundle, lambda m: m.pop("models"))
    result = CliRunner().invoke(predict, ["--bundle", str(bundle)])
    assert "missing key 'models'" in error_line(result)


def test_a_modified_program_is_refused_even_after_a_verified_start(bundle, tmp_path, monkeypatch):
    """The verified-once stamp spares a second start the hashing; a file changed since (other
    size or time) is hashed again and refused."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    Manifest.load(bundle)
    assert list((tmp_path / "cache" / "mtp-edge" / "verified").glob("*.json"))
    with open(bundle / "target.pte", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert "target.pte does not match its sha256" in error_line(run_bundle(bundle))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_manifests_give_one_line_errors(exported, tmp_path_factory, data):
    """Hypothesis edits the exported manifest: keys dropped, values of other types, odd file
    names. Loading either works or raises a one-line UserError; nothing else."""
    manifest = json.loads((exported / "manifest.json").read_text())
    values = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**20), st.floats(),
                       st.text(max_size=12), st.lists(st.integers(-2, 3), max_size=3),
                       st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
                       st.sampled_from(["../x", "/etc/x", "a/b", "", "target.pte"]))  # fmt: skip
    for _ in range(data.draw(st.integers(1, 4))):
        section = data.draw(st.sampled_from(["top", "drafter", "target"]))
        models = manifest.get("models")
        target = models.get("target") if isinstance(models, dict) else None
        where = {"top": manifest, "drafter": manifest.get("drafter"), "target": target}[section]
        if not isinstance(where, dict) or not where:
            continue
        key = data.draw(st.sampled_from(sorted(where)))
        if data.draw(st.booleans()):
            where.pop(key)
        else:
            where[key] = data.draw(values)
    directory = tmp_path_factory.mktemp("fuzz")
    for file in exported.iterdir():
        (directory / file.name).symlink_to(file) if file.name != "manifest.json" else None
    (directory / "manifest.json").write_text(json.dumps(manifest))
    try:
        Manifest.load(directory, verify=False)
    except UserError as e:
        assert "\n" not in str(e) and str(e)


# --- output paths: checked before the work, written whole ---------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_bench_refuses_an_unwritable_output_before_it_runs(bundle, flag, tmp_path):
    before = {p.name for p in tmp_path.iterdir()}
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), flag, "/proc/mtp/out.json"])
    assert "cannot write in /proc/mtp" in error_line(result)
    assert "[1/" not in result.stderr  # no prompt was measured
    assert leftovers(tmp_path, before) == set()


def test_bench_refuses_a_directory_as_its_json(bundle, tmp_path):
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), "--json", str(tmp_path)])
    assert "is a directory" in error_line(result)


def test_bench_refuses_a_file_as_its_report_directory(bundle, tmp_path):
    file = tmp_path / "report.txt"
    file.write_text("mine")
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), "--report", str(file)])
    assert "is a file" in error_line(result) and file.read_text() == "mine"


def test_export_refuses_an_unwritable_out_before_loading(tmp_path):
    result = CliRunner().invoke(export, ["--model", str(tmp_path / "nothing"), "--out", "/proc/x"])
    line = error_line(result)
    assert "--out /proc/x: cannot write" in line and "[load]" not in result.stderr


def test_predict_and_train_refuse_unwritable_outputs(bundle):
    result = CliRunner().invoke(predict, ["--bundle", str(bundle), "--json", "/proc/x/p.json"])
    assert "cannot write in /proc/x" in error_line(result)
    result = CliRunner().invoke(train, ["--out", "/proc/x/heads.safetensors"])
    assert "cannot write in /proc/x" in error_line(result)


def test_compare_spec_typos_are_one_line(bundle):
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), "--compare", f"{bundle},kk=3"])
    assert "expected DIR[,k=N]" in error_line(result)


# --- signals: SIGTERM and SIGHUP unwind like Ctrl-C ----------------------------------------------


def test_sigterm_during_export_leaves_nothing_behind(model_dir, tmp_path):
    out = tmp_path / "b"
    command = [sys.executable, "-c", "from mtp_edge.cli import export; export()",
               "--model", str(model_dir), "--out", str(out), "--quant", "fp32",
               "--max-seq-len", str(MAX_SEQ_LEN), "--quality-tokens", "0"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in process.stderr:  # wait until the export writes into its temporary directory
        lines.append(line)
        if line.startswith("[export]"):
            break
    process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    assert rest.strip().splitlines()[-1] == "error: stopped by SIGTERM", rest
    assert "Traceback" not in rest
    assert list(tmp_path.iterdir()) == []  # neither the bundle nor a temporary directory


def test_a_dead_exports_temporary_directory_is_removed(model_dir, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".b.{dead.pid}.abc123.partial"
    stale.mkdir()
    (stale / "target.pte").write_bytes(b"half")
    alive = tmp_path / f".b.{os.getpid()}.def456.partial"  # a live writer's: kept
    alive.mkdir()
    args = ["--model", str(model_dir), "--out", str(tmp_path / "b"), "--quant", "fp32",
            "--drafter", "none", "--max-seq-len", "64", "--quality-tokens", "0"]  # fmt: skip
    assert CliRunner().invoke(export, args).exit_code == 0
    assert not stale.exists() and alive.exists()


# --- options: refused in one line, with what works --------------------------------------------


def test_a_fault_of_ours_exits_1_in_one_line():
    @click.command(cls=OneLineErrors)
    def broken():
        raise Fault("speculative output diverged from plain output beyond a near-tie: a bug")

    result = CliRunner().invoke(broken, [])
    assert "diverged" in error_line(result, code=1)


def test_a_user_error_exits_2_and_a_usage_error_too(bundle):
    assert "no such option" in error_line(run_bundle(bundle, "--no-such-flag")).lower()


def test_interrupt_is_one_line_130():
    @click.command(cls=OneLineErrors)
    def slow():
        raise KeyboardInterrupt

    assert error_line(CliRunner().invoke(slow, []), code=130) == "error: interrupted"


def test_sighup_is_handled_like_sigterm(tmp_path):
    script = ("import time, click\nfrom mtp_edge.cli import OneLineErrors\n"
              "@click.command(cls=OneLineErrors)\ndef wait():\n"
              "    print('ready', flush=True)\n    time.sleep(60)\nwait()\n")  # fmt: skip
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    process.send_signal(signal.SIGHUP)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGHUP
    assert err.strip().splitlines()[-1] == "error: stopped by SIGHUP"


@pytest.mark.parametrize("k", ["0", "100"])
def test_k_outside_what_a_bundle_verifies_is_refused(bundle, k):
    assert "--k" in error_line(run_bundle(bundle, "--k", k))


def test_an_empty_stop_string_is_refused(bundle):
    line = error_line(run_bundle(bundle, "--stop", ""))
    assert "--stop" in line and "non-empty" in line


def test_a_prompt_longer_than_a_bundles_context_says_how_to_get_a_longer_one(bundle):
    args = ["--bundle", str(bundle), "--prompt", "the cat sat " * 40, "--no-chat-template"]
    line = error_line(CliRunner().invoke(run, args))
    assert f"the context holds {MAX_SEQ_LEN}" in line and "mtp-export --max-seq-len N" in line


def test_heads_with_nan_weights_are_refused(model_dir, tmp_path):
    """A heads file with a NaN tensor is refused when it is loaded, naming the tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tiny import save_random_heads

    heads = tmp_path / "heads.safetensors"
    save_random_heads(model_dir, heads, "none")
    with safe_open(str(heads), framework="pt") as f:
        metadata, state = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    name = sorted(n for n in state if state[n].is_floating_point())[0]
    state[name][0] = float("nan")
    save_file(state, str(heads), metadata=metadata)
    args = ["--model", str(model_dir), "--drafter", "mtp", "--heads", str(heads),
            "--prompt", "the cat", "--max-new-tokens", "4"]  # fmt: skip
    line = error_line(CliRunner().invoke(run, args))
    assert f"tensor '{name}' holds NaN/inf values" in line and "mtp-train" in line
