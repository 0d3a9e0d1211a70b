"""The command line: the JSON contract, and bad input as one line, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from tiny import hf_reference, save_hf_dir

from mtp_edge.cli import bench, run


def invoke(command, args):
    result = CliRunner().invoke(command, args)
    return result


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_run_json_contract(tiny_dir):
    args = ["--model", str(tiny_dir), "--prompt", "the cat", "--no-chat-template", "--json", "-"]
    result = invoke(run, [*args, "--max-new-tokens", "12", "--drafter", "ngram"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"text", "token_ids", "stop_reason", "stats"}
    assert out["stop_reason"] in {"eos", "max_tokens"}
    assert 0 < len(out["token_ids"]) <= 12
    for key in (
        "generated_tokens",
        "verify_steps",
        "tau",
        "acceptance_rate",
        "ttft_ms",
        "decode_tokens_per_s",
        "accepted_per_position",
    ):
        assert key in out["stats"]
    plain = json.loads(invoke(run, [*args, "--max-new-tokens", "12", "--drafter", "none"]).stdout)
    assert plain["token_ids"] == out["token_ids"]


def test_run_with_draft_model_and_sampling(tiny_dir, tmp_path):
    draft = save_hf_dir(hf_reference("llama", seed=4, num_hidden_layers=1), tmp_path / "draft")
    args = [
        "--model",
        str(tiny_dir),
        "--drafter",
        str(draft),
        "--prompt",
        "the",
        "--json",
        "-",
        "--no-chat-template",
        "--max-new-tokens",
        "10",
    ]
    greedy = invoke(run, args)
    assert greedy.exit_code == 0, greedy.output
    sampled = invoke(run, [*args, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"])
    assert sampled.exit_code == 0, sampled.output
    again = invoke(run, [*args, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"])
    assert json.loads(again.stdout)["token_ids"] == json.loads(sampled.stdout)["token_ids"]


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--temperature", "-1"], ["--temperature"]),
        (["--top-p", "0"], ["--top-p"]),
        (["--top-k", "-2"], ["--top-k"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--k", "-1"], ["--k"]),
        (["--ngram-sizes", "3-1"], ["n-gram"]),
        (["--temperature", "hot"], ["--temperature"]),
    ],
)
def test_invalid_values(tiny_dir, extra, fragments):
    result = invoke(run, ["--model", str(tiny_dir), "--prompt", "hi", *extra])
    assert_one_line_error(result, *fragments)


def test_missing_model_path(tmp_path):
    result = invoke(run, ["--model", str(tmp_path / "nowhere"), "--prompt", "hi"])
    assert_one_line_error(result, "nowhere")


def test_truncated_safetensors(tiny_dir, tmp_path):
    broken = save_hf_dir(hf_reference("llama", seed=3), tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_one_line_error(invoke(run, ["--model", str(broken), "--prompt", "hi"]), "safetensors")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert_one_line_error(invoke(run, ["--model", str(bad), "--prompt", "hi"]), "GGUF")


def test_unsupported_architecture(tmp_path):
    ref = hf_reference("llama", seed=3)
    directory = save_hf_dir(ref, tmp_path / "gpt2")
    config = json.loads((directory / "config.json").read_text())
    config["model_type"], config["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    result = invoke(run, ["--model", str(directory), "--prompt", "hi"])
    assert_one_line_error(result, "gpt2", "llama", "qwen2", "qwen3")


def test_drafter_vocabulary_mismatch(tiny_dir, tmp_path):
    other = save_hf_dir(hf_reference("llama", seed=5, vocab=101), tmp_path / "other", vocab=101)
    result = invoke(run, ["--model", str(tiny_dir), "--drafter", str(other), "--prompt", "hi"])
    assert_one_line_error(result, "vocabulary")


def test_prompt_longer_than_context(tiny_dir):
    args = ["--model", str(tiny_dir), "--prompt", "the cat " * 40, "--no-chat-template"]
    result = invoke(run, [*args, "--max-seq-len", "16"])
    assert_one_line_error(result, "context", "--max-seq-len")


def test_bench_bad_prompts_file(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\nnot json\n')
    result = invoke(bench, ["--model", str(tiny_dir), "--prompts", str(prompts)])
    assert_one_line_error(result, f"{prompts}:2: not a JSON line")


def test_bench_report(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"id": f"p{i}", "category": c, "prompt": f"the cat {c}", "max_new_tokens": 8}
        for i, c in enumerate(["code", "chat", "code"])
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "bench.json"
    args = [
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts),
        "--json",
        str(out),
        "--markdown",
        str(tmp_path / "bench.md"),
        "--no-chat-template",
    ]
    result = invoke(bench, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["summary"]) >= {
        "prompts",
        "lossless",
        "ar_tokens_per_s",
        "spec_tokens_per_s",
        "speedup",
        "tau",
        "acceptance_rate",
        "ttft_ms_ar",
        "ttft_ms_spec",
        "peak_rss_mb",
    }
    assert report["summary"]["prompts"] == 3 and report["summary"]["lossless"] is True
    assert set(report["per_category"]) == {"code", "chat"}
    assert all(p["identical"] for p in report["prompts"])


def test_console_script_has_no_traceback(tmp_path):
    """The real entry point, in a subprocess: one line on stderr, exit status 2."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mtp_edge.cli import run; run()",
            "--model",
            str(tmp_path / "missing"),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")


