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
from tiny import cache_home_sharing_kernels

from mtp_edge.cli import OneLineErrors, bench, export, predict, run, train
from mtp_edge.errors import Fault, UserError
from mtp_edge.manifest import Manifest

MAX_SEQ_LEN = 96  # the shared bundle's (conftest.py's ngram_bundle_8da8w)


@pytest.fixture(scope="module")
def model_dir(tiny_dir_seed5):
    return tiny_dir_seed5  # conftest.py's, shared


@pytest.fixture(scope="module")
def exported(ngram_bundle_8da8w):
    """A tiny android bundle of model_dir with the n-gram drafter and MAX_SEQ_LEN positions:
    conftest.py's, shared (read-only: the tests break copies)."""
    manifest = json.loads((ngram_bundle_8da8w / "manifest.json").read_text())
    assert manifest["max_seq_len"] == MAX_SEQ_LEN
    return ngram_bundle_8da8w


@pytest.fixture
def bundle(exported, copy_bundle):
    """A copy of the bundle to break."""
    return copy_bundle(exported, "bundle")


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


# --- the manifest's numbers against the programs and the tokenizer; ids against the vocabulary ---


@pytest.mark.parametrize(
    "key, value, source",
    [
        ("max_seq_len", MAX_SEQ_LEN + 1, "target.pte"),  # reads past the cache
        ("max_chunk", MAX_SEQ_LEN - 1, "target.pte"),
        ("vocab_size", 98, "tokenizer_meta.json"),  # lets id 97 through to the embedding kernel
        ("eos_ids", [99999], "tokenizer_meta.json"),
        ("bos_id", 1, "tokenizer_meta.json"),
        ("chat_template", "{{ messages }}", "tokenizer_meta.json"),
    ],
)
def test_an_edited_manifest_number_is_refused(bundle, key, value, source):
    edit_manifest(bundle, lambda m: m.update({key: value}))
    line = error_line(run_bundle(bundle))
    assert f"manifest.json says {key} is" in line and f"but {source} was exported with" in line


def test_a_drafter_kind_without_its_files_is_refused(bundle):
    edit_manifest(bundle, lambda m: m["drafter"].update(kind="mtp"))
    assert "names no models.drafter_vocab file" in error_line(run_bundle(bundle))


