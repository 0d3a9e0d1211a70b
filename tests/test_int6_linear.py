"""Our 6-bit linear op (mtp_edge::linear_i6, an LM head in 6 bits; C++ as every runtime runs it):
bitwise equal to the eager reference over shapes that cross its tile of 6 rows and its blocks of
16 channels, each row of a wide call bitwise its one-row call, the AVX2 and plain C++ versions
giving the same bits, the packing round trip, the largest values against the largest
activations (where the kernel's 16-bit partial sums come closest to overflowing), and the
reference computing the dequantized layer on the quantized activations."""

from __future__ import annotations

import pytest
import test_int8_linear
import torch
from torch import nn

from mtp_edge import ops
from mtp_edge.quantize.schemes import Int6Linear

SHAPES = [(64, 32, False), (96, 37, True), (32, 16, True), (576, 200, False)]


def check_shape(width: int, channels: int, bias: bool, outputs: dict | None = None) -> None:
    test_int8_linear.check_shape(width, channels, bias, outputs, kind=Int6Linear)


def test_packing_round_trips_and_pads_with_zero_channels():
    torch.manual_seed(1)
    q = torch.randint(-32, 32, (37, 96), dtype=torch.int8)
    scale = torch.rand(37, 3).half() + 0.01
    packed, scales = ops.pack_weight6(q, scale)
    assert packed.dtype == torch.uint8 and packed.numel() == 48 * 96 * 3 // 4
    back, back_scale = ops.unpack_weight6(packed, scales, 37, 96)
    assert torch.equal(back, q) and torch.equal(back_scale, scale)
    padded, _ = ops.unpack_weight6(packed, scales, 48, 96)
    assert not padded[37:].any()  # zero channels, stored as 32
    # the layout the kernel reads: low nibbles as the 4-bit layout, then the top bits
    u = q.int() + 32
    assert packed[0] == (u[0, 0] & 15) | ((u[8, 0] & 15) << 4)
    top = int(packed[256])
    assert [(top >> s) & 3 for s in (0, 2, 4, 6)] == [int(u[c, 0]) >> 4 for c in (0, 8, 4, 12)]


def test_quantization_keeps_each_groups_largest_value_and_beats_4_bits():
    torch.manual_seed(2)
    w = torch.randn(20, 64)
    q, scale = ops.quantize_weight6(w, rows=7)
    whole_q, whole_scale = ops.quantize_weight6(w)
    assert torch.equal(q, whole_q) and torch.equal(scale, whole_scale)
    assert q.min() >= -32 and q.max() <= 31
    back = (q.float().view(20, 2, 32) * scale.float()[..., None]).view(20, 64)
    assert (back - w).abs().max() <= scale.float().max() / 2 + 1e-6
    q4, scale4 = ops.quantize_weight4(w)
    back4 = (q4.float().view(20, 2, 32) * scale4.float()[..., None]).view(20, 64)
    assert (back - w).pow(2).mean() < (back4 - w).pow(2).mean() / 10


def test_the_reference_computes_the_dequantized_layer_on_quantized_activations():
    torch.manual_seed(3)
    layer = nn.Linear(96, 40)
    x = torch.randn(7, 96) * 2 + 0.5
    q, scale = ops.quantize_weight6(layer.weight)
    packed, scales = ops.pack_weight6(q, scale)
    got = ops.linear_i6(x, packed, scales, ops.weight4_sum(q, scale), layer.bias.detach())
    xq, xs, zero = ops.quantize_rows(x)
    w = (q.float().view(40, 3, 32) * scale.float()[..., None]).view(40, 96)
    want = ((xq - zero) * xs) @ w.T + layer.bias.detach()
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    with torch.no_grad():
        assert (got - layer(x)).abs().max() < 0.02 * layer(x).abs().max()


@pytest.mark.parametrize("width,channels,bias", SHAPES)
def test_kernel_equals_the_reference_and_its_rows_are_exact(width, channels, bias):
    check_shape(width, channels, bias)


def test_the_largest_values_against_the_largest_activations():
    """Every stored value 63 (or 0) against activations quantized to -128 (or 127): the kernel's
    sums at their extremes, still the reference's bits."""

    def extreme(linear: nn.Linear) -> Int6Linear:
        with torch.no_grad():
            linear.weight.fill_(1.0)  # every group's values 31.5 -> 31
            linear.weight[16:] = -1.0  # -31.5 -> -32
        return Int6Linear(linear)

    _program, method, layer = test_int8_linear.layer_program(64, 32, False, extreme)
    values, _ = ops.unpack_weight6(layer.weight, layer.weight_scale, 32, 64)
    assert (values[:16] == 31).all() and (values[16:] == -32).all()
    x = torch.stack([-torch.ones(64), torch.ones(64)])[None]  # rows quantized to -128 and 127
    assert ops.quantize_rows(x[0])[0].abs().amax(1).tolist() == [128, 127]
    got = method.execute([x.contiguous()])[0]
    with torch.no_grad():
        want = layer(x)
    assert torch.equal(got, want)
    assert torch.allclose(want[0, 0, :16], torch.full((16,), -64.0 * 31 / 31.5), rtol=1e-2)
    assert torch.allclose(want[0, 0, 16:], torch.full((16,), 64.0 * 32 / 31.5), rtol=1e-2)


def test_avx2_and_plain_versions_give_the_same_bits(tmp_path):
    test_int8_linear.versions_agree("test_int6_linear", tmp_path)


def test_a_width_that_is_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        Int6Linear(nn.Linear(40, 16))


def test_a_heads_holder_gets_the_6_bit_layer():
    """quantize_modules with the head's scheme (as benchmarks/int8_linears.py gives a head)."""
    from mtp_edge.quantize.schemes import QuantScheme, quantize_modules

    holder = nn.Module()
    holder.head = nn.Linear(64, 40, bias=False)
    quantize_modules(holder, QuantScheme(*QuantScheme("8da4w-mix-avx2", 32).head_scheme, "none"))
    assert type(holder.head) is Int6Linear
