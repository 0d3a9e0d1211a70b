"""mtp-export --target coreml on Linux: what can be checked without a Mac.

Conversion with each weight scheme; the saved package's functions, states, input/output names
and quantized weight ops (read from its spec and MIL program), with an MTP head that reads the
target's cache (its draft step shares the cache state) and with one that does not; the fp16
PyTorch programs handed to the converter, run through the session's own fixed-width dispatch,
give the eager model's greedy tokens with the speculative loop on top, and their draft step
computes the eager one on the same cache; the Core ML backend refuses to run on Linux with one
line. What only a Mac can check is listed in the README.
"""

from __future__ import annotations

import collections
import functools
import json
import sys

import pytest
import torch
from click.testing import CliRunner
from test_export import error_line
from tiny import hf_reference, save_hf_dir, save_random_heads, tiny_model

from mtp_edge.cli import export, run
from mtp_edge.errors import UserError
from mtp_edge.exporter.coreml import export_package, programs, widths
from mtp_edge.manifest import DrafterSpec, Manifest
from mtp_edge.mtp import MTPConfig, MTPHead, cache_attention_config, init_from_target
from mtp_edge.runtime.coreml_session import FixedWidthSession
from mtp_edge.runtime.drafters import NgramDrafter
from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.mtp_drafter import MtpDrafter, eager_step_fn
from mtp_edge.runtime.session import EagerSession

VOCAB, MAX_SEQ_LEN, CHUNK, K = 64, 96, 16, 4
PROMPT = [5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9]
SCHEMES = {"fp16": None, "int8": "int8", "int4": "int4"}  # scheme -> quantized weight dtype

linux_only = pytest.mark.skipif(sys.platform == "darwin", reason="checks the Linux refusal")


def target():
    return tiny_model(seed=3, vocab=VOCAB, dtype=torch.float32)


def head_for(model, attention: str = "target_cache"):
    """A head of either kind (mtp.py): one that reads the target's cache, or MLP-only."""
    c = model.config
    extra = cache_attention_config(model) if attention == "target_cache" else {}
    torch.manual_seed(0)
    head = MTPHead(MTPConfig(c.hidden_size, 2 * c.hidden_size, c.vocab_size, 32, **extra))
    return init_from_target(head, model, torch.arange(VOCAB - 32, VOCAB))


_PACKAGES: list = []  # the directory `package` writes into: this module's tmp_path_factory's


@pytest.fixture(scope="module", autouse=True)
def _packages(tmp_path_factory):
    if not _PACKAGES:
        _PACKAGES.append(tmp_path_factory.mktemp("coreml-packages"))


@functools.cache
def package(scheme: str, attention: str = "target_cache"):
    """(path, methods) of the tiny model + MTP head converted with `scheme`, once per run."""
    model = target()
    path = _PACKAGES[0] / f"{scheme}-{attention}" / "model.mlpackage"
    path.parent.mkdir()
    methods, settings = export_package(
        model, head_for(model, attention), path, quant=scheme, draft_quant=scheme, group_size=32,
        max_seq_len=MAX_SEQ_LEN, max_chunk=CHUNK, k=K,
    )  # fmt: skip
    assert settings["functions"] == {"prefill": CHUNK, "verify": K + 1, "decode": 1}
    assert settings.get("reads_target_cache", False) == (attention == "target_cache")
    return path, methods


def mil_ops(spec, function: str) -> list:
    return list(spec.mlProgram.functions[function].block_specializations["CoreML8"].operations)