def test_token_ids_outside_the_vocabulary_never_reach_a_kernel(exported):
    """Ids from the API, the server or a session's caller: one-line errors (a 400), never the
    embedding kernel's abort; the server answers the next request."""
    from starlette.testclient import TestClient

    import mtp_edge
    from mtp_edge.server import create_app

    llm = mtp_edge.load(bundle=exported)
    session = llm.generator.session
    for bad in ([97], [-1], [3, 10**12]):
        with pytest.raises(UserError, match="outside the vocabulary|ints in 0..96"):
            llm.generate(bad, max_new_tokens=2)
        with pytest.raises(UserError, match="outside the vocabulary: ids run 0..96"):
            session.forward(bad, 0)
    client = TestClient(create_app(llm))
    response = client.post("/v1/completions", json={"prompt": [97], "max_tokens": 2})
    assert response.status_code == 400, response.text
    response = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def onnx_bundle(model_dir, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    out = tmp_path_factory.mktemp("onnx") / "tiny"
    args = ["--target", "onnx", "--model", str(model_dir), "--out", str(out), "--quant", "fp32",
            "--drafter", "ngram", "--max-seq-len", str(MAX_SEQ_LEN),
            "--quality-tokens", "0"]  # fmt: skip
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize(
    "key, value, source",
    [("max_seq_len", MAX_SEQ_LEN + 1, "positions"), ("vocab_size", 98, "tokenizer_meta.json")],
)
def test_an_edited_onnx_manifest_is_refused(onnx_bundle, tmp_path, key, value, source):
    bundle = tmp_path / "bundle"
    shutil.copytree(onnx_bundle, bundle)
    edit_manifest(bundle, lambda m: m.update({key: value}))
    assert source in error_line(run_bundle(bundle))


def rewrite_vocab_size(bundle: Path, size: int) -> None:
    """A thorough tamper: the vocabulary size in the manifest and in tokenizer_meta.json, whose
    sha256 in the manifest is rewritten to match; only the program itself still says 97."""
    from mtp_edge.manifest import sha256

    meta = bundle / "tokenizer_meta.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), vocab_size=size)))

    def edit(m):
        m.update(vocab_size=size)
        m["models"]["tokenizer_meta"]["sha256"] = sha256(meta)

    edit_manifest(bundle, edit)


def test_a_vocabulary_edited_everywhere_but_the_program_is_refused(bundle, onnx_bundle, tmp_path):
    copy = tmp_path / "onnx"
    shutil.copytree(onnx_bundle, copy)
    for directory, program in ((bundle, "target.pte"), (copy, "target.onnx")):
        rewrite_vocab_size(directory, 98)
        line = error_line(run_bundle(directory))
        assert f"says vocab_size is 98 but {program} was exported with 97" in line, line


def test_onnx_sessions_refuse_ids_outside_the_vocabulary(onnx_bundle):
    import mtp_edge

    llm = mtp_edge.load(bundle=onnx_bundle)
    with pytest.raises(UserError, match="token id 97 is outside the vocabulary"):
        llm.generator.session.forward([5, 97], 0)


@pytest.fixture(scope="module")
def runner():
    """The native runner (runtime/native/build), for the same checks in C++."""
    if shutil.which("cmake") is None:
        pytest.skip("the native runtime needs cmake")
    from mtp_edge.runtime import native_runner

    return native_runner.build(jobs=1)


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda b: edit_manifest(b, lambda m: m.update(max_seq_len=MAX_SEQ_LEN + 1)),
         f"says max_seq_len is {MAX_SEQ_LEN + 1} but target.pte was exported with {MAX_SEQ_LEN}"),
        (lambda b: edit_manifest(b, lambda m: m.update(max_chunk=MAX_SEQ_LEN - 1)),
         f"says max_chunk is {MAX_SEQ_LEN - 1} but target.pte was exported with {MAX_SEQ_LEN}"),
        (lambda b: edit_manifest(b, lambda m: m.update(eos_ids=[99999])),
         "says eos_ids is [99999] but tokenizer_meta.json was exported with [2]"),
        (lambda b: edit_manifest(b, lambda m: m.update(vocab_size=98)),
         "says vocab_size is 98 but tokenizer_meta.json was exported with 97"),
        (lambda b: rewrite_vocab_size(b, 98),
         "says vocab_size is 98 but target.pte was exported with 97"),
    ],
)  # fmt: skip
def test_the_native_runner_refuses_an_edited_manifest(runner, bundle, edit, says):
    edit(bundle)
    result = subprocess.run([str(runner), "--bundle", str(bundle), "--prompt-ids", "5,6,7",
                             "--max-new-tokens", "2"], capture_output=True, text=True)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines[-1].startswith("error: bundle ") and says in lines[-1], result.stderr


