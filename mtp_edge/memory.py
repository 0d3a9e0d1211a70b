"""Memory of long jobs: each stage's wall time and peak resident memory (the export log), and
an allocator that gives freed weights back to the system.

A loader that reads a layer in float32 and keeps only its quantized form frees tens of MB per
layer. glibc's malloc serves such sizes from the heap once a large block was freed (its mmap
threshold rises to 32 MB) and keeps freed heap memory, so the process's resident memory grows as
if the float weights were still there (measured: +924 MB after loading SmolLM2-135M quantized,
+296 MB with the threshold fixed). `return_freed_memory` fixes the threshold and trims.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc malloc.h)
_MMAP_THRESHOLD_BYTES = 1 << 20


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def return_freed_memory() -> None:
    """Allocate blocks of 1 MB and more by mmap from now on (so freeing them returns them to the
    system), and give back what the heap holds free. No-op where the C library is not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        libc.malloc_trim(0)


class StageClock:
    """Wall time and peak resident memory of each stage of a long job (the export log).

    Linux lets a process reset its recorded peak (writing 5 to /proc/self/clear_refs), so each
    stage's peak is its own; elsewhere the peak is the process's so far ("since_start")."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.started = time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        own_peak = _reset_peak_rss()
        before = rss_mb()
        started = time.perf_counter()
        yield
        row = {"stage": name, "seconds": round(time.perf_counter() - started, 1)}
        row.update(rss_before_mb=before, peak_rss_mb=peak_rss_mb())
        if not own_peak:
            row["peak_since_start"] = True
        self.rows.append(row)

    def add(self, rows: list[dict]) -> None:
        """Stages another process ran for this job (their rows as its clock wrote them; with
        `other_mb`, the memory this process held meanwhile)."""
        self.rows.extend(rows)

    def report(self) -> dict:
        """The whole job: seconds, peak memory (of a stage run in another process: its peak
        plus what this process held meanwhile) and the stages."""
        peaks = [row["peak_rss_mb"] + row.get("other_mb", 0) for row in self.rows]
        return {
            "seconds": round(time.perf_counter() - self.started, 1),
            "peak_rss_mb": max(peaks, default=peak_rss_mb()),
            "stages": list(self.rows),
        }


def rss_mb() -> int | None:
    """This process's resident memory now, in MB (None where /proc is not there)."""
    return _status_mb("VmRSS:")


def peak_rss_mb() -> int:
    """This process's peak resident memory (since the last reset, on Linux), in MB."""
    peak = _status_mb("VmHWM:")
    if peak is not None:
        return peak
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1024))


def private_mb() -> int | None:
    """This process's own memory in MB: resident pages no other process shares (its heap, not
    the libraries a child process maps too). None where /proc has no smaps_rollup."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    kb = sum(
        int(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("Private_Clean:", "Private_Dirty:"))
    )
    return round(kb / 1024)


def _status_mb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return round(int(line.split()[1]) / 1024)
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# --- what an android export will need, before it starts -------------------------------------

# Bits per weight of a program's linear layers for each scheme, before the scales (one 16-bit
# scale per group is added; group 0 = one scale per output channel, negligible), and of its
# embedding table (one scale per row).
# 8da4w-mix: 4-bit layers with an 8-bit LM head and k/v projections, ~5 bits on average at
# 0.5-1.5B (the head is 15-28% of the weights).
WEIGHT_BITS = {
    "8da4w": 4,
    "8da4w-mix": 5,
    "8da4w-mix-avx2": 5,
    "int4": 4,
    "8da8w": 8,
    "8da8w-avx2": 8,
    "int8": 8,
    "fp32": 32,
}
_EMBEDDING_BITS = {"4w": 4, "8w": 8, "none": 32}
# The export's peak (lowering, in its child process, plus the parent) against the target
# program's size and its float32 KV cache, fitted on the measured exports of 0.5B, 1.5B and 3B
# qwen2 models and a 1.7B llama one at 8da8w (benchmarks/results/formats/export_memory_by_size.md).
_PEAK_FIXED_GB, _PEAK_PER_PROGRAM_GB, _PEAK_PER_CACHE_GB, _PEAK_LEAST_GB = 1.0, 2.78, 1.0, 2.0


def weight_bits(quant: dict) -> float:
    """Bits per linear weight of a quantization scheme (a manifest's `quant`), with its scales."""
    bits = WEIGHT_BITS.get(quant.get("scheme"), 32)
    group = quant.get("group_size") or 0
    return bits + 16 / group if bits < 32 and group else float(bits)


def program_gb(config, quant: str, group_size: int, embedding_quant: str) -> float:
    """The size of the target's .pte for an android export: its linear layers, embedding table
    and LM head (a tied head is packed as a linear layer of its own)."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    linear = config.num_layers * (d * q * 2 + d * kv * 2 + d * f * 3) + config.vocab_size * d
    bits = weight_bits({"scheme": quant, "group_size": group_size})
    table_bits = _EMBEDDING_BITS.get(embedding_quant, 32)
    return (linear * bits + config.vocab_size * d * table_bits) / 8 / 1e9


def cache_gb(config, max_seq_len: int) -> float:
    """The size of the target's KV cache (keys and values of every layer, float32)."""
    per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    return per_position * max_seq_len / 1e9


def export_peak_gb(program: float, cache: float) -> float:
    """The peak memory an android export of a `program`-GB target with a `cache`-GB KV cache
    takes (both processes): within 3% of the measured peaks of 0.6-3.4 GB programs, and ~2 GB at
    least (the default model's 0.2 GB of programs took 2.0)."""
    return max(
        _PEAK_LEAST_GB,
        _PEAK_FIXED_GB + _PEAK_PER_PROGRAM_GB * program + _PEAK_PER_CACHE_GB * cache,
    )


def export_forecast(
    config, quant: str, group_size: int, embedding_quant: str, max_seq_len: int
) -> tuple[float, float, float]:
    """(peak, target program, KV cache) in GB for an export that lowers to XNNPACK in a child
    process (the android platform's forecast, mtp_edge/platforms.py)."""
    program = program_gb(config, quant, group_size, embedding_quant)
    cache = cache_gb(config, max_seq_len)
    return export_peak_gb(program, cache), program, cache


def available_gb() -> float | None:
    """Memory the system can give without swapping (Linux's MemAvailable), or None; in the
    unit of the export log's peaks (thousands of MB of 2^20 bytes)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 / 1000
    except (OSError, ValueError, IndexError):
        pass
    return None


# Disk: the bundle is written into a temporary directory beside --out and renamed into place, so
# the filesystem of --out must hold the whole bundle at once; its target program is most of it.
_DISK_MARGIN = 1.05  # the manifest, tokenizer and drafter files beside the target program


def free_disk_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent), None if
    it cannot be read."""
    import shutil

    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def disk_forecast(out: Path, program: float) -> str | None:
    """Why an export of a `program`-GB target into `out` cannot fit on its filesystem, or None
    when it may (the forecast errs low: only a clear shortfall is refused)."""
    free = free_disk_bytes(out)
    need = program * 1e9 * _DISK_MARGIN
    if free is None or free >= need:
        return None
    return (
        f"{Path(out).absolute().parent} has {_size(free)} free and the bundle needs about "
        f"{_size(need)}: free space there, or export to another disk with --out DIR"
    )


def disk_full(where: Path | str) -> str:
    """The one line for a disk that filled up while writing under `where`."""
    return (
        f"no space left on the device while writing {where}: nothing was kept; free space "
        "there, or export to another disk with --out DIR"
    )


def _size(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"
