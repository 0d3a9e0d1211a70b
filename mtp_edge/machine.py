"""What this machine's CPU computes at best: the int8 path its cores have (a dot-product
instruction or not) and the int8 and fp32 matmul throughput XNNPACK reaches on it, the figures
mtp-devices records for the host, mtp-predict scales the catalog's peaks by, and mtp-train's
report sets its writing and labelling rates against."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from mtp_edge.errors import UserError


@dataclass(frozen=True)
class Int8Path:
    """How a CPU multiplies 8-bit integers, and what XNNPACK's 8-bit GEMM does with it."""

    name: str  # avx512-vnni | avx-vnni | avx512 | avx2 | sse4 | sme | i8mm | neon-dot | neon | ...
    dot_product: bool  # a multiply-accumulate of int8 pairs into int32 in one instruction
    instruction: str
    # Rows of the tile of XNNPACK's per-channel 8-bit GEMM on this path (its gemm config's mr):
    # a call of up to this many rows reads the weights once; one more row starts a second pass.
    xnnpack_rows: int | None
    # The same for XNNPACK's 4-bit GEMM with weights in groups (qd8_f32_qb4w; None: not known):
    # 3 rows on AVX2 (benchmarks/README.md, "CPUs without an int8 dot product").
    blockwise_rows: int | None = None


INT8_PATHS = {
    path.name: path
    for path in (
        Int8Path("avx512-vnni", True, "VPDPBUSD on 512-bit vectors (AVX512-VNNI)", 5),
        Int8Path("avx-vnni", True, "VPDPBUSD on 256-bit vectors (AVX-VNNI)", 5),
        Int8Path("avx512", False, "VPMADDWD on 512-bit vectors, no int8 dot product", 8),
        Int8Path(
            "avx2",
            False,
            "VPMADDWD on 256-bit vectors after widening the weights to 16 bits, no int8 dot "
            "product",
            4,
            3,
        ),
        Int8Path("sse4", False, "PMADDWD on 128-bit vectors, no int8 dot product", 4),
        Int8Path("sme", True, "SME outer products; XNNPACK's 8-bit GEMM runs SMMLA (i8mm)", 4),
        Int8Path("i8mm", True, "SMMLA 2x8x2 int8 matrix multiply-accumulate (FEAT_I8MM)", 4),
        Int8Path("neon-dot", True, "SDOT 4-way int8 dot product (FEAT_DotProd)", 4),
        Int8Path("neon", False, "SMLAL widening multiply-adds, no int8 dot product", None),
        Int8Path("unknown", False, "not recognised from the CPU's flags", None),
    )
}


# Names this CPU's int8 path instead of reading it from the CPU's flags (a VM that hides them;
# the tests, which must not depend on the CPU they run on). The native runtime reads it too.
INT8_PATH_ENV = "MTP_EDGE_INT8_PATH"


def int8_path(cpuinfo: str | None = None) -> Int8Path:
    """The int8 path of this CPU (or of a /proc/cpuinfo text): the best of VNNI, AVX-512,
    AVX2 and SSE4 from an x86 `flags` line; SME, i8mm, dot product and NEON from an ARM
    `Features` line. Without /proc/cpuinfo (macOS), sysctl's hw.optional.arm.FEAT_* keys.
    For this CPU, MTP_EDGE_INT8_PATH (one of INT8_PATHS' names) overrides the flags."""
    if cpuinfo is None and os.environ.get(INT8_PATH_ENV):
        name = os.environ[INT8_PATH_ENV]
        if name not in INT8_PATHS:
            raise UserError(
                f"{INT8_PATH_ENV}={name} is not an int8 path: use one of {', '.join(INT8_PATHS)}"
                f", or unset it to read the CPU's flags"
            )
        return INT8_PATHS[name]
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return _darwin_int8_path()
    flags = cpu_flags(cpuinfo)
    for name, needs in (
        ("avx512-vnni", ("avx512_vnni",)),
        ("avx-vnni", ("avx_vnni",)),
        ("avx512", ("avx512f", "avx512bw")),
        ("avx2", ("avx2",)),
        ("sse4", ("sse4_1",)),
        ("sme", ("sme", "i8mm")),
        ("i8mm", ("i8mm",)),
        ("neon-dot", ("asimddp",)),
        ("neon", ("asimd",)),
    ):
        if all(flag in flags for flag in needs):
            return INT8_PATHS[name]
    return INT8_PATHS["unknown"]


