"""What every command shares: --version, -q and -v, --json PATH (- for stdout), choices and short
flags, exit codes, the stderr noise filter, progress bars, missing extras named in one line, and
mtp-run's streaming that never shows the text a stop string cuts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mtp_edge.cli import bench, devices, export, run, train
from mtp_edge.logs import estimated_stage, is_noise, progress_bar, set_verbosity

PROMPT = "the cat the cat the cat"


def commands() -> dict[str, str]:
    """Every console script of ours that click runs: name -> 'module:attribute'."""
    scripts = importlib.metadata.distribution("mtp-edge").entry_points
    return {e.name: e.value for e in scripts if e.group == "console_scripts"}


def load(value: str):
    module, _, name = value.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:  # a command whose optional extra is missing here
        pytest.skip(f"{value}: {e}")


CLICK_COMMANDS = sorted(n for n, v in commands().items() if v.startswith("mtp_edge.cli"))


@pytest.fixture(scope="module")
def bundle(ngram_bundle_8da8w):
    """A tiny android bundle exported with -q: conftest.py's, shared."""
    return ngram_bundle_8da8w


def test_a_quiet_export_prints_nothing(bundle):
    """-q: no progress at all (conftest.py keeps what the export printed)."""
    assert ours((bundle.parent / "export.stderr").read_text()) == []


@pytest.fixture()
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "category": "c", "prompt": PROMPT, "max_new_tokens": 6} for i in (1, 2)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def ours(stderr: str) -> list[str]:
    """The lines of a command run in this process that are not library noise (the filter of
    the noise works on a real process's stderr: tested below in subprocesses)."""
    return [line for line in stderr.splitlines() if not is_noise(line)]


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1
    assert "Traceback" not in result.output
    return lines[-1]


def subprocess_command(name: str, *args: str, env=None, prelude: str = ""):
    """Run console script `name` the way its entry point does, in a fresh interpreter."""
    module, _, attribute = commands()[name].partition(":")
    code = f"{prelude}\nfrom {module} import {attribute}; {attribute}()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


# --- --version, -q, -v on every command -------------------------------------------------------


@pytest.mark.parametrize("name", CLICK_COMMANDS)
def test_every_command_has_version_quiet_and_verbose(name):
    command = load(commands()[name])
    version = CliRunner().invoke(command, ["--version"])
    assert version.exit_code == 0, version.output
    assert version.stdout == f"mtp-edge {importlib.metadata.version('mtp-edge')}\n"
    usage = CliRunner().invoke(command, ["--help"]).stdout
    for flag in ("--version", "-v, --verbose", "-q, --quiet"):
        assert flag in usage, (name, flag)


def test_version_from_the_console_script():
    proc = subprocess_command("mtp-bench", "--version")
    assert proc.returncode == 0 and proc.stdout == "mtp-edge 0.1.0\n" and proc.stderr == ""


def test_quiet_prints_only_the_result(tiny_dir):
    args = ["-m", str(tiny_dir), "-p", PROMPT, "--no-chat-template", "-n", "8"]
    loud = CliRunner().invoke(run, args)
    assert loud.exit_code == 0 and "tok/s" in loud.stderr
    quiet = CliRunner().invoke(run, [*args, "-q"])
    assert quiet.exit_code == 0 and ours(quiet.stderr) == []
    assert quiet.stdout == loud.stdout and quiet.stdout.strip()


# --- exit codes ---------------------------------------------------------------------------------


def test_usage_and_user_errors_exit_2(tiny_dir, tmp_path):
    usage = CliRunner().invoke(run, ["-m", str(tiny_dir), "-p", "x", "--k", "99"])
    assert usage.exit_code == 2 and "--k" in one_error_line(usage)
    missing = CliRunner().invoke(run, ["-m", str(tmp_path / "nowhere"), "-p", "x"])
    assert missing.exit_code == 2 and "nowhere" in one_error_line(missing)


def test_a_fault_of_ours_exits_1(bundle, prompts, monkeypatch):
    """Speculative output that differs from plain output beyond a near-tie is our bug: exit 1."""
    from mtp_edge.devices import harness

    def diverged(plain, spec):
        return {"identical": False, "first_divergence": 0, "top2_gap": 9.0, "near_tie": False}

    monkeypatch.setattr(harness, "compare_runs", diverged)
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), "--prompts", str(prompts)])
    assert result.exit_code == 1
    assert "diverged" in one_error_line(result)


