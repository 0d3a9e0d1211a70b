"""Our attention kernel (mtp_edge::sdpa, C++, as every runtime runs it) on its own: against the
eager reference for 1 to 16 query rows, each row of a wide call bitwise equal to a one-row call
at its position (the property verification rests on), over the kernel's paths (grouped query
heads, one head at a time, head sizes with and without a compiled-in specialization or not a
multiple of the vector width), with calls whose rows cross the key blocks the kernel works in,
and a build for the baseline instruction set (no AVX) that must keep both properties."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def check_layout(method, heads: int, kv_heads: int, dim: int) -> None:
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


@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS)
def test_rows_match_eager_and_equal_one_row_calls(heads, kv_heads, dim):
    _program, method = attention_program(heads, kv_heads, dim)
    check_layout(method, heads, kv_heads, dim)


def test_baseline_instruction_set_build_keeps_both_properties():
    """The kernel built without its AVX-512/AVX2 versions (what a CPU without them runs, and the
    shape of the code on other architectures), loaded into a fresh process."""
    flags = ["-DMTP_EDGE_BASELINE"]
    # Cached by content beside the default build, as load_kernels caches that one.
    library = executorch_ops.library_path(flags)
    if not library.is_file():
        executorch_ops.build(library, flags)
    script = f"""
import ctypes, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from executorch.extension.pybindings import portable_lib  # noqa: F401
ctypes.CDLL({str(library)!r}, mode=ctypes.RTLD_GLOBAL)
from mtp_edge.runtime import executorch_ops
executorch_ops._loaded = True  # the baseline build is the one registered
import test_attention_kernel as t
for layout in t.LAYOUTS:
    _program, method = t.attention_program(*layout)
    t.check_layout(method, *layout)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