def cpu_flags(cpuinfo: str) -> set[str]:
    """The CPU's feature flags in a /proc/cpuinfo text: x86's `flags`, ARM's `Features`."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags |= set(value.lower().split())
    return flags


def _darwin_int8_path() -> Int8Path:
    def has(feature: str) -> bool:
        try:
            out = subprocess.run(
                ["sysctl", "-n", f"hw.optional.arm.{feature}"],
                capture_output=True,
                text=True,
                timeout=5,
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return out.stdout.strip() == "1"

    if platform.machine().lower() not in ("arm64", "aarch64"):
        return INT8_PATHS["unknown"]
    for name, feature in (("sme", "FEAT_SME"), ("i8mm", "FEAT_I8MM"), ("neon-dot", "FEAT_DotProd")):
        if has(feature):
            return INT8_PATHS[name]
    return INT8_PATHS["neon"]


@dataclass(frozen=True)
class MatmulRates:
    int8_gops: float
    fp32_gflops: float
    how: str  # which kernels were timed, for the figures' sources


# The probe: one linear layer of this size, its weights in the cores' caches, called on this many
# rows (several passes of any path's tile), so arithmetic and not memory sets its time.
PROBE_IN, PROBE_OUT, PROBE_ROWS = 1024, 1024, 32


def measure_matmul_rates(runs: int = 7) -> MatmulRates:
    """int8 and fp32 matmul throughput as the bundles compute it: XNNPACK's 8-bit dynamically
    quantized GEMM (8da8w, per-channel weights) and its float GEMM, each one linear layer in an
    ExecuTorch program, timed with ExecuTorch's thread pool (the cores decoding uses). Without
    ExecuTorch, torch's matmuls (whose int8 path on x86 is a reference loop, far below the
    hardware's rate)."""
    try:
        int8 = _xnnpack_gops("8da8w", runs)
        fp32 = _xnnpack_gops("fp32", runs)
    except ImportError:
        int8, fp32 = _torch_matmul_gops(runs=runs)
        return MatmulRates(int8, fp32, "torch._int_mm and torch.mm, 1024^3 (no ExecuTorch)")
    how = (
        f"XNNPACK linear {PROBE_IN}x{PROBE_OUT} in an ExecuTorch program (int8: 8da8w per "
        f"channel; fp32: float weights), {PROBE_ROWS} rows, weights in cache"
    )
    return MatmulRates(int8, fp32, how)


def measure_matmul_gops(n: int = 1024, runs: int = 5) -> tuple[float, float]:
    """(int8 Gop/s, fp32 GFLOP/s): `measure_matmul_rates` without the description."""
    rates = measure_matmul_rates(runs=runs)
    return rates.int8_gops, rates.fp32_gflops


def _probe_program(scheme: str) -> Path:
    """The probe's .pte, lowered once per ExecuTorch version and kept in the user's cache."""
    import executorch
    import torch
    from torch import nn

    version = getattr(executorch, "__version__", "unknown")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "mtp-edge" / "probes" / version / f"linear_{scheme}_{PROBE_IN}.pte"
    if path.exists():
        return path
    # Lowered here with ExecuTorch's and torchao's own calls (this module is the ground the
    # exporter stands on): the same XNNPACK partitioner and 8-bit dynamic-activation recipe as
    # an 8da8w bundle's linears.
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(PROBE_IN, PROBE_OUT, bias=False)).eval()
    if scheme != "fp32":
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerAxis

        config = Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=PerAxis(0)
        )
        quantize_(layer, config)
    example = (torch.randn(1, 2, PROBE_IN),)
    dynamic = ({1: torch.export.Dim("T", min=1, max=PROBE_ROWS)},)
    with torch.no_grad():
        exported = torch.export.export(layer, example, dynamic_shapes=dynamic, strict=True)
        edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
        buffer = edge.to_executorch().buffer
    from mtp_edge.files import write_atomic

    write_atomic(path, buffer)  # a unique temporary name: two processes may probe at once
    return path


