"""The ExecuTorch export and session on tiny models: every scheme lowers and runs, fp32 matches
eager exactly, quantized programs are lossless for speculative decoding on the backend, rollback
by overwrite gives fresh results, and the metadata methods carry the right values."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from tiny import file_lock, run_shared_dir, tiny_model

from mtp_edge.errors import UserError
from mtp_edge.exporter.executorch import export_program, exportable_copy
from mtp_edge.quantize.schemes import QuantScheme
from mtp_edge.runtime.drafters import NgramDrafter
from mtp_edge.runtime.executorch_session import ExecuTorchSession
from mtp_edge.runtime.loop import GenerationConfig, generate
from mtp_edge.runtime.session import EagerSession, prefill

VOCAB, MAX_SEQ_LEN, CHUNK = 64, 96, 16
BOS, EOS = 1, [2, 3]
# Each exported scheme: (linear, group size, embedding, tied LM head).
SCHEMES = {
    "fp32": ("fp32", 0, "none", False),
    "8da4w-g32": ("8da4w", 32, "8w", False),
    "8da4w-cw-tied": ("8da4w", 0, "4w", True),
    "8da4w-mix-tied": ("8da4w-mix", 32, "8w", True),  # 8-bit k, v and (tied) head
    "8da8w-cw": ("8da8w", 0, "8w", False),
    "8da8w-avx2-tied": ("8da8w-avx2", 0, "8w", True),  # our int8 kernel, the tied head's too
    "8da4w-mix-avx2-tied": ("8da4w-mix-avx2", 32, "8w", True),  # our 4-bit and int8 kernels
    "8da4w-mix-avx2-head8-tied": ("8da4w-mix-avx2", 32, "8w", True),  # and an 8-bit head
}
HEADS = {"8da4w-mix-avx2-head8-tied": ("8da8w-avx2", 0)}  # (scheme, group) of an LM head
VERIFY_WIDTH = 5  # the verify method (ExecuTorch kernel programs) checks k + 1 = 5 tokens
PROMPT = [5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9, 13, 7, 5, 9, 13, 21, 30, 5, 9]  # repeats: ngram hits


def model(tied: bool = False, layers: int = 1):
    # Heads of 64 dims, as in real models: custom_sdpa rounds differently for T = 1 and T > 1 at
    # that size (tests below rely on seeing it), not with tiny heads. One layer where a program
    # checks a scheme's arithmetic or our attention kernel (lowering cost grows with the graph;
    # layers' caches apart are checked end to end on the two-layer bundles of conftest.py); two
    # on ExecuTorch's kernel, whose batched rows round apart from one-row calls only after a
    # second layer (on one, they came out bitwise equal).
    return tiny_model(
        seed=3,
        vocab=VOCAB,
        dtype=torch.float32,
        tie_word_embeddings=tied,
        num_layers=layers,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
    )


_PROGRAMS: list = []  # the directory `exported` writes into (programs_in)


def programs_in(factory: pytest.TempPathFactory) -> None:
    """Give `exported` a directory of this run's pytest temporary base (functools.cache cannot
    take fixtures): every module that calls it sets it first; pytest removes it with the rest.
    Every test process of the run (pytest-xdist workers) shares it."""
    if not _PROGRAMS:
        _PROGRAMS.append(run_shared_dir(factory, "et-programs"))


@pytest.fixture(scope="module", autouse=True)
def _programs(tmp_path_factory):
    programs_in(tmp_path_factory)


@functools.cache
def exported(name: str, kernel: str = "mtp"):
    """(path, method metadata) of the tiny model exported with scheme `name` and attention
    kernel `kernel`, once per run: the first test process to need it exports it (the metadata
    beside it as JSON), the others wait for it under a file lock and read it."""
    assert _PROGRAMS, "call programs_in(tmp_path_factory) before exported()"
    linear, group, embedding, tied = SCHEMES[name]
    head, head_group = HEADS.get(name, (None, None))
    path = _PROGRAMS[0] / f"{name}-{kernel}.pte"
    metadata = path.with_suffix(".json")
    with file_lock(path.with_suffix(".lock")):
        if not metadata.exists():
            methods = export_program(
                model(tied, layers=2 if kernel == "executorch" else 1),
                path,
                quant=linear,
                group_size=group,
                embedding_quant=embedding,
                head_quant=head,
                head_group_size=head_group,
                max_seq_len=MAX_SEQ_LEN,
                max_chunk=CHUNK,
                bos_id=BOS,
                eos_ids=EOS,
                # A verify method only where forward is not row-exact, as the exporter does
                # (exporter/executorch.py): on our kernel every width goes through forward.
                verify_width=VERIFY_WIDTH if kernel != "mtp" else 0,
                attention_kernel=kernel,
            )
            metadata.write_text(json.dumps(methods))
    return path, json.loads(metadata.read_text())


def session(name: str, kernel: str = "mtp") -> ExecuTorchSession:
    """A fresh session (its own KV cache) on the program exported with scheme `name`, routing
    calls as a bundle's session does: every width through `forward` on our attention kernel,
    2..16-token calls through `verify` on ExecuTorch's."""
    path = exported(name, kernel)[0]
    return ExecuTorchSession(path, MAX_SEQ_LEN, VOCAB, CHUNK, row_exact_forward=kernel == "mtp")


