"""What mtp-bench --prompts and mtp-predict --from-bench read: a wrong file is one line naming it
(file:line where a line is at fault) before any model loads, and a logged raw completion is
benched as the text it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mtp_edge.cli import bench, predict, profile
from mtp_edge.devices import predict as roofline
from mtp_edge.devices.harness import load_prompts
from mtp_edge.errors import UserError
from mtp_edge.manifest import Manifest
from mtp_edge.request_log import RequestLog


def error_line(result) -> str:
    """The one `error:` line a failing command printed (after any progress lines)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: "), result.output
    return last


def bench_with(prompts: Path, model: Path, *args: str):
    command = ["--model", str(model), "--drafter", "ngram", "--prompts", str(prompts), *args]
    return CliRunner().invoke(bench, command)


# --- mtp-bench --prompts FILE --------------------------------------------------------------------


def test_a_prompts_file_that_is_not_utf8_is_one_line(tmp_path, tiny_dir):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "hi \xff"}\n')
    line = error_line(bench_with(path, tiny_dir))
    assert f"{path}: not UTF-8 text" in line


@pytest.mark.parametrize(
    "field, shown",
    [
        ({"max_new_tokens": -5}, '"max_new_tokens" must be a whole number >= 1, got -5'),
        ({"max_new_tokens": 0}, '"max_new_tokens" must be a whole number >= 1, got 0'),
        ({"max_new_tokens": 4.7}, '"max_new_tokens" must be a whole number >= 1, got 4.7'),
        ({"max_new_tokens": "lots"}, '"max_new_tokens" must be a whole number >= 1'),
        ({"prompt": {"x": 1}}, '"prompt" must be a non-empty string, got {"x": 1}'),
        ({"prompt": ""}, '"prompt" must be a non-empty string, got ""'),
        ({"prompt": "   "}, '"prompt" must be a non-empty string'),
        ({"prompt": None}, '"prompt" must be a non-empty string, got null'),
    ],
)
def test_a_wrong_field_is_refused_where_the_file_is_read(tmp_path, tiny_dir, field, shown):
    """Named with its file:line, and not as the -n flag the user never gave."""
    path = tmp_path / "prompts.jsonl"
    good = {"id": "a", "category": "x", "prompt": "hi", "max_new_tokens": 4}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "b", **field}) + "\n")
    line = error_line(bench_with(path, tiny_dir))
    assert f"{path}:2: {shown}" in line, line
    assert "--max-new-tokens" not in line


def test_the_prompt_forms_the_loader_takes_still_load(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": 1, "prompt": "one", "max_new_tokens": 4.0},  # a number id, a whole float
        {"id": "b", "category": "qa", "prompt": "two"},  # the default length
        {"id": "c", "prompt": "three\u2028lines"},  # a line separator is not a line's end
    ]
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n"
    path.write_text(text, encoding="utf-8")
    assert [(p.id, p.category, p.prompt, p.max_new_tokens) for p in load_prompts(path)] == [
        ("1", "default", "one", 4),
        ("b", "qa", "two", 128),
        ("c", "default", "three\u2028lines", 128),
    ]
    # one request log file (records with "messages") is a suite too
    log = tmp_path / "requests.jsonl"
    record = {"messages": [{"role": "user", "content": "hi"}], "answer_ids": [1, 2]}
    log.write_text(json.dumps(record) + "\n")
    assert [(p.prompt, p.messages, p.raw) for p in load_prompts(log)] == [("hi", None, False)]
    assert len(load_prompts()) > 0  # the built-in suite


# --- mtp-bench --prompts LOG_DIR -----------------------------------------------------------------


