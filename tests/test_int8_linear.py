"""Our int8 linear op (mtp_edge::linear_i8, the 8da8w-avx2 scheme's layers; C++ as every runtime
runs it) on its own: bitwise equal to the eager reference over shapes that cross its tile of 6
rows and its blocks of 16 channels (odd input widths, channels not a multiple of 16, with and
without a bias); each row of a wide call bitwise equal to a one-row call; the AVX2 version and
the plain C++ one (what other CPUs run) giving the same bits; and the reference within int8's
error of the float layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import run_in_process
from torch import nn

from mtp_edge import ops
from mtp_edge.quantize.schemes import Int8Linear, own_int8_linears
from mtp_edge.runtime import executorch_ops

# (input width, channels, bias): blocks of 16 channels whole and partial, even and odd widths.
SHAPES = [(64, 32, False), (70, 37, True), (33, 16, True), (576, 200, False)]
ROWS = 13  # two full tiles of 6 rows and one row


def layer_program(width: int, channels: int, bias: bool, kind: type = Int8Linear):
    """(program, method, layer): one `kind` layer (our op's module: Int8Linear, Int4Linear) as
    an ExecuTorch program, 1..ROWS rows."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    torch.manual_seed(width * 100 + channels)
    layer = kind(nn.Linear(width, channels, bias=bias))
    rows = torch.export.Dim("rows", min=1, max=ROWS)
    exported = torch.export.export(layer, (torch.randn(1, 4, width),), dynamic_shapes=({1: rows},))
    executorch_ops.load_kernels()
    program = Runtime.get().load_program(to_edge(exported).to_executorch().buffer)
    return program, program.load_method("forward"), layer


def check_shape(
    width: int, channels: int, bias: bool, outputs: dict | None = None, kind: type = Int8Linear
) -> None:
    """Every width 1..ROWS bitwise the eager layer's, and each row bitwise its one-row call."""
    _program, method, layer = layer_program(width, channels, bias, kind)
    generator = torch.Generator().manual_seed(width)
    # Rows of different ranges and offsets: zero points away from the middle, and a row of zeros.
    x = torch.randn(1, ROWS, width, generator=generator) * torch.linspace(0.1, 8, ROWS)[:, None]
    x[0, 2] += 3.0
    x[0, 5] = 0.0
    ones = [method.execute([x[:, i : i + 1].contiguous()])[0].clone() for i in range(ROWS)]
    for t in range(1, ROWS + 1):
        got = method.execute([x[:, :t].contiguous()])[0]
        with torch.no_grad():
            want = layer(x[:, :t])
        assert torch.equal(got, want), (width, channels, t, float((got - want).abs().max()))
        for i in range(t):
            assert torch.equal(got[:, i : i + 1], ones[i]), (width, channels, t, i)
    if outputs is not None:
        outputs[f"{width}-{channels}-{bias}"] = got.clone()


def test_packing_round_trips_and_pads_with_zeros():
    q = torch.randint(-127, 128, (37, 71), dtype=torch.int8)
    packed = ops.pack_weight(q)
    assert packed.numel() == 48 * 72  # channels to a multiple of 16, width to even
    assert torch.equal(ops.unpack_weight(packed, 37, 71), q)
    assert int(packed.abs().sum()) == int(q.abs().sum(dtype=torch.int64))  # padding is zeros


def test_blockwise_quantization_and_reference_equal_the_whole():
    """A vocabulary-sized head is quantized and computed a block of channels at a time: the
    same values as all at once."""
    torch.manual_seed(1)
    weight, x = torch.randn(100, 71), torch.randn(3, 71)
    q, scale = ops.quantize_weight(weight, rows=16)
    whole_q, whole_scale = ops.quantize_weight(weight)
    assert torch.equal(q, whole_q) and torch.equal(scale, whole_scale)
    args = (x, ops.pack_weight(q), scale, q.sum(1, dtype=torch.int32), torch.randn(100))
    assert torch.equal(ops.linear_i8(*args, channels=32), ops.linear_i8(*args))


def test_the_reference_is_within_int8_error_of_the_float_layer():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    x = torch.randn(7, 256)
    with torch.no_grad():
        want, got = linear(x), Int8Linear(linear)(x)
    error = float((got - want).abs().max() / want.abs().max())
    assert 0 < error < 0.02, error  # quantized (not the float layer), and close to it


def test_kernel_equals_the_reference_and_its_rows_are_exact():
    for shape in SHAPES:
        check_shape(*shape)


def versions_agree(module: str, tmp_path: Path) -> None:
    """The plain C++ version (other CPUs') named by MTP_EDGE_INT8_LINEAR in a fresh process (the
    choice is made once per process), against this CPU's own: `module`'s check_shape (both
    properties) over its SHAPES in each, equal outputs."""
    from safetensors.torch import load_file

    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU runs the plain version only")
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from safetensors.torch import save_file
import {module} as t
outputs = {{}}
for shape in t.SHAPES:
    t.check_shape(*shape, outputs=outputs)
save_file(outputs, sys.argv[1])
print("ok")
"""
    results = {}
    for version in ("avx2", "plain"):
        path = tmp_path / f"{version}.safetensors"
        run_in_process(script, str(path), MTP_EDGE_INT8_LINEAR=version)
        results[version] = load_file(path)
    for key, value in results["avx2"].items():
        assert torch.equal(value, results["plain"][key]), key


def test_avx2_and_plain_versions_give_the_same_bits(tmp_path):
    versions_agree("test_int8_linear", tmp_path)


def test_every_float_linear_is_replaced_once():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    own_int8_linears(model)
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, Int8Linear))]
    assert [type(m) for m in layers] == [Int8Linear, Int8Linear]
    first = model[0].weight
    own_int8_linears(model)  # already replaced: left as they are
    assert model[0].weight is first
