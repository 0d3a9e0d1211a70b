"""Run the kernels of a CPU without AVX-512 or VNNI on a CPU that has them (MTP_EDGE_CPU_CLASS).

Speculation's costs differ by CPU class: without an int8 dot product a verification's extra rows
cost int8 arithmetic that the weights' read does not hide (benchmarks/README.md "CPUs without
an int8 dot product"). Such laptops are common, but a developer's or a CI machine often has
AVX-512 VNNI. With MTP_EDGE_CPU_CLASS=avx2 in the environment, a process that imports mtp_edge
picks, on such a machine, the kernels an AVX2-only CPU (AVX2, FMA, F16C; no AVX-512, no
AVX-VNNI) would pick:

- XNNPACK, inside ExecuTorch, chooses its GEMM microkernels once, at load, from pytorch/cpuinfo's
  table of the CPU's features (`cpuinfo_isa`, which libexecutorch_threadpool.so exports). The
  table is filled and the newer features cleared before ExecuTorch's backends load.
- torch reads its own copy of the table (libc10.so) when it decides whether `torch._int_mm` may
  use oneDNN (VNNI only; else a reference loop) and which vector width ATen's kernels use.
- mtp-edge's attention kernel takes its AVX2 version (MTP_EDGE_ATTENTION_ISA) and the reported
  int8 path is avx2 (MTP_EDGE_INT8_PATH), so the runtime drafts the k that class drafts and
  mtp-devices/mtp-predict describe it; either variable given explicitly is kept.

What stays this CPU's: its clock, caches, memory and how fast it executes AVX2 instructions. The
class's tile shapes and arithmetic (the 4-row int8 tile, VPMADDWD after widening) are the
target CPU's; its absolute speed is not. Linux on x86-64 only (the tables are read from
/proc/cpuinfo's flags to check their layout first), and the Python runtime only: the native
runner's XNNPACK initialises as the binary loads.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.machine import cpu_flags

ENV = "MTP_EDGE_CPU_CLASS"

# struct cpuinfo_x86_isa on x86-64 (pytorch/cpuinfo's include/cpuinfo.h, as ExecuTorch 1.5 and
# torch 2.13 build it: 85 one-byte fields). Only the offsets checked or cleared are named.
_LAYOUT_SIZE = 85
_CHECKED = {  # offset: the /proc/cpuinfo flag that must agree with the byte there
    22: "avx",
    24: "fma",
    27: "f16c",
    28: "avx2",
    29: "avx512f",
    32: "avx512cd",
    33: "avx512dq",
    34: "avx512bw",
    35: "avx512vl",
    41: "avx512_vnni",
}
_AVX_VNNI = 23  # AVX-VNNI (256-bit VPDPBUSD)
_NEWER = range(29, 56)  # avx512f .. avx_ne_convert: AVX-512, AVX10, AMX, AVX-VNNI-INT8/16

# What each class needs of the real CPU, and which features it clears.
CLASSES = {"avx2": {"needs": ("avx2", "fma", "f16c"), "clear": (_AVX_VNNI, *_NEWER)}}

_applied: str | None = None
problem: UserError | None = None  # set at import, raised where kernels are about to run


def requested() -> str | None:
    return os.environ.get(ENV) or None


def applied() -> str | None:
    """The class this process emulates (None: this CPU's own)."""
    return _applied


def check() -> None:
    """Raise what went wrong applying MTP_EDGE_CPU_CLASS at import, if anything did: before a
    command runs and before a program loads, so that no figure is measured on the wrong class."""
    if problem is not None:
        raise problem


def apply_at_import() -> None:
    """Called by `import mtp_edge` when MTP_EDGE_CPU_CLASS is set; keeps the error for check()."""
    global problem
    try:
        apply(requested())
    except UserError as e:
        problem = e


def apply(name: str | None) -> None:
    global _applied
    if not name or _applied == name:
        return
    if name not in CLASSES:
        raise UserError(
            f"{ENV}={name} is not a CPU class mtp-edge can run: use one of "
            f"{', '.join(CLASSES)}, or unset it to run this CPU's own kernels"
        )
    flags = _cpu_flags()
    missing = [f for f in CLASSES[name]["needs"] if f not in flags]
    if missing:
        raise UserError(
            f"{ENV}={name} needs a CPU with {', '.join(CLASSES[name]['needs'])}; this one lacks "
            f"{', '.join(missing)}: unset {ENV}"
        )
    xnnpack = _loaded("libexecutorch_backend_xnnpack.so")
    if xnnpack:
        raise UserError(
            f"{ENV}={name} came too late: ExecuTorch's XNNPACK was loaded before mtp_edge "
            f"({xnnpack}); import mtp_edge first"
        )
    os.environ.setdefault("ATEN_CPU_CAPABILITY", name)
    import torch  # noqa: F401  (loads libc10.so, torch's copy of the table)

    libraries = [Path(torch.__file__).parent / "lib" / "libc10.so", _executorch_threadpool()]
    tables = [_table(lib) for lib in libraries]  # both filled first: each fills once, ever
    # A library's cpuinfo code fills the first table of that name in the process's global
    # scope, so one of the two may stay empty: the one filled is the one both read.
    cleared = [
        _clear(lib, table, CLASSES[name]["clear"], flags)
        for lib, table in zip(libraries, tables, strict=True)
    ]
    if not any(cleared):
        raise UserError(f"{ENV}: no cpuinfo table was filled in torch or ExecuTorch: unset it")
    os.environ.setdefault("MTP_EDGE_ATTENTION_ISA", name)
    os.environ.setdefault("MTP_EDGE_INT8_PATH", name)
    _applied = name


def _cpu_flags() -> set[str]:
    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = set()
    if not flags:
        raise UserError(f"{ENV} works on x86-64 Linux only (no flags in /proc/cpuinfo): unset it")
    return flags


def _loaded(library: str) -> str | None:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        if line.endswith("/" + library):
            return line.split()[-1]
    return None


def _executorch_threadpool() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("executorch")
    for root in spec.submodule_search_locations if spec else ():
        lib = Path(root) / "lib" / "libexecutorch_threadpool.so"
        if lib.is_file():
            return lib
    raise UserError(f"{ENV} needs ExecuTorch's libexecutorch_threadpool.so, not found: unset it")


def _table(library: Path):
    """The library's feature table, after its cpuinfo_initialize has run."""
    handle = ctypes.CDLL(str(library))
    try:
        initialize = handle.cpuinfo_initialize
        table = (ctypes.c_uint8 * _LAYOUT_SIZE).in_dll(handle, "cpuinfo_isa")
    except (AttributeError, ValueError) as e:
        raise UserError(f"{ENV}: {library.name} has no cpuinfo table to set ({e}): unset it") from e
    initialize.restype = ctypes.c_bool
    if not initialize():
        raise UserError(f"{ENV}: cpuinfo could not read this CPU in {library.name}: unset it")
    return table


def _clear(library: Path, table, offsets, flags: set[str]) -> bool:
    """Clear `offsets` in a filled table, after checking that it is laid out as this module
    reads it; False for a table that was never filled."""
    if not any(table):
        return False
    wrong = [flag for offset, flag in _CHECKED.items() if bool(table[offset]) != (flag in flags)]
    if wrong:
        raise UserError(
            f"{ENV}: {library.name}'s cpuinfo table is not laid out as mtp-edge reads it "
            f"(disagrees with /proc/cpuinfo on {', '.join(wrong)}); this ExecuTorch or torch "
            f"version cannot run another class's kernels: unset {ENV}"
        )
    for offset in offsets:
        table[offset] = 0
    return True
