"""What this machine's CPU computes at best: int8 and fp32 matmul throughput, the peak that
mtp-devices records for the host and that mtp-train's report sets its writing and labelling
rates against."""

from __future__ import annotations

import time


def measure_matmul_gops(n: int = 1024, runs: int = 5) -> tuple[float, float]:
    """int8 and fp32 matmul throughput (Gop/s) with torch's current thread count: the peak the
    CPU's dot-product units reach on a large, cache-friendly problem."""
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
