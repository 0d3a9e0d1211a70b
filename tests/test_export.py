"""mtp-export --target android end to end on a tiny model: bundles, runs on them, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from tiny import hf_reference, save_hf_dir, save_random_heads, setup_options

from mtp_edge.cli import bench, export, run
from mtp_edge.errors import UserError
from mtp_edge.exporter import pipeline
from mtp_edge.exporter.pipeline import ExportOptions, export_bundle
from mtp_edge.manifest import DrafterSpec, Manifest

PROMPT = "the cat the cat the cat"


@pytest.fixture(scope="module")
def model_dir(tiny_dir_seed5):
    return tiny_dir_seed5  # conftest.py's, shared


@pytest.fixture(scope="module")
def bundle(ngram_bundle_8da4w):
    """model_dir exported with --max-seq-len 96 --quant 8da4w --group-size 32
    --quality-tokens 64 (the n-gram drafter): conftest.py's, shared."""
    return ngram_bundle_8da4w


def error_line(result) -> str:
    """The one error line (progress lines may precede it); no traceback."""
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1
    return lines[-1]


def test_bundle_layout(bundle):
    manifest = Manifest.load(bundle)
    assert manifest.platform == "android" and manifest.backend == "executorch"
    assert manifest.models["target"].file == "target.pte"
    assert manifest.models["target"].quant["scheme"] == "8da4w"
    assert manifest.drafter == DrafterSpec(kind="ngram", k=4)
    assert manifest.max_seq_len == 96 and manifest.vocab_size == 97
    forward = manifest.models["target"].methods["forward"]
    assert [i["name"] for i in forward["inputs"]] == ["tokens", "input_pos"]
    assert manifest.quality["perplexity_exported"] > 0
    assert manifest.quality["perplexity_ratio"] < 1.5  # 4-bit weights cost some, not everything
    # forward is row-exact at any width (our attention op): no verify method to load twice
    assert "verify" not in manifest.models["target"].methods
    exactness = manifest.quality["verify_vs_step"]
    assert exactness["width"] == 5 and exactness["positions"] > 0
    assert exactness["max_abs_logit_shift"] == 0 and exactness["argmax_flips"] == 0
    acceptance = manifest.quality["drafter_acceptance"]
    assert 0 <= acceptance["exported"]["acceptance_rate"] <= 1
    assert 1 <= acceptance["exported"]["tau"] <= 5
    assert len(acceptance["exported"]["acceptance_per_position"]) == 4
    # The target was quantized while it was read: no float model to measure against.
    assert acceptance["fp32"].startswith("not measured")
    assert manifest.quality["perplexity_fp32_method"].startswith("streamed")
    stages = [row["stage"] for row in manifest.export_log["stages"]]
    assert stages[0] == "load, quantize, fp32 perplexity" and "export" in stages
    assert {p.name for p in bundle.iterdir()} == {
        "manifest.json",
        "target.pte",
        "tokenizer.json",
        "tokenizer_meta.json",
    }
    assert not list(bundle.parent.glob(".*partial"))