@pytest.mark.parametrize(
    "scheme, attention",
    [(scheme, "target_cache") for scheme in SCHEMES] + [("int4", "none")],
)
def test_package_structure(scheme, attention):
    import coremltools as ct

    path, methods = package(scheme, attention)
    spec = ct.utils.load_spec(str(path))
    assert spec.specificationVersion >= 9  # iOS 18 / macOS 15: states, per-block int4
    functions = {f.name: f for f in spec.description.functions}
    assert set(functions) == {"prefill", "verify", "decode", "draft_step"}
    assert spec.description.defaultFunctionName == "decode"
    states = [f"{kv}_cache_{i}" for i in range(2) for kv in ("k", "v")]
    for name, width in widths(CHUNK, K).items():
        f = functions[name]
        assert [i.name for i in f.input] == ["tokens", "input_pos"]
        assert list(f.input[0].type.multiArrayType.shape) == [1, width]  # static shapes
        assert [o.name for o in f.output] == ["logits", "hidden"]
        assert [s.name for s in f.state] == states
        shape = list(f.state[0].type.stateType.arrayType.shape)
        assert shape == [1, 2, MAX_SEQ_LEN, 8]
        ops = collections.Counter(op.type for op in mil_ops(spec, name))
        assert ops["read_state"] >= 4 and ops["write_state"] == 4 and ops["slice_update"] == 4
        assert methods[name]["states"][0]["name"] == "k_cache_0"
    draft = functions["draft_step"]
    assert [o.name for o in draft.output] == ["draft_logits", "next_h"]
    assert list(draft.input[0].type.multiArrayType.shape) == [1, 32]
    if attention == "target_cache":
        # The target's cache states (one MLState for every function); it writes the last layer's.
        assert [i.name for i in draft.input] == ["h", "token", "input_pos"]
        assert [s.name for s in draft.state] == states
        assert list(draft.state[0].type.stateType.arrayType.shape) == [1, 2, MAX_SEQ_LEN, 8]
        assert [s["name"] for s in methods["draft_step"]["states"]] == states
        ops = mil_ops(spec, "draft_step")
        writes = [op for op in ops if op.type == "write_state"]
        assert [op.inputs["input"].arguments[0].name for op in writes] == ["k_cache_1", "v_cache_1"]
        counts = collections.Counter(op.type for op in ops)
        assert counts["slice_update"] == 2 and counts["scaled_dot_product_attention"] == 1
    else:
        assert [i.name for i in draft.input] == ["h", "token"]
        assert not draft.state and "states" not in methods["draft_step"]
    # Quantized weights: the iOS 18 constexpr op that dequantizes (per block or per channel),
    # one per linear layer and one for the embedding table.
    for name in ("decode", "draft_step"):
        dequant = [op for op in mil_ops(spec, name) if op.type == "constexpr_blockwise_shift_scale"]
        linears = [op for op in mil_ops(spec, name) if op.type == "linear"]
        if SCHEMES[scheme] is None:
            assert not dequant
        else:
            assert len(dequant) == len(linears) + 1 and linears
            data = dequant[0].inputs["data"].arguments[0]  # the packed weights, inline
            dtype = data.value.type.tensorType.dataType
            assert ct.proto.MIL_pb2.DataType.Name(dtype).lower() == SCHEMES[scheme]


def test_tied_lm_head_quantizes(tmp_path):
    """A tied head and the embedding gather read one weight: quantized once, for both."""
    import coremltools as ct

    model = tiny_model(seed=3, vocab=VOCAB, dtype=torch.float32, tie_word_embeddings=True)
    path = tmp_path / "tied.mlpackage"
    export_package(
        model, None, path, quant="int4", draft_quant="int4", group_size=32,
        max_seq_len=MAX_SEQ_LEN, max_chunk=CHUNK, k=K,
    )  # fmt: skip
    spec = ct.utils.load_spec(str(path))
    ops = collections.Counter(op.type for op in mil_ops(spec, "verify"))
    assert ops["constexpr_blockwise_shift_scale"] == ops["linear"] == 2 * 7 + 1


def test_target_functions_share_their_weights():
    """save_multifunction stores the target's weights once for prefill, verify and decode."""
    path, _ = package("fp16", "target_cache")  # the cache's key: the same call as above
    model = target()
    target_bytes = 2 * sum(p.numel() for p in model.parameters())
    weights = sum(f.stat().st_size for f in path.rglob("weight.bin"))
    assert target_bytes < weights < 2 * target_bytes


