"""The platforms a bundle is made for, in one table: everything that differs between them.

`mtp-export --target NAME` picks a row. The exporter imports the row's `exporter` module, the
runtime the row's `session` module (both by name, on first use: each pulls in its own
toolchain); the CLI takes its choices, the quantizer its schemes and defaults, the manifest its
`platform` and `backend`, the benchmark harness and mtp-predict their hooks from here. Nothing
else compares a platform's or a backend's name. A new platform is a row here and its two
modules (exporter/NAME.py: `check` and `export`, exporter/platform.py; runtime/NAME_session.py:
runtime/backends.py).

Ground layer: this module imports no torch (the CLI reads it for --help).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mtp_edge.errors import UserError
from mtp_edge.memory import export_forecast


@dataclass(frozen=True)
class Platform:
    name: str  # `mtp-export --target NAME`; the manifest's "platform"
    summary: str  # what it writes, for --help
    backend: str  # the runtime backend that runs its bundles: the manifest's "backend"
    exporter: str  # the module with its check(job) and export(job, dir) (exporter/platform.py)
    session: str  # the runtime module with its sessions (runtime/backends.py)
    schemes: tuple[str, ...]  # what --quant / --draft-quant take
    default_scheme: str  # --quant when not given ...
    why_default: str  # ... and why, said when --quant is not given
    # Schemes whose --group-size is a block size (a power of two >= 16; default 32). Without a
    # --group-size the others get 32 if they are 4-bit (quantize.schemes.default_group_size).
    blockwise: tuple[str, ...] = ()
    # What the export imports beyond the required dependencies, and the pip extra bringing it.
    export_needs: tuple[tuple[str, ...], str] = ((), "")
    # What the backend imports beyond the required dependencies, and the pip extra bringing it.
    run_needs: tuple[tuple[str, ...], str] = ((), "")
    # Hooks, each off unless declared:
    # - the exporter module has `load_hook(options, skeleton, draft=False)`, which quantizes each
    #   part of a model as it is read; such a platform loads and lowers in a child process
    #   (exporter/lowering_parent.py), so that what lowering leaves allocated dies with it;
    load_hook: bool = False
    # - the export's peak memory, said before the slow part (mtp_edge/memory.py):
    #   (config, quant, group_size, embedding_quant, max_seq_len) -> (peak, program, cache) GB;
    memory_forecast: Callable | None = None
    # - the session module's function giving the threads it decodes with (mtp-bench's report;
    #   None: torch's count);
    threads: str | None = None
    # - mtp-bench also decodes the target program with ExecuTorch's TextLLMRunner (devices/peer);
    textllmrunner_peer: bool = False
    # - mtp-predict reads the shapes of its programs (devices/cost.py);
    predictable: bool = False
    # - its MTP head is always a function of the target's file, never a drafter file of its own
    #   (what the runtime expects the manifest to name, runtime/bundle.py).
    head_in_target: bool = False
    # - its programs are exported for one verification width, k+1 (mtp-export --quant auto then
    #   measures no other k: each would be an export of its own).
    verify_width_in_program: bool = False
    # - schemes whose verification runs XNNPACK's per-channel 8-bit GEMM: on a CPU without an
    #   int8 dot product, whose tile has few rows (mtp_edge/machine.py: 4 on AVX2), k + 1
    #   rows past the tile take a second pass over the weights, so the runtime keeps k + 1
    #   within it unless k is given (runtime/assemble.py k_for_this_cpu).
    int8_tile_schemes: tuple[str, ...] = ()
    # - schemes whose 4-bit layers run XNNPACK's 4-bit GEMM: in groups its tile (Int8Path
    #   blockwise_rows: 3 rows on AVX2) bounds a verification, per channel the 8-bit one's.
    int4_tile_schemes: tuple[str, ...] = ()


PLATFORMS: dict[str, Platform] = {}

# android's scheme whose linear layers run our int8 kernel (mtp_edge::linear_i8, mtp_edge/ops.py):
# 8da8w's numbers, 6 rows per pass over the weights on every CPU (ops.LINEAR_I8_ROWS), for CPUs
# without an int8 dot product, where XNNPACK's int8 GEMM takes 4.
OWN_INT8 = "8da8w-avx2"
# android's mixed scheme: 8da4w's 4-bit layers (groups of 32) with each layer's k and v
# projections and the LM head in 8da8w per channel, the tensors 4-bit rounding hurts most (as
# llama.cpp's Q4_K_M keeps attn_v in more bits): on Qwen2.5-Coder-0.5B x1.00 perplexity against
# 8da4w's x1.05, nearly 8da4w's size (quantize/schemes.py; benchmarks/README.md).
MIXED_4BIT = "8da4w-mix"
# 8da4w-mix in our kernels: its 4-bit layers in mtp_edge::linear_i4 (groups of 32, float16
# scales), k and v in mtp_edge::linear_i8, and the LM head in 6 bits (mtp_edge::linear_i6, as
# Q4_K_M keeps its output tensor: 4-6% faster a token at 0.5-1.5B on AVX2 than an 8-bit head,
# perplexity x1.0035 against x1.0015 on Qwen2.5-Coder-0.5B); 6 rows per pass over the weights on
# every CPU, where XNNPACK's groupwise 4-bit GEMM takes 3 on AVX2.
OWN_MIXED_4BIT = "8da4w-mix-avx2"
# Schemes whose every linear layer runs a kernel of ours (6 rows per pass, ops.LINEAR_I8_ROWS).
OWN_KERNEL_SCHEMES = (OWN_INT8, OWN_MIXED_4BIT)
# An LM head's own scheme (mtp-export --head-quant; 8da4w-mix-avx2's head): 6-bit weights in
# groups of 32, in our kernel mtp_edge::linear_i6 (quantize/schemes.py).
OWN_6BIT_HEAD = "8da6w-avx2"
# LM head schemes whose kernel is ours, beside any scheme's layers.
OWN_KERNEL_HEADS = (OWN_6BIT_HEAD, OWN_INT8)


def register(platform: Platform) -> Platform:
    """Add a row (the rows below; a test adds one of its own)."""
    if platform.default_scheme not in platform.schemes:
        raise ValueError(f"{platform.name}: default {platform.default_scheme} not in its schemes")
    PLATFORMS[platform.name] = platform
    return platform


register(
    Platform(
        name="android",
        summary="ExecuTorch .pte, XNNPACK",
        backend="executorch",
        exporter="mtp_edge.exporter.executorch",
        session="mtp_edge.runtime.executorch_session",
        # Every scheme XNNPACK lowers correctly (quantize/schemes.py says why not int8/int4), and
        # 8da8w in our own kernel (its tile takes 6 rows: for CPUs without an int8 dot product),
        # and 4-bit layers with their most sensitive tensors in 8 bits (MIXED_4BIT), also in
        # our kernels (OWN_MIXED_4BIT).
        schemes=("8da4w", MIXED_4BIT, "8da8w", OWN_INT8, OWN_MIXED_4BIT, "fp32"),
        # Measured (benchmarks/README.md, "Weight scheme by model size"): the held-out
        # perplexity against float32. On SmolLM2-135M 4-bit weights cost 1.59x perplexity (g32)
        # and 3.4x (per channel) against 1.01x, and cut MTP acceptance so much that speculation
        # stopped paying; 8da8w decodes slower (4.5 vs 3.4 ms a step) but speculates faster.
        default_scheme="8da8w",
        why_default="8da8w per channel: within +3% perplexity of fp32 at every size measured "
        "(135M x1.00, 0.5B x1.00), where 4-bit weights lost 5-9% in groups (0.5B; 1.5B: 6.7%) "
        "and 37% per channel (0.5B), and its verification costs 1.16x a decode from memory "
        "against 1.5x for 4-bit groups; --quant 8da4w halves the program",
        load_hook=True,
        memory_forecast=export_forecast,
        threads="executorch_threads",
        textllmrunner_peer=True,
        predictable=True,
        int8_tile_schemes=("8da8w",),
        int4_tile_schemes=("8da4w", MIXED_4BIT),
    )
)
register(
    Platform(
        name="onnx",
        summary="ONNX Runtime",
        backend="onnxruntime",
        exporter="mtp_edge.exporter.onnx",
        session="mtp_edge.runtime.onnx_session",
        # int4 / int8: onnxruntime's MatMulNBits (blockwise weights, fp32 activations).
        schemes=("int4", "int8", "fp32"),
        default_scheme="int4",
        why_default="int4 MatMulNBits in blocks of 32: int8 weights decoded no faster on "
        "onnxruntime's kernels (benchmarks/README.md), and int4 reads half the bytes",
        blockwise=("int4", "int8"),
        export_needs=(("onnx", "onnxruntime", "onnxscript"), "onnx"),
        run_needs=(("onnxruntime",), "onnx"),
    )
)
register(
    Platform(
        name="coreml",
        summary=".mlpackage",
        backend="coreml",
        exporter="mtp_edge.exporter.coreml",
        # Apple platforms only: the module says so on Linux before it imports coremltools.
        session="mtp_edge.runtime.coreml_session",
        # int4 per block, int8 per channel, or fp16 weights; Core ML computes in fp16 whatever
        # the weights.
        schemes=("int4", "int8", "fp16"),
        default_scheme="int4",
        why_default="int4 in blocks of 32: the smallest program (84 MB against 147 MB int8 "
        "and 289 MB fp16 for SmolLM2-135M, benchmarks/README.md)",
        blockwise=("int4",),
        export_needs=(("coremltools",), "coreml"),
        head_in_target=True,
        verify_width_in_program=True,
    )
)


def platform(name: str) -> Platform:
    """The row of `mtp-export --target NAME`; one line naming the choices when there is none."""
    if name not in PLATFORMS:
        raise UserError(f"unknown target '{name}': choose one of {', '.join(PLATFORMS)}")
    return PLATFORMS[name]


def by_backend(backend: str) -> Platform | None:
    """The row whose bundles `backend` (a manifest's "backend") runs; None for an unknown one."""
    return next((p for p in PLATFORMS.values() if p.backend == backend), None)


def every_scheme() -> tuple[str, ...]:
    """Every --quant of every platform, in the table's order."""
    return tuple(dict.fromkeys(s for p in PLATFORMS.values() for s in p.schemes))