@pytest.mark.parametrize(
    "args, stdin, fragment",
    [
        (["--temperature", "nan", "-p", "hi"], None, "--temperature"),
        (["--temp", "1e400", "-p", "hi"], None, "got inf"),
        (["--seed", "-1", "-p", "hi"], None, "--seed"),
        (["--k", "16", "-p", "hi"], None, "1..15"),
        (["--draft-confidence", "1", "-p", "hi"], None, "--draft-confidence"),
        (["-c", "1", "-p", "hi"], None, "--max-seq-len"),
        (["-t", "-1", "-p", "hi"], None, "--threads"),
        (["-p", "-"], b"\xff\xfehi", "not valid UTF-8"),
        (["-p", "", "--no-chat-template"], None, "the prompt is empty"),
        (["-p", "  "], None, "the prompt is empty"),
        (["-p", "hi", "--system", "s", "--no-chat-template"], None, "--system"),
    ],
)
def test_run_checks_every_argument_before_loading(args, stdin, fragment, monkeypatch):
    """mtp-run refuses each of these in one line, exit 2, without loading (or importing torch's
    backends for) the model: assembling it fails the test."""
    import mtp_edge.runtime.assemble as assembly

    monkeypatch.setattr(assembly, "assemble", lambda *a, **k: pytest.fail("loaded the model"))
    result = CliRunner().invoke(run, ["--bundle", "b", *args], input=stdin)
    assert result.exit_code == 2, result.output
    assert_one_line_error(result, fragment)


@pytest.mark.parametrize("command", ["chat", "serve"])
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--seed", "-1"], "--seed"),
        (["--top-p", "0"], "--top-p"),
        (["--k", "0"], "1..15"),
        (["--stop", ""], "--stop"),
    ],
)
def test_chat_and_serve_check_arguments_before_loading(command, args, fragment, monkeypatch):
    import importlib

    import mtp_edge.api as api
    import mtp_edge.runtime.assemble as assembly

    for module in (assembly, api):
        monkeypatch.setattr(module, "assemble", lambda *a, **k: pytest.fail("loaded the model"))
    cli = getattr(importlib.import_module(f"mtp_edge.cli.{command}"), command)
    port = ["--port", "0"] if command == "serve" else []
    result = CliRunner().invoke(cli, ["--bundle", "b", *port, *args])
    assert result.exit_code == 2, result.output
    assert_one_line_error(result, fragment)