def _xnnpack_gops(scheme: str, runs: int) -> float:
    import torch
    from executorch.runtime import Runtime

    hand_cores_to_executorch()
    method = Runtime.get().load_program(_probe_program(scheme)).load_method("forward")
    x = torch.randn(1, PROBE_ROWS, PROBE_IN)
    for _ in range(3):
        method.execute([x])
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(10):
            method.execute([x])
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * PROBE_IN * PROBE_OUT * PROBE_ROWS / best / 1e9


def _torch_matmul_gops(n: int = 1024, runs: int = 5) -> tuple[float, float]:
    import torch

    best = {}
    ints = [torch.randint(-64, 64, (n, n), dtype=torch.int8) for _ in range(2)]
    floats = [torch.randn(n, n) for _ in range(2)]
    for name, f, (a, b) in (("int8", torch._int_mm, ints), ("fp32", torch.mm, floats)):
        f(a, b)  # warm up
        t_best = float("inf")
        for _ in range(runs):
            t = time.perf_counter()
            f(a, b)
            t_best = min(t_best, time.perf_counter() - t)
        best[name] = 2 * n**3 / t_best / 1e9
    return best["int8"], best["fp32"]


# verify(k+1) / decode above which a verification visibly costs more than the weight read it
# shares with a step (the verification goal of benchmarks/README.md)
VERIFY_GOAL = 1.3


def int8_bottleneck_note(verify_over_decode: float, path: Int8Path | None = None) -> str | None:
    """One line for a bench report when this CPU's int8 arithmetic, not memory, sets what a
    verification costs: no int8 dot product, and verify/decode above the goal."""
    path = path or int8_path()
    if path.dot_product or path.name == "unknown" or verify_over_decode <= VERIFY_GOAL:
        return None
    return (
        f"Note: this CPU's int8 path is the bottleneck: {path.name} has no int8 dot product "
        f"({path.instruction}), so a verification cost {verify_over_decode:.2f} decoding steps "
        "where the weight read it shares with a step would keep it near 1.1 (benchmarks/"
        "README.md, \"CPUs without an int8 dot product\")."
    )


# Who gets this machine's cores: the backends' pools, not torch's.
_backend_threads: int | None = None


def claim_cores() -> int:
    """The thread count a backend's own pool (XNNPACK's, ONNX Runtime's) gets: torch's as the
    process set it, read once per process; from then on torch keeps one thread, whose small ops
    in the loop would otherwise wake an OpenMP team that spins on the backend's cores. Every
    backend asks here, so a second backend in the same process (`mtp-bench --compare`) gets the
    same count, not the single thread torch was left with."""
    import torch

    global _backend_threads
    if _backend_threads is None:
        _backend_threads = torch.get_num_threads()
        torch.set_num_threads(1)
    return _backend_threads


_executorch_threads: int | None = None


def hand_cores_to_executorch() -> None:
    """Give ExecuTorch's thread pool torch's thread count, and leave torch one thread.

    Done once, before the first program loads: resizing the pool under a loaded program
    crashes. Torch and MKL keep one thread because their threads compete with ExecuTorch's for
    the same cores (measured with SmolLM2-135M on 2 cores):
    - the loop's small torch ops (argmax and top-2 over the vocabulary) wake torch's OpenMP
      team, whose threads then spin a while and take the cores from ExecuTorch's pool: plain
      decoding fell from ~140 to ~42 tokens/s;
    - ExecuTorch's SDPA kernel calls the BLAS `sgemm_`, which in a process that has loaded
      torch is torch's MKL; MKL then starts an OpenMP team inside each of ExecuTorch's pool
      threads, and a 5-token verify took 24 ms instead of 5. `torch.set_num_threads` limits
      MKL only on the calling thread, so MKL's process-wide count is set as well.
    """
    import ctypes

    import torch
    from executorch.extension.pybindings import portable_lib

    global _executorch_threads
    if _executorch_threads is not None:
        return

    _executorch_threads = claim_cores()
    if portable_lib._threadpool_get_thread_count() != _executorch_threads:
        portable_lib._unsafe_reset_threadpool(_executorch_threads)
    try:
        mkl = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        mkl.mkl_serv_set_num_threads(1)
    except (OSError, AttributeError):
        pass  # a torch without MKL (macOS, Arm): no BLAS threads to limit


def executorch_threads() -> int | None:
    """The thread count ExecuTorch's pool was given in this process (None before any)."""
    return _executorch_threads