# --- --json PATH | - ----------------------------------------------------------------------------


def test_run_json_to_a_path_streams_the_text_too(tiny_dir, tmp_path):
    out = tmp_path / "run.json"
    args = ["-m", str(tiny_dir), "-p", PROMPT, "--no-chat-template", "-n", "8", "-s", "1"]
    to_path = CliRunner().invoke(run, [*args, "--json", str(out)])
    assert to_path.exit_code == 0, to_path.output
    body = json.loads(out.read_text())
    assert to_path.stdout == body["text"] + "\n"
    to_stdout = CliRunner().invoke(run, [*args, "--json", "-"])
    assert json.loads(to_stdout.stdout) == {**body, "stats": json.loads(to_stdout.stdout)["stats"]}


def test_devices_json_to_a_path_and_to_stdout(tmp_path):
    out = tmp_path / "devices.json"
    to_path = CliRunner().invoke(devices, ["--json", str(out)])
    assert to_path.exit_code == 0, to_path.output
    rows = json.loads(out.read_text())
    assert rows[0]["name"] == "host" and "|" in to_path.stdout  # the table still prints
    refused = CliRunner().invoke(devices, ["--json", str(tmp_path)])
    assert "is a directory" in one_error_line(refused)


def test_bench_json_to_stdout_is_json_alone(bundle, prompts):
    result = CliRunner().invoke(
        bench,
        ["--bundle", str(bundle), "--prompts", str(prompts)]
        + [
            "--json",
            "-",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"]["prompts"] == 2


# --- choices and short flags --------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, args, fragment",
    [
        (export, ["--target", "fpga"], "'fpga' is not one of 'android', 'onnx', 'coreml'"),
        (export, ["--quant", "9bit"], "'9bit' is not one of"),
        (export, ["--embedding-quant", "2w"], "'2w' is not one of '8w', '4w', 'none'"),
        (export, ["--attention-kernel", "flash"], "'flash' is not one of 'mtp', 'executorch'"),
        (train, ["--labels", "fuzzy", "-o", "h.safetensors"], "'fuzzy' is not one of"),
        (train, ["--writer", "gpu", "-o", "h.safetensors"], "'gpu' is not one of"),
        (train, ["--attention", "all", "-o", "h.safetensors"], "'all' is not one of"),
    ],
)
def test_choices_are_checked_and_listed(command, args, fragment):
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and fragment in one_error_line(result)


def test_choices_match_the_schemes():
    from mtp_edge.cli.export import EMBEDDING_SCHEMES, HEAD_SCHEMES
    from mtp_edge.platforms import PLATFORMS
    from mtp_edge.quantize import schemes

    every = {s for row in PLATFORMS.values() for s in row.schemes}
    choices = {p.name: p.type.choices for p in export.params if p.name == "quant"}
    # every platform's schemes, and "auto": each of the platform's timed here, the fastest kept
    assert set(choices["quant"]) == every | {"auto"}
    assert EMBEDDING_SCHEMES == schemes.EMBEDDING_SCHEMES
    assert HEAD_SCHEMES == schemes.HEAD_SCHEMES


@pytest.mark.parametrize(
    "target, quant, valid",
    [
        ("android", "int4", "8da4w, 8da4w-mix, 8da8w, 8da8w-avx2, 8da4w-mix-avx2, fp32"),
        ("onnx", "8da8w", None),
    ],
)
def test_a_scheme_of_another_target_names_the_valid_ones(tiny_dir, tmp_path, target, quant, valid):
    from mtp_edge.platforms import PLATFORMS

    args = ["--target", target, "-m", str(tiny_dir), "-o", str(tmp_path / "b"), "--quant", quant]
    line = one_error_line(CliRunner().invoke(export, args))
    assert f"--quant {quant} is not available for --target {target}" in line
    assert (valid or ", ".join(PLATFORMS[target].schemes)) in line
    assert not (tmp_path / "b").exists()


def test_short_flags_mean_the_long_ones(tiny_dir):
    long = ["--model", str(tiny_dir), "--prompt", PROMPT, "--max-new-tokens", "8"]
    long += ["--seed", "2", "--threads", "1", "--max-seq-len", "64", "--temperature", "0.9"]
    short = ["-m", str(tiny_dir), "-p", PROMPT, "-n", "8", "-s", "2", "-t", "1", "-c", "64"]
    short += ["--temp", "0.9"]
    outs = [
        json.loads(CliRunner().invoke(run, [*a, "--no-chat-template", "--json", "-"]).stdout)
        for a in (long, short)
    ]
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    for command in (export, train):
        usage = CliRunner().invoke(command, ["--help"]).stdout
        assert "-m, --model" in usage and "-o, --out" in usage


# --- mtp-run: the prompt from stdin or a file, a system prompt, streaming and stop strings -------


def test_prompt_from_stdin_and_from_a_file(tiny_dir, tmp_path):
    args = ["-m", str(tiny_dir), "--no-chat-template", "-n", "6", "--json", "-"]
    given = json.loads(CliRunner().invoke(run, [*args, "-p", PROMPT]).stdout)
    piped = CliRunner().invoke(run, [*args, "-p", "-"], input=PROMPT)
    assert json.loads(piped.stdout)["token_ids"] == given["token_ids"]
    file = tmp_path / "prompt.txt"
    file.write_text(PROMPT)
    read = CliRunner().invoke(run, [*args, "-f", str(file)])
    assert json.loads(read.stdout)["token_ids"] == given["token_ids"]
    both = CliRunner().invoke(run, [*args, "-p", PROMPT, "-f", str(file)])
    assert "one of them" in one_error_line(both)


def test_system_prompt_goes_through_the_chat_template(tiny_dir, tmp_path):
    chat_dir = tmp_path / "chat"
    shutil.copytree(tiny_dir, chat_dir)
    (chat_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    )
    args = ["-n", "6", "--json", "-"]
    rendered = "system: be kind\nuser: hi\nassistant: "
    system = CliRunner().invoke(
        run, ["-m", str(chat_dir), "--system", "be kind", "-p", "hi", *args]
    )
    raw = CliRunner().invoke(
        run, ["-m", str(tiny_dir), "--no-chat-template", "-p", rendered, *args]
    )
    assert json.loads(system.stdout)["token_ids"] == json.loads(raw.stdout)["token_ids"]
    refused = CliRunner().invoke(run, ["-m", str(tiny_dir), "-p", "hi", "--system", "be kind"])
    assert "chat template" in one_error_line(refused)


def test_run_never_streams_the_stop_string(tiny_dir):
    args = ["-m", str(tiny_dir), "-p", PROMPT, "--no-chat-template", "-n", "24"]
    free = json.loads(CliRunner().invoke(run, [*args, "--json", "-"]).stdout)["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert len(stop) == 3, free
    streamed = CliRunner().invoke(run, [*args, "--stop", stop, "-q"])
    assert streamed.exit_code == 0, streamed.output
    cut = free[: free.index(stop)]
    assert streamed.stdout == cut + "\n" and stop not in streamed.stdout


# --- missing extras: one line naming the extra, before the work ---------------------------------


def test_missing_onnx_extra_is_named_before_any_work(tiny_dir, tmp_path):
    out = tmp_path / "b"
    args = ["--target", "onnx", "-m", str(tiny_dir), "-o", str(out)]
    proc = subprocess_command(
        "mtp-export", *args, prelude="import sys; sys.modules['onnxscript'] = None"
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: mtp-export --target onnx needs the onnx extra: pip install 'mtp-edge[onnx]'\n"
    )
    assert not out.exists()


def test_missing_report_extra_is_named(bundle, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), "--report", str(tmp_path / "r")])
    assert result.exit_code == 2
    line = one_error_line(result)
    assert (
        line == "error: mtp-bench --report needs the report extra: pip install 'mtp-edge[report]'"
    )
    assert "[1/" not in result.stderr  # nothing was measured