def wrong_values(value):
    """Well-typed wrong values for a manifest field: off by one, out of range, emptied."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, 0, -1, 10**6]
    if isinstance(value, float):
        return [value + 0.5, -1.0, 1e9]
    if isinstance(value, str):
        return ["", value + "x", "mtp"]
    if isinstance(value, list):
        return [[], [v + 1 for v in value], [10**6]]
    if value is None:
        return [0, 1, 96, 97, "x"]
    return []


MANIFEST_FIELDS = ["platform", "backend", "model_name", "max_seq_len", "max_chunk", "vocab_size",
                   "bos_id", "eos_ids", "chat_template", "chat_format", "source",
                   "exporter_version", "drafter.kind", "drafter.k", "drafter.lookup",
                   "drafter.draft_confidence", "drafter.method", "drafter.own_cache",
                   "drafter.reads_target_cache", "drafter.draft_vocab_size",
                   "drafter.max_chunk"]  # fmt: skip


@pytest.mark.parametrize("key", MANIFEST_FIELDS)
def test_every_manifest_field_edited_runs_or_is_one_line(exported, tmp_path, key, monkeypatch):
    """Each field set to wrong values of its own type, the bundle opened and run through the
    API: it either generates or refuses with a one-line UserError, never anything else."""
    import mtp_edge

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home_sharing_kernels(tmp_path / "cache")))
    manifest = json.loads((exported / "manifest.json").read_text())
    section, _, name = key.rpartition(".")
    where = manifest["drafter"] if section else manifest
    for i, value in enumerate(wrong_values(where.get(name))):
        directory = tmp_path / str(i)
        directory.mkdir()
        for file in exported.iterdir():
            if file.name != "manifest.json":
                shutil.copy(file, directory / file.name)
        where[name] = value
        (directory / "manifest.json").write_text(json.dumps(manifest))
        try:
            mtp_edge.load(bundle=directory).generate([5, 6, 7], max_new_tokens=3)
        except UserError as e:
            assert str(e) and "\n" not in str(e), (key, value, str(e))


# --- progress that does not lie at the end --------------------------------------------------


def test_a_stage_past_its_estimate_says_so_and_the_estimate_learns(monkeypatch, tmp_path, capsys):
    """No bar held at 99% with ~00:00 left: past its estimate a stage shows its elapsed time,
    that the time left is unknown and what is still going on; its measured time scales the
    next estimate of the same stage on this machine."""
    import time

    from mtp_edge import logs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(logs, "PLAIN_LINE_EVERY_S", 0.2)
    logs.set_verbosity(quiet=False)
    logs.set_terminal(False)
    try:
        with logs.estimated_stage("lowering", 0.6, after="finishing: serializing"):
            time.sleep(2.5)
    finally:
        logs.set_terminal(None)
    lines = capsys.readouterr().err.splitlines()
    assert not any("99%" in line for line in lines), lines
    assert any("elapsed, past the ~00:01 estimate; finishing: serializing, time left unknown"
               in line for line in lines), lines  # fmt: skip
    assert lines[-1].startswith("lowering: done in 00:0"), lines
    assert 3 < logs.learned_factor("lowering") < 6  # ~2.5 s measured against 0.6 estimated


def test_a_line_said_during_a_childs_bar_gets_a_line_of_its_own(capsys):
    """The export's child draws its bar on our stderr without ending the line; a progress line
    said meanwhile (through the parent) must not be appended to the bar."""
    from mtp_edge import logs
    from mtp_edge.exporter import lowering_parent

    read, write = os.pipe()
    os.write(write, b"lowering to XNNPACK:  45%|####5     | 02:20 elapsed")
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        lowering_parent._forward(stream)
    logs.set_verbosity(quiet=False)
    lowering_parent._on_own_line(logs.say, "[lower] XNNPACK")
    err = capsys.readouterr().err
    assert "\n[lower] XNNPACK\n" in err or "\r\x1b[K[lower] XNNPACK\n" in err, repr(err)


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


def test_an_interrupted_bench_writes_what_it_measured(exported, tmp_path, monkeypatch):
    """Ctrl-C after two prompts: --json and --markdown hold those two, marked partial, and the
    exit code is still 130."""
    from mtp_edge.devices import harness

    real, calls = harness.Suite.run_prompt, []

    def run_prompt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(harness.Suite, "run_prompt", run_prompt)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"the cat {i}"}) + "\n"
                               for i in range(5)))  # fmt: skip
    out, markdown = tmp_path / "bench.json", tmp_path / "bench.md"
    args = ["--bundle", str(exported), "--prompts", str(prompts), "--max-new-tokens", "4",
            "--json", str(out), "--markdown", str(markdown)]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert error_line(result, 130) == "error: interrupted"
    report = json.loads(out.read_text())
    assert report["partial"] == {"prompts_done": 2, "prompts": 5, "stopped_by": "SIGINT"}
    assert report["summary"]["prompts"] == 2
    assert markdown.read_text().startswith("**Partial**: stopped by SIGINT after 2 of 5 prompts")


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stopped_bench_compare_writes_what_it_measured(exported, tmp_path, stop):
    """Side by side (--compare: a worker process per setup), stopped as a terminal does it
    (SIGINT to the whole process group) or by SIGTERM to mtp-bench alone: both setups' reports
    of the prompts done, marked partial, and the signal's exit code."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"the cat {i}"}) + "\n"
                               for i in range(60)))  # fmt: skip
    out = tmp_path / "bench.json"
    command = [sys.executable, "-c", "from mtp_edge.cli import bench; bench()",
               "--bundle", str(exported), "--compare", f"{exported},k=2", "--prompts",
               str(prompts), "--max-new-tokens", "8", "--json", str(out)]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    seen = []
    for line in process.stderr:
        seen.append(line)
        if line.startswith("[3/60]"):
            break
    if stop == "ctrl-c":
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    code = 130 if stop == "ctrl-c" else 143
    assert process.wait(timeout=300) == code, "".join(seen) + rest
    assert "Traceback" not in rest, rest
    runs = json.loads(out.read_text())["runs"]
    assert [r["k"] for r in runs] == [4, 2]
    for report in runs:
        done = report["partial"]["prompts_done"]
        assert 2 <= done < 60 and report["summary"]["prompts"] == done  # 2: not yet sent
        assert report["partial"]["stopped_by"] == ("SIGINT" if stop == "ctrl-c" else "SIGTERM")