def test_speculative_equals_plain_on_the_bundle(bundle):
    args = [
        "--bundle",
        str(bundle),
        "--prompt",
        PROMPT,
        "--no-chat-template",
        "--json",
        "-",
        "--max-new-tokens",
        "40",
    ]
    spec = CliRunner().invoke(run, args)
    plain = CliRunner().invoke(run, [*args, "--drafter", "none"])
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output + plain.output
    spec, plain = json.loads(spec.stdout), json.loads(plain.stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["verify_steps"] <= plain["stats"]["verify_steps"]


def test_bench_on_the_bundle(bundle, model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"id": f"p{i}", "category": c, "prompt": f"{PROMPT} {c}", "max_new_tokens": 16}
        for i, c in enumerate(["code", "chat"])
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "bench.json"
    args = [
        "--bundle",
        str(bundle),
        "--prompts",
        str(prompts),
        "--json",
        str(out),
        "--no-chat-template",
    ]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["backend"] == "executorch" and report["drafter"] == "ngram"
    assert report["summary"]["lossless"] is True
    assert "peer_textllmrunner" in report  # measured, or the reason it could not run
    # The bundle keeps its source; from an HF directory llama.cpp has no GGUF to decode (when
    # llama-bench is on PATH at all), and the report says why instead.
    source = json.loads((bundle / "manifest.json").read_text())["source"]
    assert source == {"path": str(model_dir.resolve()), "format": "hf"}
    note = report["peer_llama_cpp"]["note"]
    assert note.startswith("llama.cpp not measured: ") and ("PATH" in note or "--gguf" in note)
    assert "Peer baseline, llama.cpp on the same GGUF (plain): " + note in result.output


def test_bench_refuses_a_llama_cpp_directory_without_llama_bench(bundle, tmp_path):
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), "--llama-cpp", str(tmp_path)])
    assert result.exit_code == 2
    want = f"error: --llama-cpp {tmp_path}: no executable llama-bench"
    assert error_line(result).startswith(want)


def test_bench_refuses_a_gguf_that_is_not_there_before_measuring(bundle, tmp_path):
    missing = tmp_path / "model.gguf"
    result = CliRunner().invoke(bench, ["--bundle", str(bundle), "--gguf", str(missing)])
    assert result.exit_code == 2
    assert error_line(result) == (
        f"error: --gguf {missing} does not exist: give the GGUF file the bundle was exported from"
    )
    assert "[1/" not in result.output  # refused before the first prompt


