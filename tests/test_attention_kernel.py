"""Our attention kernel (mtp_edge::sdpa, C++, as every runtime runs it) on its own: against the
eager reference for 1 to 16 query rows, each row of a wide call bitwise equal to a one-row call
at its position (the property verification rests on), over the kernel's paths (grouped query
heads, one head at a time, head sizes with and without a compiled-in specialization or not a
multiple of the vector width), with calls whose rows cross the key blocks the kernel works in;
and every version of the kernel this CPU runs (AVX-512, AVX2+FMA, the SSE baseline: 16, 8 and 4
floats per register), each keeping both properties, the versions that fuse multiply-adds giving
the same bits (as aarch64's NEON version does: tokens on a phone are the laptop's)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import run_in_process

from mtp_edge import ops
from mtp_edge.runtime import executorch_ops

SLOTS = 320  # three key blocks of the kernel's 128 slots
LAYOUTS = [  # (query heads, KV heads, head size): the kernel's paths
    (9, 3, 64),  # three heads per KV head, taken together (SmolLM2's layout)
    (14, 2, 64),  # seven per KV head: a chunk of four and one of three (Qwen2.5-0.5B's)
    (12, 2, 128),  # six per KV head at head size 128: chunks of two (Qwen2.5-1.5B's)
    (3, 3, 128),  # one query head per KV head
    (3, 1, 32),  # a head size without a compiled-in specialization
    (5, 5, 24),  # not a multiple of 16: the one-float-at-a-time path
]
# Rows before, across and after block boundaries; from 125 the pair of rows at 127 and 128 has
# a block that only its second row sees into.
STARTS = [0, 3, 120, 125, 250, SLOTS - 16]


def attention_program(heads: int, kv_heads: int, dim: int):
    """A one-op ExecuTorch program over [1, T, heads, dim] queries, T from 1 to 16."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, start):
            return torch.ops.mtp_edge.sdpa(q, k, v, start.item())

    ops.define()
    rows = torch.export.Dim("rows", min=1, max=16)
    q = torch.randn(1, 4, heads, dim)
    k, v = torch.randn(2, 1, SLOTS, kv_heads, dim)  # two tensors: export would alias one
    exported = torch.export.export(
        Attend(), (q, k, v, torch.tensor([0])), dynamic_shapes=({1: rows}, None, None, None)
    )
    executorch_ops.load_kernels()
    program = Runtime.get().load_program(to_edge(exported).to_executorch().buffer)
    return program, program.load_method("forward")  # the method needs its program alive


def check_layout(method, heads: int, kv_heads: int, dim: int, outputs: dict | None = None) -> None:
    """Both properties on one layout; `outputs` (if given) keeps each start's 16-row result."""
    generator = torch.Generator().manual_seed(heads * 1000 + dim)
    k = torch.randn(1, SLOTS, kv_heads, dim, generator=generator)
    v = torch.randn(1, SLOTS, kv_heads, dim, generator=generator)
    for start in STARTS:
        q = 2 * torch.randn(1, 16, heads, dim, generator=generator)  # sharper softmax than 1
        ones = [
            method.execute([q[:, i : i + 1], k, v, torch.tensor([start + i])])[0].clone()
            for i in range(min(16, SLOTS - start))
        ]
        for t in range(1, min(16, SLOTS - start) + 1):
            got = method.execute([q[:, :t], k, v, torch.tensor([start])])[0]
            want = ops.attention(q[:, :t], k, v, start)
            torch.testing.assert_close(got, want, atol=3e-6, rtol=1e-5)
            for i in range(t):
                assert torch.equal(got[:, i : i + 1], ones[i]), (heads, dim, start, t, i)
        if outputs is not None:
            outputs[f"{heads}-{kv_heads}-{dim}-{start}"] = got.clone()


def cpu_runs(version: str) -> bool:
    """Whether this CPU runs the kernel's `version` (the flags the kernel's dispatch reads)."""
    if version == "baseline":
        return True
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}}[version] <= flags


def test_every_version_keeps_both_properties_and_fused_ones_agree(tmp_path):
    """Each version this CPU runs, named by MTP_EDGE_ATTENTION_ISA in a fresh process (the
    choice is made once per process): both properties on every layout, and the versions that
    fuse multiply-adds (AVX-512, AVX2+FMA) bitwise equal to each other. The baseline (SSE, no
    fused multiply-add) rounds differently: its own properties only. The CPU's best version is
    reached through a name that is none: one line says so, and the CPU's own version runs."""
    from safetensors.torch import load_file

    versions = [v for v in ("avx512", "avx2", "baseline") if cpu_runs(v)]
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from safetensors.torch import save_file
import test_attention_kernel as t
outputs = {{}}
for layout in t.LAYOUTS:
    _program, method = t.attention_program(*layout)
    t.check_layout(method, *layout, outputs=outputs)
save_file(outputs, sys.argv[1])
print("ok")
"""
    results = {}
    for version in versions:
        path = tmp_path / f"{version}.safetensors"
        name = "avx9" if version == versions[0] else version
        done = run_in_process(script, str(path), MTP_EDGE_ATTENTION_ISA=name)
        said = [line for line in done.stderr.splitlines() if "MTP_EDGE_ATTENTION_ISA" in line]
        if name == version:
            assert said == [], done.stderr  # the version named ran
        else:
            assert len(said) == 1 and "avx9" in said[0] and f"using {version}" in said[0], said
        results[version] = load_file(path)
    fused = [v for v in ("avx512", "avx2") if v in results]
    for other in fused[1:]:
        for key, value in results[fused[0]].items():
            assert torch.equal(value, results[other][key]), (fused[0], other, key)