def test_export_refuses_an_unwritable_out_before_loading(tmp_path):
    result = CliRunner().invoke(export, ["--model", str(tmp_path / "nothing"), "--out", "/proc/x"])
    line = error_line(result)
    assert "--out /proc/x: cannot write" in line and "[load]" not in result.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 200 kB filesystem (tmpfs; root only): less than the tiny bundle's 0.3 MB program."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_export_refuses_a_disk_without_room_before_loading(model_dir, tmp_path, monkeypatch):
    """The forecast: the free space reading injected (the same check as on a real small disk,
    test below), refused before any weight is read."""
    from mtp_edge import memory

    monkeypatch.setattr(memory, "free_disk_bytes", lambda path: 120_000)
    out = tmp_path / "out" / "tiny"
    args = ["--model", str(model_dir), "--out", str(out), "--quant", "fp32", "--drafter", "ngram",
            "--max-seq-len", str(MAX_SEQ_LEN), "--quality-tokens", "0"]  # fmt: skip
    line = error_line(CliRunner().invoke(export, args))
    assert "has 120 kB free and the bundle needs about 291 kB" in line and "--out" in line
    assert not out.exists()


def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(model_dir, small_disk,
                                                                  monkeypatch):  # fmt: skip
    """The forecast fooled (it reads plenty free), the disk fills while the program is written:
    one line, exit 2, no partial bundle."""
    from mtp_edge import memory
    from mtp_edge.exporter import pipeline

    monkeypatch.setattr(memory, "free_disk_bytes", lambda path: 10**12)
    # The programs written by the export's child process, as for any model of a real size.
    monkeypatch.setattr(pipeline, "IN_PROCESS_BELOW_GB", 0)
    args = ["--model", str(model_dir), "--out", str(small_disk / "tiny"), "--quant", "fp32",
            "--drafter", "ngram", "--max-seq-len", str(MAX_SEQ_LEN),
            "--quality-tokens", "0"]  # fmt: skip
    line = error_line(CliRunner().invoke(export, args))
    assert line.startswith("error: no space left on the device while writing"), line
    assert list(small_disk.iterdir()) == []


def test_export_refuses_a_real_small_disk(model_dir, small_disk):
    args = ["--model", str(model_dir), "--out", str(small_disk / "tiny"), "--quant", "fp32",
            "--drafter", "ngram", "--max-seq-len", str(MAX_SEQ_LEN)]  # fmt: skip
    assert "kB free and the bundle needs about" in error_line(CliRunner().invoke(export, args))
    assert list(small_disk.iterdir()) == []


def test_predict_and_train_refuse_unwritable_outputs(bundle):
    result = CliRunner().invoke(predict, ["--bundle", str(bundle), "--json", "/proc/x/p.json"])
    assert "cannot write in /proc/x" in error_line(result)
    result = CliRunner().invoke(train, ["--out", "/proc/x/heads.safetensors"])
    assert "cannot write in /proc/x" in error_line(result)


def test_train_refuses_an_unwritable_summary_before_the_run(tmp_path, monkeypatch):
    """The summary's path is checked with --out's, not after the run has trained for hours."""
    import mtp_edge.train

    def no_run(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(mtp_edge.train, "train_heads", no_run)
    args = ["--out", str(tmp_path / "heads.safetensors"), "--json", "/proc/x/summary.json"]
    assert "--json /proc/x/summary.json: cannot write in /proc/x" in error_line(
        CliRunner().invoke(train, args)
    )


def test_checking_an_output_path_leaves_no_folders(tmp_path):
    """Outputs are checked before the work; a command refused after that check (a bad input
    found later) must not leave the empty folders the check made."""
    from mtp_edge.files import check_output

    check_output(tmp_path / "new" / "deeper" / "heads.safetensors", "--out")
    check_output(tmp_path / "other" / "bundle", "--out", directory=True)
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "new" / "h.safetensors"
    result = CliRunner().invoke(train, ["--prompts", str(tmp_path / "none.txt"), "--out", str(out)])
    assert result.exit_code == 2 and list(tmp_path.iterdir()) == []


def test_a_bundle_given_as_its_manifest_file_is_named(bundle):
    result = CliRunner().invoke(run, ["--bundle", str(bundle / "manifest.json"), "-p", "hi"])
    assert f"is a file: give the bundle's directory ({bundle})" in error_line(result)


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
    # Any platform's export clears them (bundle_writer.check_writable): ONNX's is the quickest.
    args = ["--target", "onnx", "--model", str(model_dir), "--out", str(tmp_path / "b"),
            "--quant", "fp32", "--drafter", "none", "--max-seq-len", "64",
            "--quality-tokens", "0"]  # fmt: skip
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
