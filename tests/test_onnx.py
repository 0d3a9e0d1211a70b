"""mtp-export --target onnx and the ONNX Runtime session on tiny models: fp32 gives the eager
tokens, speculative == plain on ORT with every drafter, the bound KV buffers are written in place
and never reallocated, int4/int8 graphs run, and bad input gets one clear line. MTP heads that
read the target's cache: the drafter graph's step is the eager head's step, and it writes the
target session's own cache buffers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import onnx
import pytest
import torch
from click.testing import CliRunner
from test_export import error_line
from tiny import hf_reference, save_hf_dir, save_random_heads, tiny_model

from mtp_edge.cli import export, run
from mtp_edge.exporter.onnx import export_program
from mtp_edge.manifest import Manifest, sha256
from mtp_edge.runtime.bundle import bundle_drafter, open_bundle, target_session
from mtp_edge.runtime.drafters import NgramDrafter
from mtp_edge.runtime.loop import GenerationConfig, first_divergence, generate
from mtp_edge.runtime.mtp_drafter import eager_step_fn
from mtp_edge.runtime.onnx_session import OnnxSession, OnnxStep
from mtp_edge.runtime.session import EagerSession, prefill

VOCAB, MAX_SEQ_LEN, CHUNK = 64, 96, 16
PROMPT = [5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9]
TEXT = "the cat the cat the cat"


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir  # conftest.py's, shared


def cli_export(out, model_dir, *extra):
    args = ["--target", "onnx", "--model", str(model_dir), "--out", str(out)]
    result = CliRunner().invoke(export, [*args, "--max-seq-len", "96", *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def mtp_bundle(onnx_mtp_bundle):
    """fp32 target with hidden-state output and an MTP drafter (conftest.py's, shared)."""
    return onnx_mtp_bundle


@pytest.fixture(scope="module")
def draft_lm_bundle(model_dir, tmp_path_factory):
    """int4 (the default for onnx) target and a separate draft model with the same vocabulary."""
    root = tmp_path_factory.mktemp("onnx-draft")
    draft = save_hf_dir(hf_reference("llama", seed=4, num_hidden_layers=1), root / "draft")
    return cli_export(root / "bundle", model_dir, "--drafter", str(draft), "--quality-tokens", "0")


@pytest.fixture(scope="module")
def cache_bundle(model_dir, tmp_path_factory):
    """fp32 target and an fp32 drafter graph of a head that reads the target's cache."""
    root = tmp_path_factory.mktemp("onnx-cache")
    heads = save_random_heads(model_dir, root / "heads.safetensors", "target_cache")
    extra = ["--drafter", "mtp", "--heads", str(heads), "--quant", "fp32", "--k", "3"]
    return cli_export(root / "bundle", model_dir, *extra, "--quality-tokens", "0")


@pytest.fixture(scope="module")
def cache_bundle_int4(model_dir, tmp_path_factory):
    """int4 target (one spare cache slot) and an int8 drafter graph reading its cache."""
    root = tmp_path_factory.mktemp("onnx-cache-int4")
    heads = save_random_heads(model_dir, root / "heads.safetensors", "target_cache")
    extra = ["--drafter", "mtp", "--heads", str(heads), "--draft-quant", "int8"]
    return cli_export(root / "bundle", model_dir, *extra, "--quality-tokens", "0")


def run_json(bundle, *extra):
    """mtp-run --json on the bundle; the model drafter ungated (random heads are never
    confident enough for the bundle's default floor) unless `extra` says otherwise."""
    args = ["--bundle", str(bundle), "--prompt", TEXT, "--no-chat-template", "--json", "-"]
    args += ["--draft-confidence", "0"]
    result = CliRunner().invoke(run, [*args, "--max-new-tokens", "40", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bundle_layout(mtp_bundle, draft_lm_bundle):
    manifest = Manifest.load(mtp_bundle)
    assert (manifest.platform, manifest.backend) == ("onnx", "onnxruntime")
    assert manifest.models["target"].file == "target.onnx"
    assert manifest.models["drafter"].file == "drafter.onnx"
    forward = manifest.models["target"].methods["forward"]
    assert [o["name"] for o in forward["outputs"]][:2] == ["logits", "hidden"]
    assert forward["in_place"]["present_key_0"] == "past_key_0"
    graph = onnx.load(mtp_bundle / "target.onnx")
    assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= 17
    ops = {n.op_type for n in graph.graph.node}
    assert "SkipSimplifiedLayerNormalization" in ops  # fused RMSNorm + residual add
    assert "GroupQueryAttention" in ops and "Concat" not in {
        n.op_type for n in graph.graph.node if any(i.startswith("past_") for i in n.input)
    }
    assert manifest.quality["perplexity_ratio"] < 1.01  # fp32: the same model
    int4 = Manifest.load(draft_lm_bundle)
    assert int4.models["target"].quant["scheme"] == "int4"
    assert int4.drafter.kind == "draft-lm"
    assert "MatMulNBits" in {
        n.op_type for n in onnx.load(draft_lm_bundle / "target.onnx").graph.node
    }


def test_fp32_export_gives_the_eager_tokens(mtp_bundle, model_dir):
    from mtp_edge.checkpoints import load_model

    session = target_session(open_bundle(mtp_bundle))
    eager = EagerSession(load_model(str(model_dir)).model, MAX_SEQ_LEN, session.max_chunk)
    config = GenerationConfig(max_new_tokens=40, k=4)
    assert (
        generate(session, PROMPT, None, config).token_ids
        == generate(eager, PROMPT, None, config).token_ids
    )
    # Logits and hidden states of prefill and of every verify width, also after a rollback.
    ours, theirs = prefill(session, PROMPT, 0, True), prefill(eager, PROMPT, 0, True)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.hidden, theirs.hidden, atol=1e-4, rtol=0)
    start = len(PROMPT)
    for width in (5, 1, 2, 16):
        tokens = [(7 * i + width) % 97 for i in range(width)]
        torch.testing.assert_close(
            session.forward(tokens, start).logits,
            eager.forward(tokens, start).logits,
            atol=1e-4,
            rtol=0,
        )
        start += width // 2 + 1  # the next call overwrites the rejected tail


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_speculative_equals_plain_on_ort(mtp_bundle, drafter):
    plain = run_json(mtp_bundle, "--drafter", "none")
    spec = run_json(mtp_bundle, "--drafter", drafter)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0
    assert spec["stats"]["verify_steps"] <= plain["stats"]["verify_steps"]


def test_speculative_equals_plain_with_a_draft_model_int4(draft_lm_bundle):
    plain = run_json(draft_lm_bundle, "--drafter", "none")
    spec = run_json(draft_lm_bundle)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0


def test_cache_reading_head_bundle(cache_bundle, cache_bundle_int4):
    manifest = Manifest.load(cache_bundle)
    assert manifest.drafter.reads_target_cache is True
    forward = manifest.models["drafter"].methods["forward"]
    assert [i["name"] for i in forward["inputs"]] == [
        "h", "token", "input_pos", "past_key", "past_value"
    ]  # fmt: skip
    assert forward["target_cache"] == {"past_key": "past_key_1", "past_value": "past_value_1"}
    target = manifest.models["target"].methods["forward"]
    assert forward["inputs"][3]["shape"] == target["inputs"][3]["shape"] == [1, 2, 96, 16]
    ops = {n.op_type for n in onnx.load(cache_bundle / "drafter.onnx").graph.node}
    assert "GroupQueryAttention" in ops and "MatMulNBits" not in ops
    int4 = Manifest.load(cache_bundle_int4)
    assert int4.models["drafter"].quant["scheme"] == "int8"
    assert int4.models["drafter"].methods["forward"]["inputs"][3]["shape"] == [1, 2, 97, 16]
    nodes = onnx.load(cache_bundle_int4 / "drafter.onnx").graph.node
    bits = {
        a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"
    }
    assert bits == {8}
    # A drafter graph bound to a cache of another shape (here: without the spare slot) is refused.
    fp32 = Manifest.load(cache_bundle).models["drafter"]
    with pytest.raises(Exception, match="re-export the bundle"):
        OnnxStep(cache_bundle / fp32.file, fp32.methods["forward"],
                 target_session(open_bundle(cache_bundle_int4)))  # fmt: skip


@pytest.mark.parametrize("bundle", ["cache_bundle", "cache_bundle_int4"])
def test_speculative_equals_plain_with_a_cache_reading_head(request, bundle):
    path = request.getfixturevalue(bundle)
    plain = run_json(path, "--drafter", "none")
    spec = run_json(path, "--drafter", "mtp")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0
    # Drafting up to the cache's end (it stops there) stays lossless too.
    long = ["--max-new-tokens", str(MAX_SEQ_LEN)]
    assert (
        run_json(path, *long)["token_ids"]
        == run_json(path, "--drafter", "none", *long)["token_ids"]
    )


def test_cache_reading_draft_step_equals_the_eager_step(cache_bundle, model_dir):
    """The ORT draft step (fp32 graph) on the ORT target's cache == the eager head on the eager
    target's cache after the same prefill: logits, next hidden state and the K/V row written."""
    from mtp_edge.checkpoints import load_model
    from mtp_edge.mtp import load_heads

    bundle = open_bundle(cache_bundle)
    session = target_session(bundle)
    drafter = bundle_drafter(bundle)
    assert isinstance(drafter.step_fn, OnnxStep) and drafter.cache_len() == MAX_SEQ_LEN
    loaded = load_model(str(model_dir))
    head = load_heads(cache_bundle.parent / "heads.safetensors", loaded.model, loaded.name)
    eager = EagerSession(loaded.model, MAX_SEQ_LEN, session.max_chunk)
    eager_step = eager_step_fn(head, loaded.model)
    ours, theirs = prefill(session, PROMPT, 0, True), prefill(eager, PROMPT, 0, True)
    torch.testing.assert_close(ours.hidden, theirs.hidden, atol=1e-4, rtol=0)
    h, token = theirs.hidden[-1:], torch.tensor([int(theirs.logits[-1].argmax())])
    ort_cache, eager_cache = session.caches, loaded.model.layers[-1].self_attn.cache
    for position in range(len(PROMPT), len(PROMPT) + 4):
        logits, next_h = drafter.step_fn(h, token, position)
        expected_logits, expected_h = eager_step(h, token, position)
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(next_h, expected_h, atol=1e-4, rtol=0)
        for kind, expected in (("key", eager_cache.k), ("value", eager_cache.v)):
            row = torch.from_numpy(ort_cache[f"past_{kind}_1"].numpy()[:, :, position])
            torch.testing.assert_close(row, expected[:, :, position], atol=1e-4, rtol=0)
        h, token = expected_h, head.draft_ids[expected_logits[0].argmax()].view(1)


def test_the_draft_step_writes_the_target_cache_in_place(cache_bundle_int4):
    bundle = open_bundle(cache_bundle_int4)
    session = target_session(bundle)
    drafter = bundle_drafter(bundle)
    pointers = {name: cache.data_ptr() for name, cache in session.caches.items()}
    out = prefill(session, PROMPT, 0, True)
    logits, hidden = out.logits, out.hidden
    written = len(PROMPT)
    key = session.caches["past_key_1"].numpy()
    assert not key[:, :, written:].any()
    h, token = hidden[-1:], torch.tensor([int(logits[-1].argmax())])
    for position in range(written, written + 3):
        draft_logits, h = drafter.step_fn(h, token, position)
        assert draft_logits.shape == (1, 64) and h.shape == (1, 64)
        token = drafter.draft_ids[draft_logits[0].argmax()].view(1)
    assert {n: c.data_ptr() for n, c in session.caches.items()} == pointers
    for kind in ("key", "value"):
        last = session.caches[f"past_{kind}_1"].numpy()
        assert last[:, :, written : written + 3].any(axis=(0, 1, 3)).all()  # the draft rows...
        assert not last[:, :, written + 3 :].any()  # ...and nothing else
    assert not session.caches["past_key_0"].numpy()[:, :, written:].any()  # last layer only
    # The last slot of the cache (drafting stops there), then the target overwrites the rows.
    drafter.step_fn(h, token, MAX_SEQ_LEN - 1)
    with pytest.raises(ValueError):
        drafter.step_fn(h, token, MAX_SEQ_LEN + 1)
    session.forward([3, 4, 5], written)
    assert {n: c.data_ptr() for n, c in session.caches.items()} == pointers


def test_kv_buffers_are_written_in_place_never_reallocated(mtp_bundle):
    session = target_session(open_bundle(mtp_bundle))
    pointers = {name: cache.data_ptr() for name, cache in session.caches.items()}
    assert len(pointers) == 2 * 2 and len(set(pointers.values())) == 4
    prefill(session, PROMPT)
    key = session.caches["past_key_0"].numpy()
    written = len(PROMPT)
    assert (key[:, :, :written] != 0).any(axis=(0, 1, 3)).all()  # the call wrote the buffer...
    assert not key[:, :, written:].any()  # ...at the prompt's slots only
    for tokens, start in (([3, 4, 5, 6, 7], written), ([8], written + 2), ([9, 10], written + 3)):
        session.forward(tokens, start, return_hidden=True)
        assert {n: c.data_ptr() for n, c in session.caches.items()} == pointers
    assert session.caches["past_key_0"].numpy()[:, :, written + 4].any()


@pytest.mark.parametrize("quant, bits", [("int4", 4), ("int8", 8)])
def test_quantized_graphs_run_and_stay_lossless(tmp_path, quant, bits):
    # head size 16: onnxruntime's GroupQueryAttention rotates q and k itself from there
    model = tiny_model(seed=3, vocab=VOCAB, dtype=torch.float32, hidden_size=64, head_dim=16)
    path = tmp_path / f"{quant}.onnx"
    methods = export_program(
        model, path, quant=quant, group_size=32, max_seq_len=MAX_SEQ_LEN, max_chunk=CHUNK
    )
    graph = onnx.load(path).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    # Per layer q/k/v as one, o, gate/up as one, down; and the LM head
    assert len(nodes) == 2 * 4 + 1
    # GroupQueryAttention rotates q and k itself: no elementwise rotary nodes are left
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all({a.name: a.i for a in n.attribute}["do_rotary"] for n in gqa)
    assert not [n for n in graph.node if n.op_type in ("Neg", "Concat")]
    attributes = {a.name: a.i for a in nodes[0].attribute}
    assert attributes["bits"] == bits and attributes["block_size"] == 32
    session = OnnxSession(path, methods["forward"], MAX_SEQ_LEN, VOCAB, CHUNK)
    eager = EagerSession(model, MAX_SEQ_LEN, CHUNK)
    logits, expected = prefill(session, PROMPT).logits, prefill(eager, PROMPT).logits
    error = float((logits - expected).abs().max()) / float(expected.abs().max())
    assert error < (0.35 if bits == 4 else 0.05)
    # A token's logits do not depend on the other tokens of its call: verifying 5 tokens gives
    # what 5 single steps give (what makes speculative output equal plain output). Single steps
    # are padded to two tokens, into a spare cache slot at the very end.
    assert session.min_tokens == 2
    assert session.caches["past_key_0"].shape()[2] == MAX_SEQ_LEN + 1
    start = len(PROMPT)
    verify = session.forward([3, 30, 41, 7, 12], start).logits
    steps = [session.forward([t], start + i).logits for i, t in enumerate([3, 30, 41, 7, 12])]
    steps = torch.cat(steps)
    torch.testing.assert_close(verify, steps, atol=1e-4, rtol=0)
    assert session.forward([3], MAX_SEQ_LEN - 1).logits.shape == (1, VOCAB)
    config = GenerationConfig(max_new_tokens=40, k=4)
    plain = generate(session, PROMPT, None, config)
    spec = generate(session, PROMPT, NgramDrafter(), config)
    assert first_divergence(plain.token_ids, spec.token_ids) is None


def test_an_onnx_file_not_matching_the_manifest_is_refused(mtp_bundle, tmp_path):
    """A target.onnx exported differently (here: no hidden output), hashes made consistent."""
    copy = tmp_path / "copy"
    shutil.copytree(mtp_bundle, copy)
    model = tiny_model(seed=3, vocab=97, dtype=torch.float32)
    export_program(model, copy / "target.onnx", quant="fp32", group_size=0,
                   max_seq_len=MAX_SEQ_LEN, max_chunk=CHUNK)  # fmt: skip
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["target"]["sha256"] = sha256(copy / "target.onnx")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    line = error_line(CliRunner().invoke(run, ["--bundle", str(copy), "--prompt", "x"]))
    assert "target.onnx does not match the bundle manifest" in line


def test_onnx_quant_scheme_is_checked(model_dir, tmp_path):
    args = ["--target", "onnx", "--model", str(model_dir), "--out", str(tmp_path / "b")]
    line = error_line(CliRunner().invoke(export, [*args, "--quant", "8da4w"]))
    assert "int4, int8, fp32" in line
    line = error_line(CliRunner().invoke(export, [*args, "--group-size", "24"]))
    assert "power of two" in line
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "qk_norm, head_dim", [(False, 16), (True, 16), (True, 8)], ids=["qwen2", "qwen3", "head8"]
)
def test_qwen_style_attention_and_tied_head_export(tmp_path, qk_norm, head_dim):
    """Biased q/k/v projections (packed into GroupQueryAttention), per-head q/k norms (then q, k
    and v go separately), head sizes GroupQueryAttention cannot rotate (the rotation then stays
    in the graph) and a tied LM head: prefill and later calls match the eager model."""
    model = tiny_model(
        seed=5, vocab=VOCAB, dtype=torch.float32, attention_bias=True, qk_norm=qk_norm,
        tie_word_embeddings=True, hidden_size=4 * head_dim, head_dim=head_dim,
    )  # fmt: skip
    assert model.lm_head is None
    path = tmp_path / "qwen.onnx"
    methods = export_program(
        model, path, quant="fp32", group_size=0, max_seq_len=MAX_SEQ_LEN, max_chunk=CHUNK
    )
    session = OnnxSession(path, methods["forward"], MAX_SEQ_LEN, VOCAB, CHUNK)
    eager = EagerSession(model, MAX_SEQ_LEN, CHUNK)
    torch.testing.assert_close(
        prefill(session, PROMPT).logits, prefill(eager, PROMPT).logits, atol=1e-4, rtol=0
    )
    for tokens, at in (([3, 30, 41], len(PROMPT)), ([7], len(PROMPT) + 3)):
        torch.testing.assert_close(
            session.forward(tokens, at).logits, eager.forward(tokens, at).logits, atol=1e-4, rtol=0
        )


def test_backends_in_one_process_share_the_cores():
    """`mtp-bench --compare` runs an ONNX and an ExecuTorch bundle in one process: each backend's
    pool gets the threads the process asked for, whichever opens first (each used to read
    torch's count and leave torch one thread, so the second got one thread and ran at half
    speed)."""
    code = (
        "import torch; torch.set_num_threads(2)\n"
        "from mtp_edge.runtime import onnx_session, executorch_session\n"
        "from executorch.extension.pybindings import portable_lib\n"
        "options = onnx_session._session_options()\n"
        "ort_threads = options.intra_op_num_threads or onnx_session._shared_pool()\n"
        "executorch_session.hand_cores_to_executorch()\n"
        "print(ort_threads, portable_lib._threadpool_get_thread_count(), torch.get_num_threads())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.split()[-3:] == ["2", "2", "1"], out.stdout + out.stderr


def test_onnx_sessions_share_one_thread_pool(mtp_bundle):
    """The target's and the drafter's sessions run on the process's one onnxruntime pool (two
    pools of spinning workers fight over the cores whenever the loop alternates them), and
    MTP_EDGE_ORT_POOL=session gives each its own pool, workers sleeping between calls."""
    code = (
        "import torch; torch.set_num_threads(2)\n"
        "from mtp_edge.runtime import onnx_session\n"
        "from mtp_edge.runtime.bundle import open_bundle, target_session, bundle_drafter\n"
        f"bundle = open_bundle({str(mtp_bundle)!r})\n"
        "target_session(bundle); bundle_drafter(bundle)\n"
        "o = onnx_session._session_options()\n"
        "pool = onnx_session._SHARED_POOL\n"
        "print(pool[0] if pool else None, o.use_per_session_threads, o.intra_op_num_threads)\n"
    )
    for pool, expected in (("shared", ["2", "False", "0"]), ("session", ["None", "True", "2"])):
        env = {**os.environ, "MTP_EDGE_ORT_POOL": pool}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-3:] == expected, out.stdout


def test_an_unknown_pool_setting_is_refused(monkeypatch):
    from mtp_edge.errors import UserError
    from mtp_edge.runtime import onnx_session

    monkeypatch.setenv("MTP_EDGE_ORT_POOL", "sesion")
    with pytest.raises(UserError, match="MTP_EDGE_ORT_POOL must be 'shared' or 'session'"):
        onnx_session._session_options()