def test_llama_cpp_is_timed_after_each_prompt(bundle, tmp_path):
    """With a real llama-bench (on PATH, or a build named by MTP_EDGE_LLAMA_CPP; skipped
    without one), mtp-bench times llama.cpp on each prompt's shape right after our setups
    decoded it: as many tokens as our plain decoding after the first, after the prompt's
    context; the rate is all tokens over all seconds, as ours."""
    import os

    from mtp_edge.checkpoints import default_model_path
    from mtp_edge.devices.peer import find_llama_bench

    tool = find_llama_bench(os.environ.get("MTP_EDGE_LLAMA_CPP"))
    if tool is None:
        pytest.skip("llama.cpp's llama-bench is not on PATH (set MTP_EDGE_LLAMA_CPP to a build)")
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"id": f"p{i}", "category": "chat", "prompt": f"{PROMPT} " * (i + 1), "max_new_tokens": n}
        for i, n in enumerate([9, 17])
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "bench.json"
    args = ["--bundle", str(bundle), "--prompts", str(prompts), "--no-chat-template"]
    args += ["--llama-cpp", str(tool.parent), "--gguf", str(default_model_path())]
    page = tmp_path / "report"
    result = CliRunner().invoke(bench, [*args, "--json", str(out), "--report", str(page)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    peer = report["peer_llama_cpp"]
    assert "error" not in peer, peer
    ours = report["prompts"]
    assert peer["interleaved"] is True and peer["prompts"] == 2
    assert peer["new_tokens"] == round(sum(r["ar_tokens"] - 1 for r in ours) / 2)
    assert peer["depth"] == round(sum(r["prompt_tokens"] for r in ours) / 2)
    assert peer["tokens_per_s"] > 0 and peer["threads"] == report["threads"]
    by_prompt = peer["tokens_per_s_by_prompt"]
    assert len(by_prompt) == 2 and min(by_prompt) <= peer["tokens_per_s"] <= max(by_prompt)
    assert result.output.count("  llama.cpp: ") == 2  # one round after each prompt
    assert "each of 2 prompts' length and context timed right after ours" in result.output
    ratio = report["summary"]["ar_tokens_per_s"] / peer["tokens_per_s"]
    assert (
        f"Peer baseline, llama.cpp on the same GGUF (plain): {peer['tokens_per_s']:.1f} tok/s; "
        f"our plain decoding {ratio:.2f}x it (timed prompt by prompt beside ours)"
    ) in (page / "report.md").read_text()


def test_llama_cpp_decodes_the_model_that_mtp_bench_decodes(model_dir, tmp_path):
    """Without a bundle the peer decodes -m's GGUF (here the default model); a model directory
    has none, and the report says to give --gguf. Needs a real llama-bench (skipped without)."""
    import os

    from mtp_edge.devices.peer import find_llama_bench

    tool = find_llama_bench(os.environ.get("MTP_EDGE_LLAMA_CPP"))
    if tool is None:
        pytest.skip("llama.cpp's llama-bench is not on PATH (set MTP_EDGE_LLAMA_CPP to a build)")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "category": "chat", "prompt": PROMPT}) + "\n")
    args = ["--prompts", str(prompts), "-n", "6", "--no-chat-template"]
    args += ["--llama-cpp", str(tool.parent)]
    out = tmp_path / "default.json"
    result = CliRunner().invoke(bench, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    peer = json.loads(out.read_text())["peer_llama_cpp"]
    assert peer["interleaved"] is True and peer["prompts"] == 1, peer
    out = tmp_path / "dir.json"
    result = CliRunner().invoke(bench, [*args, "-m", str(model_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["peer_llama_cpp"] == {
        "note": f"llama.cpp not measured: {model_dir} is not a GGUF file: give --gguf"
    }


def test_tampered_bundle_is_refused(bundle, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    pte = copy / "target.pte"
    data = bytearray(pte.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pte.write_bytes(bytes(data))
    line = error_line(CliRunner().invoke(run, ["--bundle", str(copy), "--prompt", "x"]))
    assert "sha256" in line and "target.pte" in line


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--target", "fpga"], "'fpga' is not one of"),
        (["--quant", "9bit"], "'9bit' is not one of"),
        (["--quant", "8da4w", "--group-size", "24"], "does not divide"),
        (["--k", "0"], "--k"),
    ],
)
def test_bad_export_options(model_dir, tmp_path, extra, fragment):
    args = ["--model", str(model_dir), "--out", str(tmp_path / "b"), *extra]
    assert fragment in error_line(CliRunner().invoke(export, args))
    assert not (tmp_path / "b").exists()


def test_unwritable_out(model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = ["--model", str(model_dir), "--out", str(blocker / "bundle")]
    assert "--out" in error_line(CliRunner().invoke(export, args))


def test_interrupted_export_leaves_nothing(model_dir, tmp_path, monkeypatch):
    """Ctrl-C in the middle of writing: no bundle under the requested name, no temp dir left."""
    from mtp_edge.exporter import executorch

    def interrupted(model, path, **kwargs):
        path.write_bytes(b"half a program")
        raise KeyboardInterrupt

    monkeypatch.setattr(executorch, "export_program", interrupted)
    out = tmp_path / "bundle"
    options = ExportOptions(model=str(model_dir), max_seq_len=64, quality_tokens=0, isolate=False)
    with pytest.raises(KeyboardInterrupt):
        export_bundle(options, out, open_program=None, progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_lowering_process_leaves_nothing(model_dir, tmp_path):
    """Ctrl-C while the child process lowers: the command exits 130 with one line, the child
    goes with it, and nothing is left under --out or beside it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "bundles" / "b"
    # A model this small lowers in the exporting process (pipeline.lowers_in_child): every size
    # in a child here, as a model of any size that matters is.
    child_always = "from mtp_edge.exporter import pipeline; pipeline.IN_PROCESS_BELOW_GB = 0"
    command = [sys.executable, "-c", f"{child_always}; from mtp_edge.cli import export; export()"]
    command += ["-m", str(model_dir), "-o", str(out)]
    command += ["--max-seq-len", "64", "--quality-tokens", "0"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1)
    seen = ""
    for line in process.stderr:  # the bars come from the child: it is lowering now
        seen += line
        if line.startswith("exporting forward"):
            break
    assert process.poll() is None, seen
    child = subprocess.run(
        ["pgrep", "-P", str(process.pid), "-f", "mtp_edge.exporter.lowering_child"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(child) == 1, seen
    with open(f"/proc/{child[0]}/cmdline", "rb") as f:  # told whose child it is
        assert f.read().split(b"\0")[-2] == str(process.pid).encode()
    process.send_signal(signal.SIGINT)  # to the parent alone: it must stop the child itself
    rest = process.stderr.read()
    assert process.wait(timeout=60) == 130, seen + rest
    assert rest.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in rest
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child[0]}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child[0]}")
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_lowering_process_leaves_when_its_parent_is_killed(tmp_path):
    """SIGKILL (or the OOM killer) takes an export's parent without a chance to stop its
    lowering child, which may be silent for minutes (nothing to fail on a closed pipe): the
    child notices it has another parent and exits instead of lowering for nobody. Here the
    child is silent, as lowering a large model is."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child_code = (
        "import os, time\n"
        "from mtp_edge.exporter.lowering_child import exit_with_parent\n"
        "exit_with_parent(os.getppid(), every_s=0.1)\n"
        "time.sleep(60)\n"
    )
    parent_code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child has imported and watches
    assert os.path.exists(f"/proc/{child}")
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = os.path.exists(f"/proc/{child}")
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived its killed parent"


def test_drafter_vocabulary_checked_at_export(model_dir, tmp_path):
    other = save_hf_dir(hf_reference("llama", seed=5, vocab=101), tmp_path / "o", vocab=101)
    options = ExportOptions(model=str(model_dir), drafter=str(other), quality_tokens=0)
    with pytest.raises(UserError, match="vocabulary"):
        export_bundle(options, tmp_path / "b", open_program=None, progress=lambda _: None)
    assert pipeline.default_out(options, "m").name == "m-android"


@pytest.fixture(scope="module")
def fp32_self_bundle(model_dir, tmp_path_factory):
    """model_dir exported in fp32 with random heads of the kind that keeps a cache of its own
    (an fp32 drafter.pte), 64 positions, chunks of 8: (bundle, heads file). The target's and the
    drafter's programs are each checked against the eager model below: one export for both."""
    root = tmp_path_factory.mktemp("fp32-self")
    heads = save_random_heads(model_dir, root / "heads.safetensors", "self")
    options = ExportOptions(
        model=str(model_dir),
        drafter="mtp",
        heads=str(heads),
        quant="fp32",
        draft_quant="fp32",
        group_size=0,
        embedding_quant="none",
        max_seq_len=64,
        max_chunk=8,
        quality_tokens=0,
    )
    out, _ = export_bundle(options, root / "b", None, progress=lambda _: None)
    return out, heads


def test_exported_fp32_logits_match_eager(model_dir, fp32_self_bundle):
    """The fp32 program computes what the eager model computes, also after a rollback."""
    from mtp_edge.checkpoints import load_model
    from mtp_edge.runtime.executorch_session import ExecuTorchSession
    from mtp_edge.runtime.session import EagerSession

    out, _ = fp32_self_bundle
    manifest = Manifest.load(out)
    program = ExecuTorchSession(out / "target.pte", 64, manifest.vocab_size, 8)
    eager = EagerSession(load_model(str(model_dir)).model, 64)
    prompt = [5, 9, 2, 7, 7, 1, 30, 4]
    torch.testing.assert_close(
        program.forward(prompt, 0).logits, eager.forward(prompt, 0).logits, atol=1e-4, rtol=1e-4
    )
    program.forward([3, 11, 12, 13, 14], len(prompt))  # a draft, rejected after 2 tokens
    eager.forward([3, 11, 12, 13, 14], len(prompt))
    after = program.forward([30, 31, 32], len(prompt) + 2).logits
    torch.testing.assert_close(
        after, eager.forward([30, 31, 32], len(prompt) + 2).logits, atol=1e-4, rtol=1e-4
    )


@pytest.fixture(scope="module", params=["target_cache", "none", "self"])
def mtp_bundle(mtp_bundle_of, request):
    """A bundle with an MTP drafter (random heads: lossless does not need good drafts), of
    each kind: a head that reads the target's cache (a method of target.pte), one without
    attention and one with a cache of its own (each its own drafter.pte). conftest.py's, shared
    with other modules: exported with the default drafting policy, its heads file beside it."""
    return mtp_bundle_of(request.param)


def test_mtp_bundle_is_lossless_greedy_and_sampled(mtp_bundle):
    manifest = Manifest.load(mtp_bundle)
    in_target = "draft" in manifest.models["target"].methods
    assert manifest.drafter.kind == "mtp" and ("drafter" in manifest.models) != in_target
    assert in_target == (manifest.drafter.method == "draft")
    # forward returns the logits alone (stock runners read one output); the hidden states the
    # heads read come from last_hidden, one row per token of the last call
    methods = manifest.models["target"].methods
    assert [o["name"] for o in methods["forward"]["outputs"]] == ["logits"]
    assert [o["name"] for o in methods["last_hidden"]["outputs"]] == ["hidden"]
    args = [
        "--bundle",
        str(mtp_bundle),
        "--prompt",
        PROMPT,
        "--no-chat-template",
        "--json",
        "-",
        "--max-new-tokens",
        "40",
    ]
    # The head alone, ungated (random heads are never confident) and drafting every step (the
    # fallback would stop drafts that do not pay), then the bundle's policy.
    head = ["--drafter", "mtp", "--draft-confidence", "0", "--no-fallback"]
    spec = json.loads(CliRunner().invoke(run, [*args, *head]).stdout)
    plain = json.loads(CliRunner().invoke(run, [*args, "--drafter", "none"]).stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0
    policy = json.loads(CliRunner().invoke(run, args).stdout)
    assert policy["token_ids"] == plain["token_ids"]
    sampled = CliRunner().invoke(run, [*args, *head, "--temperature", "0.9", "--seed", "1"])
    assert sampled.exit_code == 0, sampled.output


def test_exported_self_head_drafts_as_the_eager_head(model_dir, fp32_self_bundle):
    """The self head's fp32 program (its own cache in buffers, chunks of T rows) gives the
    eager head's draft logits: a chunk of verified rows, recurrent steps past it, then a chunk
    that starts inside the drafted slots and overwrites them."""
    from mtp_edge.checkpoints import load_model
    from mtp_edge.mtp import load_heads
    from mtp_edge.runtime.executorch_session import ExecuTorchStep
    from mtp_edge.runtime.mtp_drafter import eager_step_fn

    out, heads = fp32_self_bundle
    loaded = load_model(str(model_dir))
    head = load_heads(heads, loaded.model, loaded.name)
    manifest = Manifest.load(out)
    assert manifest.drafter.own_cache and manifest.drafter.max_chunk == 8
    program = ExecuTorchStep(out / "drafter.pte", max_chunk=8)
    model = loaded.model
    model.setup_cache(64)
    eager = eager_step_fn(head, model)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, model.config.hidden_size, generator=generator)
    tokens = torch.randint(0, model.config.vocab_size, (40,), generator=generator)
    calls = [(0, 13), (13, 1), (14, 1), (15, 1), (13, 3), (16, 1), (16, 20)]  # (row, rows)
    for row, rows in calls:
        h, t = hidden[row : row + rows], tokens[row : row + rows]
        want, want_h = eager(h, t, row + 1)
        got, got_h = program(h, t, row + 1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)


def test_bundle_carries_its_drafting_policy(mtp_bundle):
    """The exporter stores how the runtime drafts with the bundle's model drafter (lookup first,
    a first-token confidence floor); the runtime applies it unless told otherwise."""
    from dataclasses import replace

    from mtp_edge.runtime.assemble import assemble
    from mtp_edge.runtime.drafters import HybridDrafter

    drafter = Manifest.load(mtp_bundle).drafter
    assert drafter.lookup == "2-3" and drafter.draft_confidence == 0.5
    opts = setup_options(mtp_bundle, 96)
    default = assemble(opts).drafter
    assert isinstance(default, HybridDrafter) and default.name == "mtp+ngram"
    assert (default.lookup.min_n, default.lookup.max_n) == (2, 3)
    assert default.model.min_confidence == 0.5
    told = assemble(replace(opts, drafter="mtp", draft_confidence=0.0)).drafter
    assert told.name == "mtp" and told.min_confidence == 0.0
    sizes = assemble(replace(opts, ngram_sizes="1-4")).drafter
    assert (sizes.lookup.min_n, sizes.lookup.max_n) == (1, 4)


def test_heads_for_another_target_are_refused(mtp_bundle, tmp_path):
    other = save_hf_dir(hf_reference("llama", seed=8), tmp_path / "other")
    heads = mtp_bundle.parent / "heads.safetensors"
    args = [
        "--model",
        str(other),
        "--drafter",
        "mtp",
        "--heads",
        str(heads),
        "--out",
        str(tmp_path / "b"),
    ]
    assert "trained for" in error_line(CliRunner().invoke(export, args))


def test_llama_cpp_decodes_the_default_gguf():
    """The llama.cpp peer with a real llama-bench (on PATH, or a build named by
    MTP_EDGE_LLAMA_CPP; skipped without one) on the embedded model's GGUF."""
    import os

    from mtp_edge.checkpoints import default_model_path
    from mtp_edge.devices.peer import find_llama_bench, llama_cpp_baseline

    tool = find_llama_bench(os.environ.get("MTP_EDGE_LLAMA_CPP"))
    if tool is None:
        pytest.skip("llama.cpp's llama-bench is not on PATH (set MTP_EDGE_LLAMA_CPP to a build)")
    result = llama_cpp_baseline(tool, default_model_path(), 2, 8, 16, repetitions=1)
    assert "error" not in result, result
    assert result["tokens_per_s"] > 0 and result["new_tokens"] == 8 and result["depth"] == 16


def test_a_draft_model_in_8_bits_beside_a_4_bit_target_exports(chat_tiny_dir, tmp_path):
    """--quant 8da4w (groups of 32) with --draft-quant 8da8w: the draft model gets its scheme's
    per-channel weights (not the target's group size, which 8da8w refuses), and the manifest
    records each model's own group size; the bundle runs losslessly."""
    from tiny import save_chat_dir

    draft = save_chat_dir(tmp_path / "draft", seed=3)
    out = tmp_path / "bundle"
    args = ["--model", str(chat_tiny_dir), "--out", str(out), "--max-seq-len", "128"]
    args += ["--quality-tokens", "0", "--drafter", str(draft), "--quant", "8da4w"]
    result = CliRunner().invoke(export, [*args, "--draft-quant", "8da8w"])
    assert result.exit_code == 0, result.output
    manifest = Manifest.load(out)
    assert manifest.models["target"].quant["group_size"] == 32
    assert manifest.models["drafter"].quant == dict(
        manifest.models["target"].quant, scheme="8da8w", group_size=0
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "category": "chat", "prompt": "hello there"}) + "\n")
    report = tmp_path / "bench.json"
    args = ["--bundle", str(out), "--prompts", str(prompts), "--max-new-tokens", "12"]
    ran = CliRunner().invoke(bench, [*args, "--json", str(report)])
    assert ran.exit_code == 0, ran.output  # exits non-zero where speculative output differs
    assert json.loads(report.read_text())["summary"]["lossless"] is True