def torch_program_session(model, head, modules=None):
    """The exact modules handed to the converter, behind the Core ML session's dispatch (and the
    drafter on their draft step, which for a head that reads the target's cache runs on the
    target functions' cache tensors, as the Core ML function runs on their state)."""
    if modules is None:
        modules = programs(model, head, max_seq_len=MAX_SEQ_LEN, max_chunk=CHUNK, k=K)
    position_input = head.reads_target_cache

    @torch.no_grad()
    def call(function, tokens, start):
        ids = torch.tensor([tokens], dtype=torch.int32)
        logits, hidden = modules[function](ids, torch.tensor([start], dtype=torch.int32))
        return logits[0].float(), hidden[0].float()

    @torch.no_grad()
    def step(h, token, position):
        inputs = [h.float(), token.to(torch.int32)]
        if position_input:
            inputs.append(torch.tensor([position], dtype=torch.int32))
        logits, g = modules["draft_step"](*inputs)
        return logits.float(), g.float()

    session = FixedWidthSession(call, widths(CHUNK, K), MAX_SEQ_LEN, VOCAB, hidden=True)
    cache_len = (lambda: MAX_SEQ_LEN) if position_input else None
    return session, MtpDrafter(step, head.draft_ids, VOCAB, cache_len=cache_len)


def test_converted_program_gives_eager_tokens_with_speculation():
    model = target()
    heads = {kind: head_for(model, kind) for kind in ("target_cache", "none")}
    eager = EagerSession(model, MAX_SEQ_LEN, CHUNK)
    # Up to the cache's end: the last drafts stop there, and calls there go one token at a time.
    config = GenerationConfig(max_new_tokens=MAX_SEQ_LEN, k=K)
    plain = generate(eager, PROMPT, None, config)
    assert plain.stop_reason == "context_full"
    expected = plain.token_ids
    for drafter in (None, "ngram", "target_cache", "none"):
        head = heads.get(drafter, heads["target_cache"])
        program, mtp = torch_program_session(model, head)  # a fresh cache each run
        draft = {None: None, "ngram": NgramDrafter()}.get(drafter, mtp)
        result = generate(program, PROMPT, draft, config)
        assert result.token_ids == expected, drafter
        if drafter:
            assert result.stats.drafted_tokens > 0


def test_draft_program_computes_the_eager_step_on_the_shared_cache():
    """The draft step handed to the converter, on the target programs' cache, against the eager
    head on the eager target's cache: the same logits (to fp16 rounding) and the same argmax
    over a few recurrent steps; its K/V land at the drafted slots of the last layer only."""
    model = target()
    head = head_for(model)
    modules = programs(model, head, max_seq_len=MAX_SEQ_LEN, max_chunk=CHUNK, k=K)
    program, _ = torch_program_session(model, head, modules)
    eager = EagerSession(model, MAX_SEQ_LEN, CHUNK)
    program.forward(PROMPT[:CHUNK], 0)
    hidden = program.forward(PROMPT[CHUNK:], CHUNK, return_hidden=True).hidden
    eager.forward(PROMPT, 0)
    caches = [modules["decode"].get_buffer(f"{kv}_cache_{i}") for i in (0, 1) for kv in "kv"]
    before = [c.clone() for c in caches]
    eager_step = eager_step_fn(head, model)
    h_program = h_eager = hidden[-1:]
    token, start = torch.tensor([PROMPT[-1]]), len(PROMPT)
    for i in range(K):
        position = torch.tensor([start + i], dtype=torch.int32)
        with torch.no_grad():
            logits, h_program = modules["draft_step"](h_program.float(), token.int(), position)
        reference, h_eager = eager_step(h_eager, token, start + i)
        torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.02)
        assert int(logits.argmax()) == int(reference.argmax())
        token = head.draft_ids[reference.argmax(-1)]
    assert all(map(torch.equal, caches[:2], before[:2]))  # layer 0: untouched
    written = slice(start, start + K)
    for a, b, kv in zip(caches[2:], before[2:], "kv", strict=True):
        assert torch.equal(a[:, :, :start], b[:, :, :start])  # the verified context: untouched
        assert not torch.equal(a[:, :, written], b[:, :, written])  # the drafted slots
        eager_cache = getattr(model.layers[-1].self_attn.cache, kv)
        torch.testing.assert_close(
            a[:, :, written].float(), eager_cache[:, :, written], atol=5e-3, rtol=2e-2
        )  # fp16 rounding