def test_missing_onnxruntime_for_an_onnx_bundle_is_named(monkeypatch):
    from mtp_edge.errors import UserError
    from mtp_edge.runtime.backends import backend

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(UserError, match=r"needs the onnx extra: pip install 'mtp-edge\[onnx\]'"):
        backend("onnxruntime")


# --- the noise filter (real processes) ----------------------------------------------------------


def test_noise_filter_drops_known_lines_and_passes_the_rest():
    """Noise, our lines, an unknown line and a redrawn line without its end, written to fd 2
    directly as C++ does; then a crash: what was written before it still arrives."""
    code = """
import os, time
from mtp_edge.logs import filter_stderr_noise
filter_stderr_noise()
os.write(2, b"[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\\n")
os.write(2, b"our progress line\\n")
os.write(2, b"[stats.h:175] \\tPrompt Tokens: 11\\n[program.cpp:40] unknown library message\\n")
os.write(2, b"\\rbar 50%")
time.sleep(0.3)
os.write(2, b"\\rbar 100%\\n")
os.write(2, b"error: last words\\n")
os.abort()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "cpuinfo_utils" not in err and "Prompt Tokens" not in err
    assert "our progress line\n" in err and "[program.cpp:40] unknown library message\n" in err
    assert "\rbar 50%\rbar 100%\n" in err and err.endswith("error: last words\n")


def test_executorch_noise_is_filtered_unless_verbose(bundle):
    args = ["--bundle", str(bundle), "-p", PROMPT, "--no-chat-template", "-n", "4"]
    quiet = subprocess_command("mtp-run", *args)
    assert quiet.returncode == 0, quiet.stderr
    assert "cpuinfo_utils" not in quiet.stderr and "torchao" not in quiet.stderr
    assert "tok/s" in quiet.stderr  # our own line still there
    verbose = subprocess_command("mtp-run", *args, "-v")
    assert verbose.returncode == 0
    assert "[cpuinfo_utils.cpp:" in verbose.stderr  # what the filter removed is real output
    assert verbose.stdout == quiet.stdout


def test_known_noise_patterns():
    assert is_noise("[cpuinfo_utils.cpp:125] CPU info and manual query on # of cpus dont match.")
    assert is_noise(
        "Failed to load /x/site-packages/torchao/_C_mxfp8.so: Could not load this library"
    )
    # TextLLMRunner's end-of-generation note comes as two lines; its errors are kept
    assert is_noise("[text_token_generator.h:181] ")
    assert is_noise("Reached to the end of generation")
    assert not is_noise("[text_token_generator.h:181] Failed to sample")
    assert not is_noise("[method.cpp:123] Missing operator: llama::custom_sdpa.out")
    assert not is_noise("error: the bundle is damaged")


# --- progress bars ------------------------------------------------------------------------------


def test_bench_progress_is_plain_lines_off_a_terminal_and_silent_with_q(bundle, prompts):
    args = ["--bundle", str(bundle), "--prompts", str(prompts)]
    shown = CliRunner().invoke(bench, args)
    assert shown.exit_code == 0, shown.output
    bars = [line for line in shown.stderr.splitlines() if line.startswith("prompts:")]
    assert bars and bars[-1].startswith("prompts: 100%") and "2/2" in bars[-1]
    assert "\r" not in shown.stderr  # not a terminal: no redraws
    silent = CliRunner().invoke(bench, [*args, "-q"])
    assert silent.exit_code == 0 and ours(silent.stderr) == []


def test_export_stages_show_bars(ngram_bundle_8da4w):
    """What conftest.py's export with 64 held-out tokens printed (not -q)."""
    stderr = (ngram_bundle_8da4w.parent / "export.stderr").read_text()
    # loading carries the fp32 perplexity and the quantization, a layer at a time
    for stage in ("loading target: 100%", "verify vs steps: 100%"):
        assert stage in stderr, stderr
    # an estimated stage ends full, or, past its estimate, with the time it took
    ends = ("lowering (XNNPACK): 100%", "lowering (XNNPACK): done in")
    assert any(end in stderr for end in ends), stderr


