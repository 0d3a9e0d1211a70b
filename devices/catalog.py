"""The device catalog (devices/catalog.json) and this machine's own figures, measured live.

Phones and laptops are described by published figures, each with the page it comes from; the
host is measured instead, because a VM's or a laptop's real memory bandwidth and core count are
what its decoding speed follows, whatever its spec sheet says.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.machine import INT8_PATHS, int8_path, measure_matmul_rates


@dataclass
class Device:
    name: str
    title: str
    kind: str  # phone | laptop | board | host
    soc: str
    abi: str
    ram_gb: float | None
    bandwidth_gbs: float  # memory bandwidth: peak (catalog) or measured (host)
    cpu: str
    cpu_int8_gops: float  # peak int8 dot-product throughput of the big cores (host: measured)
    cpu_fp32_gflops: float | None
    gpu_fp32_tflops: float | None
    npu_int8_tops: float | None
    sources: dict  # figure -> where it comes from
    measured: bool = False  # True for the host: figures from live probes, not spec sheets
    # How the CPU multiplies int8 (mtp_edge/machine.py INT8_PATHS): a dot-product instruction
    # (VNNI, SDOT, SMMLA) or widening multiply-adds (AVX2), which decides what a verification of
    # k+1 rows costs beyond a step where the weights' read does not hide the arithmetic.
    int8_path: str | None = None


def catalog() -> list[Device]:
    data = json.loads(resources.files("mtp_edge.devices").joinpath("catalog.json").read_text())
    out = []
    for d in data["devices"]:
        figures = {k: v for k, v in d.items() if isinstance(v, dict)}
        out.append(
            Device(
                name=d["name"],
                title=d["title"],
                kind=d["kind"],
                soc=d["soc"],
                abi=d["abi"],
                ram_gb=d["ram_gb"]["value"],
                bandwidth_gbs=d["memory_bandwidth_gbs"]["value"],
                cpu=d["cpu"]["value"],
                cpu_int8_gops=d["cpu_int8_gops"]["value"],
                cpu_fp32_gflops=d["cpu_fp32_gflops"]["value"],
                gpu_fp32_tflops=d["gpu_fp32_tflops"]["value"],
                npu_int8_tops=d["npu_int8_tops"]["value"],
                sources={k: v["source"] for k, v in figures.items()},
                int8_path=d["cpu_int8_path"]["value"],
            )
        )
    return out


def find_device(name: str) -> Device:
    """A catalog device by name, or the host measured live for 'host'."""
    if name == "host":
        return host_device()
    devices = catalog()
    for d in devices:
        if d.name == name:
            return d
    names = ", ".join(d.name for d in devices)
    raise UserError(f"unknown device '{name}': use host or one of {names} (see mtp-devices)")


@cache
def host_device() -> Device:
    """This machine, measured now: memory read bandwidth, int8 and fp32 matmul throughput."""
    cores = usable_cores()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    bandwidth = measure_bandwidth_gbs()
    rates = measure_matmul_rates()
    path = int8_path()
    how = "measured live on this machine"
    return Device(
        name="host",
        title=f"this machine ({platform.node()})",
        kind="host",
        soc=cpu_model(),
        abi=platform.machine(),
        ram_gb=round(ram, 1),
        bandwidth_gbs=round(bandwidth, 1),
        cpu=f"{cores} cores (all of them in the matmul probes: ExecuTorch's pool), {cpu_model()}",
        cpu_int8_gops=round(rates.int8_gops, 1),
        cpu_fp32_gflops=round(rates.fp32_gflops, 1),
        gpu_fp32_tflops=None,
        npu_int8_tops=None,
        sources={
            "memory_bandwidth_gbs": f"{how}: numpy sums over a 512 MB array, a stream per core",
            "cpu_int8_gops": f"{how}: {rates.how}",
            "cpu_fp32_gflops": f"{how}: {rates.how}",
            "cpu_int8_path": f"{path.instruction}; {int8_path_source()}",
            "ram_gb": "os.sysconf",
        },
        measured=True,
        int8_path=path.name,
    )


def int8_path_source() -> str:
    """Where the host's int8 path comes from: the CPU's flags, or the class it runs as."""
    from mtp_edge import cpu_class

    if cpu_class.applied():
        return (
            f"the {cpu_class.applied()} class's kernels on this CPU ({cpu_class.ENV}; its own "
            f"flags: {int8_path(Path('/proc/cpuinfo').read_text()).name})"
        )
    if os.environ.get("MTP_EDGE_INT8_PATH"):
        return "named by MTP_EDGE_INT8_PATH (the kernels that run are this CPU's own)"
    return "from the CPU's flags (/proc/cpuinfo)"


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_bandwidth_gbs(megabytes: int = 512, runs: int = 5, threads: int = 0) -> float:
    """Read bandwidth: summing an array far larger than the caches streams it from DRAM, as a
    decoding step streams the weights. One stream per core (`threads`, default: every core this
    process may use), because decoding reads with every core: one core alone cannot saturate
    the memory bus (on this 2-core host one stream reached ~20 GB/s while decoding read ~30).
    The best of a few runs (others may share the machine)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    threads = threads or usable_cores()
    a = np.ones(megabytes * 2**20 // 8)
    parts = np.array_split(a, threads)
    best = float("inf")
    # numpy releases the GIL inside the reduction, so the threads stream in parallel.
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # touch every page before timing
        for _ in range(runs):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def devices_table(devices: list[Device]) -> str:
    """The catalog as a Markdown table (what mtp-devices prints)."""

    def show(v, fmt="{:g}"):
        return "—" if v is None else fmt.format(v)

    lines = [
        "| name | device | SoC | RAM GB | bandwidth GB/s | CPU int8 path | CPU int8 Gop/s "
        "| CPU fp32 GFLOP/s | GPU fp32 TFLOPS | NPU int8 TOPS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in devices:
        lines.append(
            f"| {d.name} | {d.title} | {d.soc} | {show(d.ram_gb)} | {show(d.bandwidth_gbs)}"
            f"{' (measured)' if d.measured else ''} | {int8_path_label(d.int8_path)} | "
            f"{show(d.cpu_int8_gops)}{' (measured)' if d.measured else ''} | "
            f"{show(d.cpu_fp32_gflops)} | {show(d.gpu_fp32_tflops)} | {show(d.npu_int8_tops)} |"
        )
    return "\n".join(lines) + "\n"


def int8_path_label(name: str | None) -> str:
    """'avx2 (no dot product)', 'i8mm', ...: the path and whether it has an int8 dot product."""
    if name is None:
        return "—"
    path = INT8_PATHS.get(name)
    return name if path is None or path.dot_product else f"{name} (no dot product)"