@pytest.mark.parametrize("name", list(SCHEMES))
def test_each_scheme_runs_what_the_quantized_model_computes(name):
    linear, group, embedding, tied = SCHEMES[name]
    head, head_group = HEADS.get(name, (None, None))
    scheme = QuantScheme(linear, group, embedding, head=head, head_group_size=head_group)
    reference = exportable_copy(model(tied), scheme, MAX_SEQ_LEN)
    program = session(name)
    for tokens, start in ((PROMPT[:CHUNK], 0), (PROMPT[CHUNK:], CHUNK), ([8], len(PROMPT))):
        logits = program.forward(tokens, start).logits
        with torch.no_grad():
            expected = reference(torch.tensor([tokens]), torch.tensor([start]))[0]
        assert logits.shape == (len(tokens), VOCAB) and logits.dtype == torch.float32
        scale = float(expected.abs().max())
        assert float((logits - expected).abs().max()) < 0.05 * scale, name


def test_the_mixed_scheme_keeps_k_v_and_the_head_in_8_bits():
    """8da4w-mix: every layer's k and v projections and the (here tied) LM head get 8-bit
    weights with one scale per channel, every other linear 4-bit weights in groups of 32."""
    from mtp_edge.quantize.schemes import quantize_model

    quantized = quantize_model(model(tied=True, layers=2), QuantScheme("8da4w-mix", 32, "8w"))
    bits = {
        name: (module.weight.target_dtype, module.weight.block_size[1])
        for name, module in quantized.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    assert len(bits) == 2 * 7 + 1
    for name, (dtype, block) in bits.items():
        eight = name == "lm_head" or name.endswith(("k_proj", "v_proj"))
        assert (dtype, block) == ((torch.int8, 128) if eight else (torch.int4, 32)), name


def test_the_mixed_scheme_in_our_kernels_keeps_k_v_in_8_bits_and_the_head_in_6():
    """8da4w-mix-avx2: 8da4w-mix's split in our kernels, Int8Linear for k and v, Int4Linear
    (groups of 32) for every other linear, and the tied head in 6 bits (Int6Linear), as Q4_K_M
    keeps its output tensor; --head-quant 8da8w-avx2 gives it 8 bits and changes nothing else."""
    from mtp_edge.quantize.schemes import Int4Linear, Int6Linear, Int8Linear, quantize_model

    scheme = QuantScheme("8da4w-mix-avx2", 32, "8w")
    quantized = quantize_model(model(tied=True, layers=2), scheme)
    kinds = {
        name: type(module)
        for name, module in quantized.named_modules()
        if isinstance(module, (torch.nn.Linear, Int4Linear, Int8Linear))
    }
    assert len(kinds) == 2 * 7 + 1
    for name, kind in kinds.items():
        want = Int8Linear if name.endswith(("k_proj", "v_proj")) else Int4Linear
        assert kind is (Int6Linear if name == "lm_head" else want), name
    assert scheme.label() == "8da4w-mix-avx2-g32 head 8da6w-avx2-g32 emb 8w-cw"
    eight = QuantScheme("8da4w-mix-avx2", 32, "8w", head="8da8w-avx2", head_group_size=0)
    quantized = quantize_model(model(tied=True, layers=2), eight)
    assert type(quantized.lm_head) is Int8Linear
    assert all(
        type(module) is kinds[name]
        for name, module in quantized.named_modules()
        if name in kinds and name != "lm_head"
    )


def test_fp32_export_matches_eager_tokens_and_logits():
    eager = EagerSession(model(), MAX_SEQ_LEN, CHUNK)
    program = session("fp32")
    config = GenerationConfig(max_new_tokens=40, k=4)
    assert (
        generate(program, PROMPT, None, config).token_ids
        == generate(eager, PROMPT, None, config).token_ids
    )
    # Prefill in chunks, then calls of every verify width at later positions.
    torch.testing.assert_close(
        prefill(program, PROMPT).logits, prefill(eager, PROMPT).logits, atol=1e-4, rtol=0
    )
    start = len(PROMPT)
    for width in (1, 2, 5, CHUNK):
        tokens = [(7 * i + width) % VOCAB for i in range(width)]
        torch.testing.assert_close(
            program.forward(tokens, start).logits,
            eager.forward(tokens, start).logits,
            atol=1e-4,
            rtol=0,
        )
        start += width


def test_qwen_style_attention_exports(tmp_path):
    """Biased q/k/v projections and per-head q/k norms (qwen2 / qwen3) go through the swap."""
    reference = tiny_model(
        seed=5, vocab=VOCAB, dtype=torch.float32, attention_bias=True, qk_norm=True
    )
    path = tmp_path / "qwen.pte"
    export_program(
        reference,
        path,
        quant="fp32",
        group_size=0,
        embedding_quant="none",
        max_seq_len=MAX_SEQ_LEN,
        max_chunk=CHUNK,
        bos_id=None,
        eos_ids=[],
    )
    program = ExecuTorchSession(path, MAX_SEQ_LEN, VOCAB, CHUNK)
    eager = EagerSession(reference, MAX_SEQ_LEN, CHUNK)
    torch.testing.assert_close(
        prefill(program, PROMPT).logits, prefill(eager, PROMPT).logits, atol=1e-4, rtol=0
    )


def test_session_refuses_calls_outside_its_limits():
    program = session("fp32")
    with pytest.raises(ValueError, match="1..16 tokens"):
        program.forward(list(range(CHUNK + 1)), 0)
    with pytest.raises(ValueError, match="exceed the cache"):
        program.forward([1, 2], MAX_SEQ_LEN - 1)
    with pytest.raises(UserError, match="hidden states"):
        program.forward([1], 0, return_hidden=True)


def one_token_steps(program, start: int, tokens: list[int]) -> torch.Tensor:
    return torch.cat([program.forward([t], start + i).logits for i, t in enumerate(tokens)])


@pytest.mark.parametrize(
    "name,kernel", [(name, "mtp") for name in SCHEMES] + [("8da4w-g32", "executorch")]
)
def test_verify_rows_are_bitwise_one_token_steps(name, kernel):
    """What makes speculative decoding exact on a quantized program: every row of a k+1-token
    call equals, bit for bit, a one-token call at that position (widths below, at and above the
    verify width, and at the very end of the cache, where the padding does not fit): with our
    kernel through `forward` at each width, with ExecuTorch's through `verify`'s row-by-row
    calls."""
    tokens = [(11 * i + 3) % VOCAB for i in range(12)]
    steps_session, wide_session = session(name, kernel), session(name, kernel)
    prefill(steps_session, PROMPT * 2)
    steps = one_token_steps(steps_session, 2 * len(PROMPT), tokens)
    prefill(wide_session, PROMPT * 2)
    done = 0
    for width in (2, 5, 3, 2):  # 12 tokens in calls of these widths
        rows = wide_session.forward(tokens[done : done + width], 2 * len(PROMPT) + done).logits
        assert torch.equal(rows, steps[done : done + width])
        done += width
    fresh_steps, fresh_wide = session(name, kernel), session(name, kernel)  # earlier slots empty
    end = MAX_SEQ_LEN - 3
    assert torch.equal(
        fresh_wide.forward(tokens[:3], end).logits, one_token_steps(fresh_steps, end, tokens[:3])
    )


@pytest.mark.parametrize("kernel,row_exact", [("mtp", True), ("executorch", False)])
def test_a_batched_forward_is_row_exact_only_with_our_kernel(kernel, row_exact):
    """The same 5 tokens through `forward` in one call, against one-token calls: with our
    attention kernel (mtp_edge::sdpa) the rows are bitwise equal, so a verification needs no
    more than one call; ExecuTorch's llama.custom_sdpa rounds them differently (if it ever
    becomes row-exact, this fails, and the choice of kernel is worth revisiting)."""
    tokens = [(11 * i + 3) % VOCAB for i in range(5)]
    steps_session, batched_session = session("8da4w-g32", kernel), session("8da4w-g32", kernel)
    prefill(steps_session, PROMPT * 2)
    prefill(batched_session, PROMPT * 2)
    steps = one_token_steps(steps_session, 2 * len(PROMPT), tokens)
    start = torch.tensor([2 * len(PROMPT)])
    batched = batched_session.method.execute([torch.tensor([tokens]), start])[0][0]
    assert torch.equal(batched, steps) == row_exact


def test_our_kernel_computes_the_eager_attention():
    """mtp_edge::sdpa's kernel (C++, as the runtimes run it) against the eager reference, over
    its paths: grouped heads taken together, one head at a time, head sizes with and without a
    compiled-in specialization, a call that ends at the last slot of the cache."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    from mtp_edge import ops
    from mtp_edge.runtime import executorch_ops

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, start):
            return torch.ops.mtp_edge.sdpa(q, k, v, start.item())

    torch.manual_seed(0)
    cases = [  # (query heads, KV heads, head size, rows, start): the kernel's paths
        (9, 3, 64, 5, 7),  # three heads per KV head, taken together (SmolLM2's layout)
        (14, 2, 64, 2, 30),  # seven per KV head: a chunk of four and one of three
        (4, 2, 128, 3, 45),  # two per KV head at head size 128
        (2, 2, 128, 1, 40),  # one query head per KV head
        (3, 1, 32, 1, 40),  # a head size without a compiled-in specialization
        (2, 1, 24, 2, 20),  # not a multiple of 16: the one-float-at-a-time path
    ]
    for heads, kv_heads, dim, t, start in cases:
        q = torch.randn(1, t, heads, dim)
        k, v = torch.randn(1, 48, kv_heads, dim), torch.randn(1, 48, kv_heads, dim)
        position = torch.tensor([start])
        program = to_edge(torch.export.export(Attend(), (q, k, v, position), strict=True))
        executorch_ops.load_kernels()
        loaded = Runtime.get().load_program(program.to_executorch().buffer)
        got = loaded.load_method("forward").execute([q, k, v, position])[0]  # program kept alive
        want = ops.attention(q, k, v, start)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "name",
    [
        "8da4w-g32",
        "8da4w-cw-tied",
        "8da4w-mix-tied",
        "8da8w-cw",
        "8da8w-avx2-tied",
        "8da4w-mix-avx2-tied",
        "8da4w-mix-avx2-head8-tied",
    ],
)
@pytest.mark.parametrize("k", [2, 4, 7])
def test_quantized_speculative_output_equals_its_plain_output(name, k):
    program = session(name)
    config = GenerationConfig(max_new_tokens=48, k=k)
    plain = generate(program, PROMPT, None, config)
    spec = generate(program, PROMPT, NgramDrafter(), config)
    assert spec.stats.drafted_tokens > 0
    assert spec.token_ids == plain.token_ids


def program_plan(path) -> tuple[set[str], int]:
    """(operator names, delegate count) of a .pte's forward method."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(Path(path).read_bytes())
    program = getattr(program, "program", program)
    plan = next(plan for plan in program.execution_plan if plan.name == "forward")
    return {operator.name for operator in plan.operators}, len(plan.delegates)


def test_programs_of_our_linears_need_no_xnnpack():
    """Where every linear is our kernel, the norms, RoPE and SwiGLU are our ops and the program
    has no XNNPACK delegate (a call of fixed cost for a few element-wise ops, ~5 a layer);
    XNNPACK's schemes keep theirs and the stock glue."""
    glue = {"mtp_edge::rms_norm", "mtp_edge::rope", "mtp_edge::swiglu"}
    for name in ("8da8w-avx2-tied", "8da4w-mix-avx2-tied", "8da4w-mix-avx2-head8-tied"):
        operators, delegates = program_plan(exported(name)[0])
        assert glue <= operators and delegates == 0, (name, operators)
    # 8da4w-mix-avx2's 6-bit head is our op; --head-quant 8da8w-avx2 leaves none of it
    assert "mtp_edge::linear_i6" in program_plan(exported("8da4w-mix-avx2-tied")[0])[0]
    operators = program_plan(exported("8da4w-mix-avx2-head8-tied")[0])[0]
    assert "mtp_edge::linear_i6" not in operators and "mtp_edge::linear_i8" in operators
    operators, delegates = program_plan(exported("8da8w-cw")[0])
    assert not glue & operators and delegates > 0


def test_verify_after_rejection_equals_fresh_run():
    used, fresh = session("8da4w-g32"), session("8da4w-g32")
    start = len(PROMPT)
    prefill(used, PROMPT)
    used.forward([4, 50, 51, 52, 53], start)  # a verify whose drafts all get rejected
    accepted = used.forward([4, 8, 12], start).logits  # overwrites their slots
    prefill(fresh, PROMPT)
    torch.testing.assert_close(accepted, fresh.forward([4, 8, 12], start).logits, atol=0, rtol=0)
    assert used.forward([6], start + 3).logits.shape == (1, VOCAB)


def test_metadata_methods():
    from executorch.runtime import Runtime

    path, methods = exported("fp32")
    program = Runtime.get().load_program(path)
    expected = {
        "get_max_seq_len": [CHUNK],  # ExecuTorch's name for the most tokens per call
        "get_max_context_len": [MAX_SEQ_LEN],
        "get_vocab_size": [VOCAB],
        "use_kv_cache": [True],
        "enable_dynamic_shape": [True],
        "get_bos_id": [BOS],
        "get_eos_ids": EOS,
    }
    for name, value in expected.items():
        assert list(program.load_method(name).execute([])) == value, name
        assert methods[name]["value"] in (value, value[0])
    assert methods["forward"]["outputs"][0]["shape"] == [1, "T", VOCAB]


@pytest.mark.parametrize(
    "quant, group, embedding, message",
    [
        (
            "int3",
            32,
            "8w",
            "supported are 8da4w, 8da4w-mix, 8da8w, 8da8w-avx2, 8da4w-mix-avx2, fp32",
        ),
        ("int8", 0, "8w", "use 8da8w"),
        ("int4", 32, "8w", "use 8da4w"),
        ("8da4w", 24, "8w", "does not divide"),
        ("8da4w", -1, "8w", "must be >= 0"),
        ("8da4w-mix", 24, "8w", "does not divide"),
        ("8da8w", 32, "8w", "--group-size 0"),
        ("8da8w-avx2", 32, "8w", "--group-size 0"),
        ("8da4w-mix-avx2", 64, "8w", "takes --group-size 32"),
        ("8da4w", 32, "2w", "embedding quantization"),
    ],
)
def test_bad_scheme_is_a_user_error(tmp_path, quant, group, embedding, message):
    bad_scheme(tmp_path, message, quant=quant, group_size=group, embedding_quant=embedding)


@pytest.mark.parametrize(
    "head, group, message",
    [
        ("8da6w-avx2", 64, "--head-quant 8da6w-avx2 takes group size 32"),
        ("8da8w", 32, "--group-size 0"),
        ("int3", 0, "unknown quantization scheme 'int3'"),
    ],
)
def test_bad_head_scheme_is_a_user_error(tmp_path, head, group, message):
    bad_scheme(
        tmp_path,
        message,
        quant="8da4w-mix-avx2",
        group_size=32,
        embedding_quant="8w",
        head_quant=head,
        head_group_size=group,
    )


def bad_scheme(tmp_path, message: str, **scheme) -> None:
    path = tmp_path / "x.pte"
    with pytest.raises(UserError, match=message):
        export_program(
            model(),
            path,
            **scheme,
            max_seq_len=MAX_SEQ_LEN,
            max_chunk=CHUNK,
            bos_id=BOS,
            eos_ids=EOS,
        )
    assert not path.exists()


def test_kernel_build_without_a_compiler_is_a_user_error(tmp_path, monkeypatch):
    """No g++: one clear line saying what to install, and nothing left at the target path."""
    from mtp_edge.runtime import executorch_ops

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(executorch_ops.shutil, "which", lambda name: None)
    target = tmp_path / "libmtp_ops.so"
    with pytest.raises(UserError, match="no C\\+\\+ compiler found.*install g\\+\\+"):
        executorch_ops.build(target)
    assert not target.exists()


def test_kernel_build_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    """A compiler that fails: the error carries its output, and no library is half-written."""
    from mtp_edge.runtime import executorch_ops

    monkeypatch.setenv("CXX", "false")  # /bin/false: exits 1, writes nothing
    target = tmp_path / "libmtp_ops.so"
    with pytest.raises(UserError, match="building mtp-edge's kernels failed"):
        executorch_ops.build(target)
    assert list(tmp_path.iterdir()) == []