def test_estimated_stage_reaches_its_end_early_or_late(capsys):
    set_verbosity(quiet=False)
    with estimated_stage("short", 30):
        pass
    with progress_bar(3, "counted") as bar:
        bar.update(3)
    err = capsys.readouterr().err
    assert "short: 100%" in err and "(estimated)" in err and "counted: 100%" in err


def test_mtp_runner_help_needs_no_build(tmp_path):
    """--help is answered from the source, with no CMake anywhere on the PATH."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run(
        [sys.executable, "-c", "from mtp_edge.runtime.native_runner import main; main()", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0 and "--no-chat-template" in proc.stdout, proc.stderr
    assert "--json OUT|-" in proc.stdout


def test_bars_redraw_on_a_terminal_behind_the_noise_filter():
    """On a terminal a bar redraws in place ("\\r"), also when fd 2 goes through the filter."""
    import pty

    code = """
import time
from mtp_edge.logs import filter_stderr_noise, progress_bar
filter_stderr_noise()
with progress_bar(4, "work") as bar:
    for _ in range(4):
        time.sleep(0.2)
        bar.update(1)
"""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=follower, stdout=follower)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the process and the filter are done
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = seen.decode(errors="replace")
    assert text.count("\r") >= 3 and "work: 100%" in text and "4/4" in text


def test_core_ml_conversion_shows_errors_and_hides_its_bars():
    """Core ML's pass bars (with and without a total) are dropped; its warnings and errors,
    even one written right after a bar on the same line, come through."""
    import io

    from mtp_edge.exporter.coreml import _WithoutProgressBars

    out = io.StringIO()
    stream = _WithoutProgressBars(out)
    stream.write("\rRunning MIL default pipeline:   0%|          | 0/89 [00:00<?, ? passes/s]")
    stream.write(
        "\rRunning MIL default pipeline: 100%|##########| 89/89 [00:01<00:00, 60 passes/s]\n"
    )
    stream.write(
        "Running MIL frontend pipeline: 0 passes [00:00, ? passes/s]x.py:3: RuntimeWarning\n"
    )
    stream.write("ValueError: op 'gather' is not supported\nlast words")
    stream.close()
    assert out.getvalue() == (
        "x.py:3: RuntimeWarning\nValueError: op 'gather' is not supported\nlast words\n"
    )


# Every command flag backed by one of mtp_edge/limits.py's ranges, by the setting it sets.
RANGED_FLAGS = {
    "k": "--k",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "threads": "--threads",
    "max_seq_len": "--max-seq-len",
    "draft_confidence": "--draft-confidence",
}


def test_the_flags_use_the_shared_ranges():
    """run, chat and serve read each ranged flag with the one table the API and the server use."""
    import click

    from mtp_edge.cli.chat import chat
    from mtp_edge.cli.common import InRange
    from mtp_edge.cli.serve import serve
    from mtp_edge.limits import LIMITS

    assert set(RANGED_FLAGS) == set(LIMITS)
    for command in (run, chat, serve):
        options = {o: p for p in command.params for o in p.opts}
        for setting, flag in RANGED_FLAGS.items():
            assert isinstance(options[flag].type, InRange), (command.name, flag)
            assert options[flag].type.limit is LIMITS[setting]
            assert not isinstance(options[flag].type, click.IntRange | click.FloatRange)


def test_a_flag_and_the_api_accept_the_same_values():
    """Property: for any text a user may type, the flag accepts it exactly when the API accepts
    the number it spells (NaN, inf, out of range and wrong kinds refused by both)."""
    import click
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mtp_edge.cli.common import InRange
    from mtp_edge.limits import LIMITS

    numbers = st.one_of(
        st.integers(-(2**65), 2**65),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0, 1, 15, 16, 2**64 - 1, 2**64, -1, 0.5, 1.0, 1e400]),
    )

    @settings(max_examples=300, deadline=None)
    @given(setting=st.sampled_from(sorted(LIMITS)), number=numbers)
    def agree(setting, number):
        limit = LIMITS[setting]
        try:
            flag = InRange(setting).convert(str(number), None, None)
        except click.BadParameter:
            flag = None
        # the API takes the number itself; text that is not an int is refused for an int
        api = limit.convert(number)
        if limit.kind is int and isinstance(number, float):
            api = None  # "2.0" is not an integer to type
        assert (flag is None) == (api is None), (setting, number, flag, api)
        if flag is not None:
            assert flag == api

    agree()