def test_a_logged_raw_completion_is_benched_as_its_raw_text(tmp_path, chat_tiny_dir):
    """The server logs a raw completion as one user message marked "raw"; the chat template
    wrapped around it would bench another prompt than the one the server ran."""
    from mtp_edge.runtime.assemble import LoadOptions, assemble

    log = RequestLog(tmp_path / "log")
    text = "the cat sat on the mat"
    log.append([{"role": "user", "content": text, "raw": True}], [5] * 20, 1.5)
    log.append([{"role": "user", "content": text}], [5] * 20, 1.5)  # the same text as chat
    # a raw prompt whose text does not encode back to its ids keeps them (request_log.py)
    ids = [7, 8, 9, 10, 11, 12, 13]
    log.append([{"role": "user", "content": "?", "raw": True, "token_ids": ids}], [5], 1.0)
    prompts = load_prompts(tmp_path / "log")
    assert [(p.prompt, p.raw) for p in prompts] == [(text, True), (text, False), ("?", True)]
    out = tmp_path / "report.json"
    result = bench_with(tmp_path / "log", chat_tiny_dir, "-n", "4", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["prompts"]
    gen = assemble(LoadOptions(model=str(chat_tiny_dir), drafter="ngram"))
    raw_ids = gen.tokenizer.encode_prompt(text, chat=False)
    assert len(gen.encode(text)) != len(raw_ids)  # the template adds tokens: the test can tell
    assert [r["prompt_tokens"] for r in rows] == [len(raw_ids), len(gen.encode(text)), len(ids)]
    # ids another model's log holds: one line, not a crash inside the model
    log.append([{"role": "user", "content": "?", "raw": True, "token_ids": [5, 500]}], [5], 1.0)
    line = error_line(bench_with(tmp_path / "log", chat_tiny_dir, "-n", "4"))
    assert "holds token ids outside this model's vocabulary (0..96)" in line, line


def test_profile_refuses_raw_completions_its_runner_would_wrap(tmp_path, ngram_bundle_8da4w):
    log = RequestLog(tmp_path / "log")
    log.append([{"role": "user", "content": "the cat", "raw": True}], [5] * 20, 1.5)
    args = ["--device", "host", "--bundle", str(ngram_bundle_8da4w)]
    line = error_line(CliRunner().invoke(profile, [*args, "--prompts", str(tmp_path / "log")]))
    assert "holds raw completions" in line, line


def test_a_folder_without_request_logs_says_what_prompts_takes(tmp_path, tiny_dir):
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "list.txt").write_text("hello\n")
    (folder / "more.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    for path in (folder, tmp_path / "empty"):
        path.mkdir(exist_ok=True)
        line = error_line(bench_with(path, tiny_dir))
        assert f"{path} holds no request log (requests.jsonl files written by --log)" in line
        assert "takes a log folder or one .jsonl prompts file" in line


# --- mtp-predict --from-bench --------------------------------------------------------------------


def bench_body(**fields) -> dict:
    """The figures an mtp-bench --json report holds that mtp-predict reads."""
    summary = {
        "tau": 2.0,
        "acceptance_rate": 0.5,
        "ar_tokens_per_s": 100.0,
        "spec_tokens_per_s": 150.0,
        "speedup": 1.5,
    }
    rows = [{"prompt_tokens": 20, "ar_tokens": 8}]
    return {"k": 4, "summary": summary, "prompts": rows, **fields}


@pytest.mark.parametrize(
    "content",
    ["5", '"text"', "[]", '{"runs": []}', '{"runs": [5]}', '{"summary": 5}', "{}"]
    + ['{"summary": {"tau": "x"}}', json.dumps(bench_body(prompts=[{"prompt_tokens": 3}]))],
)
def test_predict_refuses_what_is_not_a_bench_report(ngram_bundle_8da4w, tmp_path, content):
    path = tmp_path / "bench.json"
    path.write_text(content)
    args = ["--bundle", str(ngram_bundle_8da4w), "--from-bench", str(path)]
    line = error_line(CliRunner().invoke(predict, args))
    assert f"{path} is not an mtp-bench --json report" in line, line


def test_predict_refuses_a_bench_of_another_model(ngram_bundle_8da4w, tmp_path):
    """A bench of a model on the eager backend, not of this bundle: its tau and tokens/s would
    give a prediction that looks right and is of something else."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_body(bundle=None, backend="eager", drafter="ngram")))
    args = ["--bundle", str(ngram_bundle_8da4w), "--from-bench", str(path)]
    line = error_line(CliRunner().invoke(predict, args))
    assert "not of a bundle" in line and f"mtp-bench --bundle {ngram_bundle_8da4w}" in line


def test_predict_refuses_a_bench_of_another_bundle(
    ngram_bundle_8da4w, ngram_bundle_8da8w, tmp_path
):
    other = Manifest.load(ngram_bundle_8da8w, verify=False).models["target"].sha256
    path = tmp_path / "bench.json"
    report = bench_body(
        bundle=str(ngram_bundle_8da8w), target_sha256=other, backend="executorch", drafter="ngram"
    )
    path.write_text(json.dumps(report))
    args = ["--bundle", str(ngram_bundle_8da4w), "--from-bench", str(path)]
    line = error_line(CliRunner().invoke(predict, args))
    assert f"a bench of the bundle {ngram_bundle_8da8w}" in line, line


def test_a_bench_is_of_the_bundle_by_its_target(
    ngram_bundle_8da4w, ngram_bundle_8da8w, copy_bundle
):
    """Where the report records the target's sha256 it decides (a copy is the same bundle,
    another at the same path is not); an older report's bundle path is compared, or the bundle
    it names read; and its drafter must be the bundle's."""
    bundle = ngram_bundle_8da4w
    manifest = Manifest.load(bundle, verify=False)
    ours = manifest.models["target"].sha256
    copy = copy_bundle(bundle, "copy")

    def check(**fields):
        report = bench_body(model=manifest.model_name, **{"backend": "executorch", **fields})
        roofline.check_bench_of(report, "bench.json", copy, manifest)

    check(bundle=str(bundle), target_sha256=ours, drafter="ngram")  # moved or copied
    check(bundle=str(copy), drafter="ngram")  # an older report: the same path
    check(bundle=str(bundle), drafter="ngram")  # an older report naming a copy still there
    refused = [
        ("not of a bundle", dict(bundle=None, drafter="ngram")),
        ("whose target differs", dict(bundle=str(copy), target_sha256="0" * 64)),
        ("no bundle to compare now", dict(bundle=str(copy.parent / "gone"), drafter="ngram")),
        # an older report: the other bundle's manifest, read from the path it names
        ("whose target differs", dict(bundle=str(ngram_bundle_8da8w), drafter="ngram")),
        ("measured the mtp drafter", dict(bundle=str(copy), target_sha256=ours, drafter="mtp")),
        ("backend onnxruntime", dict(bundle=str(copy), backend="onnxruntime", drafter="ngram")),
    ]
    for words, fields in refused:
        with pytest.raises(UserError, match=words):
            check(**fields)
