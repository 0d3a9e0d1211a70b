"""Our 4-bit linear op (mtp_edge::linear_i4, the 4-bit layers of 8da4w-mix-avx2; C++ as every
runtime runs it) on its own: bitwise equal to the eager reference over shapes that cross its tile
of 6 rows and its blocks of 16 channels (channels not a multiple of 16, with and without a
bias); each row of a wide call bitwise equal to a one-row call; the AVX2 version and the plain
C++ one giving the same bits; the packing round trip; and the reference computing the
dequantized layer on the quantized activations."""

from __future__ import annotations

import pytest
import test_int8_linear
import torch
from torch import nn

from mtp_edge import ops
from mtp_edge.quantize.schemes import Int4Linear

# (input width, channels, bias): whole and partial blocks of 16 channels, one group and many.
SHAPES = [(64, 32, False), (96, 37, True), (32, 16, True), (576, 200, False)]


def check_shape(width: int, channels: int, bias: bool, outputs: dict | None = None) -> None:
    test_int8_linear.check_shape(width, channels, bias, outputs, kind=Int4Linear)


def test_packing_round_trips_and_pads_with_zero_channels():
    torch.manual_seed(1)
    q = torch.randint(-8, 8, (37, 96), dtype=torch.int8)
    scale = torch.rand(37, 3).half() + 0.01
    packed, scales = ops.pack_weight4(q, scale)
    assert packed.dtype == torch.uint8 and packed.numel() == 48 * 96 // 2
    back, back_scale = ops.unpack_weight4(packed, scales, 37, 96)
    assert torch.equal(back, q) and torch.equal(back_scale, scale)
    padded, _ = ops.unpack_weight4(packed, scales, 48, 96)
    assert not padded[37:].any()  # zero channels, stored as 8


def test_quantization_keeps_each_groups_largest_value():
    torch.manual_seed(2)
    w = torch.randn(20, 64)
    q, scale = ops.quantize_weight4(w, rows=7)  # blocks of rows give the whole's result
    whole_q, whole_scale = ops.quantize_weight4(w)
    assert torch.equal(q, whole_q) and torch.equal(scale, whole_scale)
    assert q.min() >= -8 and q.max() <= 7
    back = (q.float().view(20, 2, 32) * scale.float()[..., None]).view(20, 64)
    assert (back - w).abs().max() <= scale.float().max() / 2 + 1e-6


def test_the_reference_computes_the_dequantized_layer_on_quantized_activations():
    torch.manual_seed(3)
    layer = nn.Linear(96, 40)
    x = torch.randn(7, 96) * 2 + 0.5
    q, scale = ops.quantize_weight4(layer.weight)
    packed, scales = ops.pack_weight4(q, scale)
    got = ops.linear_i4(x, packed, scales, ops.weight4_sum(q, scale), layer.bias.detach())
    xq, xs, zero = ops.quantize_rows(x)
    w = (q.float().view(40, 3, 32) * scale.float()[..., None]).view(40, 96)
    want = ((xq - zero) * xs) @ w.T + layer.bias.detach()
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # and within 4-bit error of the float layer
    with torch.no_grad():
        assert (got - layer(x)).abs().max() < 0.1 * layer(x).abs().max()


@pytest.mark.parametrize("width,channels,bias", SHAPES)
def test_kernel_equals_the_reference_and_its_rows_are_exact(width, channels, bias):
    check_shape(width, channels, bias)


def test_avx2_and_plain_versions_give_the_same_bits(tmp_path):
    test_int8_linear.versions_agree("test_int4_linear", tmp_path)


def test_a_width_that_is_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Linear(nn.Linear(40, 16))
