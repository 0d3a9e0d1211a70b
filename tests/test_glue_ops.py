"""The element-wise ops between the linears (mtp_edge::rms_norm, rope, swiglu; C++ as every
runtime runs them) on their own: within float32 rounding of the eager reference, each row of a
wide call bitwise equal to a one-row call (verification's promise), rows spread over threads as
exact as rows done alone, and the AVX-512, AVX2 and plain versions within rounding of each
other."""

from __future__ import annotations

import pytest
import torch
from tiny import run_in_process
from torch import nn

from mtp_edge import ops
from mtp_edge.runtime import executorch_ops

ops.define()
ROWS = 9


class Norm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return torch.ops.mtp_edge.rms_norm(x, self.weight, 1e-5)


class Rope(nn.Module):
    def forward(self, x, cos, sin):
        return torch.ops.mtp_edge.rope(x, cos, sin)


class Swiglu(nn.Module):
    def forward(self, gate, up):
        return torch.ops.mtp_edge.swiglu(gate, up)


def method_of(module: nn.Module, examples: tuple, dims: tuple):
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    rows = torch.export.Dim("rows", min=1, max=4096)
    shapes = tuple({d: rows} for d in dims)
    exported = torch.export.export(module, examples, dynamic_shapes=shapes)
    executorch_ops.load_kernels()
    program = Runtime.get().load_program(to_edge(exported).to_executorch().buffer)
    return program, program.load_method("forward")


def inputs(width: int, rows: int = ROWS, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, width, generator=generator) * 4
    if rows > 2:
        x[0, 1] *= 30  # beyond exp's clamp in silu
        x[0, 2] = 0.0
    return x


def rows_are_exact(method, args: list, row_dims: list, want) -> None:
    """The call over all rows within rounding of `want`, and each row bitwise its own call."""
    got = method.execute(args)[0].clone()
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-6), float((got - want).abs().max())
    for i in range(args[0].shape[1]):
        one = [a.narrow(d, i, 1).contiguous() for a, d in zip(args, row_dims, strict=True)]
        assert torch.equal(method.execute(one)[0], got[:, i : i + 1]), i


def check_norm(width: int, rows: int = ROWS, outputs: dict | None = None) -> None:
    torch.manual_seed(width)
    module = Norm(width)
    _program, method = method_of(module, (inputs(width, 2),), (1,))
    x = inputs(width, rows, seed=width)
    with torch.no_grad():
        rows_are_exact(method, [x], [1], ops.rms_norm(x, module.weight, 1e-5))
    if outputs is not None:
        outputs[f"norm-{width}-{rows}"] = method.execute([x])[0].clone()


def check_swiglu(width: int, rows: int = ROWS, outputs: dict | None = None) -> None:
    _program, method = method_of(Swiglu(), (inputs(width, 2), inputs(width, 2)), (1, 1))
    gate, up = inputs(width, rows, seed=width), inputs(width, rows, seed=width + 1)
    rows_are_exact(method, [gate, up], [1, 1], ops.swiglu(gate, up))
    if outputs is not None:
        outputs[f"swiglu-{width}-{rows}"] = method.execute([gate, up])[0].clone()


def check_rope(heads: int, dim: int, rows: int = ROWS) -> None:
    def rotary(t: int, seed: int):
        angles = torch.rand(t, dim // 2, generator=torch.Generator().manual_seed(seed)) * 50
        angles = torch.cat((angles, angles), -1)
        return angles.cos(), angles.sin()

    x2 = torch.randn(1, 2, heads, dim)
    _program, method = method_of(Rope(), (x2, *rotary(2, 0)), (1, 0, 0))
    x = torch.randn(1, rows, heads, dim, generator=torch.Generator().manual_seed(dim))
    cos, sin = rotary(rows, 1)
    rows_are_exact(method, [x, cos, sin], [1, 0, 0], ops.rope(x, cos, sin))


# Widths: whole vectors of 16, and a tail (the padded last vector).
@pytest.mark.parametrize("width", [64, 576, 37])
def test_rms_norm_is_the_reference_and_its_rows_are_exact(width):
    check_norm(width)


@pytest.mark.parametrize("width", [64, 1000, 21])
def test_swiglu_is_the_reference_and_its_rows_are_exact(width):
    check_swiglu(width)


@pytest.mark.parametrize(("heads", "dim"), [(3, 64), (2, 128), (1, 6)])
def test_rope_is_the_reference_and_its_rows_are_exact(heads, dim):
    check_rope(heads, dim)


def test_rows_spread_over_threads_are_the_rows_done_alone():
    """A prefill-sized call (its rows over the thread pool) row by row as one-row calls."""
    check_norm(1536, rows=64)
    check_swiglu(1536, rows=64)
    check_rope(12, 128, rows=64)


def test_every_version_is_within_rounding_of_the_others(tmp_path):
    """MTP_EDGE_ATTENTION_ISA picks the version in a fresh process (chosen once per process):
    the CPU's best and the plain one agree to float32 rounding, both exact row by row."""
    from safetensors.torch import load_file

    script = f"""
import sys
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
from safetensors.torch import save_file
import test_glue_ops as t
outputs = {{}}
for width in (576, 37):
    t.check_norm(width, outputs=outputs)
    t.check_swiglu(width, outputs=outputs)
save_file(outputs, sys.argv[1])
print("ok")
"""
    results = {}
    for version in ("baseline", ""):
        path = tmp_path / f"{version or 'best'}.safetensors"
        run_in_process(script, str(path), MTP_EDGE_ATTENTION_ISA=version)
        results[version] = load_file(path)
    for key, value in results[""].items():
        assert torch.allclose(value, results["baseline"][key], rtol=2e-6, atol=1e-6), key


def test_bad_shapes_fail_the_call_not_the_process():
    _program, method = method_of(Swiglu(), (inputs(64, 2), inputs(64, 2)), (1, 1))
    with pytest.raises(RuntimeError):
        method.execute([inputs(64, 3), inputs(64, 2)])