def test_dispatch_pads_to_the_narrowest_function_and_respects_the_cache_end():
    calls = []

    def call(function, tokens, start):
        calls.append((function, len(tokens), start))
        return torch.zeros(len(tokens), VOCAB), None

    session = FixedWidthSession(call, widths(CHUNK, K), MAX_SEQ_LEN, VOCAB, hidden=False)
    assert session.forward([1, 2, 3], 10).logits.shape == (3, VOCAB)
    assert session.forward([1], 13).logits.shape == (1, VOCAB)
    assert session.forward(list(range(9)), 14).logits.shape == (9, VOCAB)
    session.forward([1, 2, 3], MAX_SEQ_LEN - 3)  # a padded verify would write past the cache
    assert calls == [("verify", 5, 10), ("decode", 1, 13), ("prefill", 16, 14)] + [
        ("decode", 1, MAX_SEQ_LEN - 3 + i) for i in range(3)
    ]
    with pytest.raises(UserError, match="hidden states"):
        session.forward([1], 0, return_hidden=True)


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir  # conftest.py's, shared


@linux_only
def test_bundle_and_the_linux_refusal(model_dir, tmp_path):
    out = tmp_path / "coreml"
    args = ["--target", "coreml", "--model", str(model_dir), "--out", str(out)]
    result = CliRunner().invoke(export, [*args, "--max-seq-len", "96", "--quant", "int8"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["quality"]["perplexity_fp32"] > 0  # exported: Mac only
    manifest = Manifest.load(out)  # the package directory's hash checks out
    assert (manifest.platform, manifest.backend) == ("coreml", "coreml")
    assert manifest.models["target"].file == "model.mlpackage"
    assert set(manifest.models["target"].methods) == {"prefill", "verify", "decode"}
    assert manifest.drafter == DrafterSpec(
        kind="ngram", k=4, functions={"prefill": 96, "verify": 5, "decode": 1}
    )  # fmt: skip
    line = error_line(CliRunner().invoke(run, ["--bundle", str(out), "--prompt", "x"]))
    assert "Core ML runs only on Apple platforms" in line


@linux_only
def test_bundle_with_heads_that_read_the_target_cache(model_dir, tmp_path):
    """mtp-export --target coreml with such heads: the draft step is a function of the package
    on the target functions' cache state, and no drafter file of its own ships."""
    heads = save_random_heads(model_dir, tmp_path / "heads.safetensors", "target_cache")
    out = tmp_path / "coreml"
    args = ["--target", "coreml", "--model", str(model_dir), "--out", str(out)]
    args += ["--max-seq-len", "96", "--drafter", "mtp", "--heads", str(heads)]
    result = CliRunner().invoke(export, [*args, "--quality-tokens", "0"])
    assert result.exit_code == 0, result.output
    manifest = Manifest.load(out)
    assert set(manifest.models) == {"target", "drafter_vocab", "tokenizer", "tokenizer_meta"}
    assert manifest.drafter.kind == "mtp" and manifest.drafter.reads_target_cache is True
    assert manifest.drafter.method is None  # an ExecuTorch method name; Core ML: draft_step
    methods = manifest.models["target"].methods
    assert [i["name"] for i in methods["draft_step"]["inputs"]] == ["h", "token", "input_pos"]
    assert methods["draft_step"]["states"] == methods["decode"]["states"]
    line = error_line(CliRunner().invoke(run, ["--bundle", str(out), "--prompt", "x"]))
    assert "Core ML runs only on Apple platforms" in line


def test_coreml_options_are_checked(model_dir, tmp_path):
    args = ["--target", "coreml", "--model", str(model_dir), "--out", str(tmp_path / "b")]
    assert "int4, int8, fp16" in error_line(CliRunner().invoke(export, [*args, "--quant", "fp32"]))
    draft = save_hf_dir(hf_reference("llama", seed=4), tmp_path / "draft")
    line = error_line(CliRunner().invoke(export, [*args, "--drafter", str(draft)]))
    assert "--target coreml" in line and "mtp or ngram" in line
    assert not (tmp_path / "b").exists()
