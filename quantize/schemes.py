"""Quantization schemes for export: which torchao config each layer gets, checked before any work.

Linear layers: `8da4w` / `8da8w` (int8 activations quantized per token at run time, int4 /
int8 weights), or `fp32`; `8da8w-avx2` is 8da8w's numbers in our own kernel (`Int8Linear`,
the op `mtp_edge::linear_i8`), whose tile takes 6 rows where XNNPACK's int8 GEMM takes 4 on a
CPU without an int8 dot product; `8da4w-mix` is 8da4w with each layer's k and v projections and
the LM head in 8da8w per channel (the tensors whose 4-bit rounding costs the most perplexity:
Qwen2.5-Coder-0.5B x1.00 against 8da4w's x1.05; benchmarks/README.md, "4-bit layers, 8-bit k, v
and head"); `8da4w-mix-avx2` is 8da4w-mix in our own kernels (`Int4Linear`, mtp_edge::linear_i4,
for its 4-bit layers in groups of 32; `Int8Linear` for k and v) with the LM head in 6 bits
(`Int6Linear`, mtp_edge::linear_i6, as llama.cpp's Q4_K_M keeps its output tensor in Q6_K:
`--head-quant 8da8w-avx2` keeps it in 8), 6 rows per pass where
XNNPACK's groupwise 4-bit GEMM takes 3 on AVX2. The embedding table gets weight-only `8w` /
`4w`, or `none`.
These are the forms ExecuTorch 1.5's XNNPACK partitioner lowers to its integer GEMMs, and
ExecuTorch's quantized kernels run the embedding lookup (`embedding_byte` / `embedding_4bit`)
without dequantizing the whole table. Weight-only int8 / int4 linears are refused: the XNNPACK
partitioner takes them in but drops the dequantization, so the program computes with the raw
integers (wrong logits), and outside XNNPACK there is no kernel for torchao's dequantize op
("Missing out variants").

A tied LM head is untied first, so the head gets a linear scheme and the table a lookup scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from mtp_edge.errors import UserError
from mtp_edge.model import Transformer
from mtp_edge.platforms import MIXED_4BIT, OWN_6BIT_HEAD, OWN_INT8, OWN_MIXED_4BIT, PLATFORMS

LINEAR_SCHEMES = ("8da4w", MIXED_4BIT, "8da8w", OWN_INT8, OWN_MIXED_4BIT, "fp32")
# What mtp-export --head-quant offers an LM head: linear schemes, and OWN_6BIT_HEAD (6-bit
# weights in groups of 32, float16 scales, 8-bit activations, in our kernel: `Int6Linear`,
# mtp_edge::linear_i6, as llama.cpp's Q4_K_M keeps its output tensor in Q6_K; 0.81 of an
# 8-bit head's bytes).
HEAD_SCHEMES = ("8da8w", OWN_INT8, OWN_6BIT_HEAD, "8da4w", "fp32")  # mtp-export --head-quant
# 8da4w-mix's layers in 8da8w per channel (every other linear of a layer is 8da4w); the same in
# 8da4w-mix-avx2, in our kernels.
MIXED_EIGHT_BIT = ("k_proj", "v_proj")
EMBEDDING_SCHEMES = ("8w", "4w", "none")
_WEIGHT_BITS = {
    "8da4w": torch.int4,
    MIXED_4BIT: torch.int4,
    "8da8w": torch.int8,
    "8w": torch.int8,
    "4w": torch.int4,
}
_REFUSED = {
    "int8": "weight-only int8 linears are not lowered correctly by ExecuTorch's XNNPACK backend: "
    "use 8da8w (same int8 weights, activations quantized at run time)",
    "int4": "weight-only int4 linears are not lowered correctly by ExecuTorch's XNNPACK backend: "
    "use 8da4w (same int4 weights, activations quantized at run time)",
}


def default_group_size(linear: str, platform: str = "android") -> int:
    """What a scheme uses when the user gives no group size: 32 for 4- and 6-bit weights and for a
    platform's blockwise schemes (mtp_edge/platforms.py), else 0 = one scale per output
    channel."""
    grouped = linear in ("8da4w", MIXED_4BIT, OWN_MIXED_4BIT, "int4", OWN_6BIT_HEAD)
    return 32 if grouped or linear in PLATFORMS[platform].blockwise else 0


def check_platform_scheme(platform: str, name: str, group: int) -> None:
    """Raise UserError for a --quant / --group-size that `platform` cannot take."""
    row = PLATFORMS[platform]
    if name not in row.schemes:
        raise UserError(
            f"--quant {name} is not available for --target {platform}: choose one of "
            f"{', '.join(row.schemes)}"
        )
    if name in row.blockwise and (group < 16 or group & (group - 1)):
        raise UserError(
            f"--group-size {group}: {name} for {platform} takes a block size that is a power of "
            "two >= 16 (default 32)"
        )


@dataclass(frozen=True)
class QuantScheme:
    linear: str = "8da4w"
    group_size: int = 32  # input columns sharing one scale; 0 = one scale per output row
    embedding: str = "8w"
    embedding_group_size: int = 0
    head: str | None = None  # LM head scheme; None = the linear layers' scheme
    head_group_size: int | None = None  # None = the linear layers' group size

    @property
    def head_scheme(self) -> tuple[str, int]:
        if self.head is None:
            if self.linear == MIXED_4BIT:
                return "8da8w", 0
            if self.linear == OWN_MIXED_4BIT:
                return OWN_6BIT_HEAD, 32
            return self.linear, self.group_size
        group = self.group_size if self.head_group_size is None else self.head_group_size
        return self.head, group

    def to_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        """Short human name, e.g. `8da4w-g32 emb 8w` or `8da4w-cw head 8da8w-cw`."""
        head, head_group = self.head_scheme
        text = _layer_label(self.linear, self.group_size)
        if (head, head_group) != (self.linear, self.group_size):
            text += f" head {_layer_label(head, head_group)}"
        if self.embedding != "none":
            text += f" emb {_layer_label(self.embedding, self.embedding_group_size)}"
        return text


def _layer_label(scheme: str, group: int) -> str:
    if scheme in ("fp32", "none"):
        return scheme
    return f"{scheme}-{'cw' if group == 0 else f'g{group}'}"


def check_scheme(scheme: QuantScheme, model: Transformer) -> None:
    """Raise UserError for a scheme or group size that this model cannot be exported with."""
    c = model.config
    linear_inputs = {
        "attention q/k/v and mlp gate/up": c.hidden_size,
        "attention output": c.num_heads * c.head_dim,
        "mlp down": c.intermediate_size,
    }
    _check_linear("--quant", scheme.linear, scheme.group_size, linear_inputs)
    head, head_group = scheme.head_scheme
    if head == OWN_6BIT_HEAD:
        from mtp_edge.ops import GROUP4

        if head_group != GROUP4:
            raise UserError(f"--head-quant {head} takes group size {GROUP4} (its kernel's group)")
        _check_group("--head-quant", head_group, {"LM head": c.hidden_size})
    else:
        _check_linear("--head-quant", head, head_group, {"LM head": c.hidden_size})
    if scheme.embedding not in EMBEDDING_SCHEMES:
        raise UserError(
            f"unknown embedding quantization '{scheme.embedding}': "
            f"supported are {', '.join(EMBEDDING_SCHEMES)}"
        )
    if scheme.embedding != "none":
        _check_group(
            "embedding group size", scheme.embedding_group_size, {"embedding": c.hidden_size}
        )


def _check_linear(flag: str, name: str, group: int, inputs: dict[str, int]) -> None:
    if name in _REFUSED:
        raise UserError(f"{flag} {name}: {_REFUSED[name]}")
    if name not in LINEAR_SCHEMES:
        raise UserError(
            f"unknown quantization scheme '{name}': supported are {', '.join(LINEAR_SCHEMES)}"
        )
    if name in ("8da8w", OWN_INT8) and group != 0:
        raise UserError(
            f"{name} needs --group-size 0 (channelwise): XNNPACK groups only 4-bit weights"
        )
    if name in ("8da4w", MIXED_4BIT):
        _check_group("--group-size", group, inputs)
    if name == OWN_MIXED_4BIT:
        from mtp_edge.ops import GROUP4

        if group != GROUP4:
            raise UserError(
                f"{name} takes --group-size {GROUP4} (its 4-bit kernel's group), got {group}: "
                f"drop --group-size, or use 8da4w-mix for other group sizes"
            )
        _check_group("--group-size", group, inputs)


def _check_group(flag: str, group: int, inputs: dict[str, int]) -> None:
    if group < 0:
        raise UserError(f"{flag} must be >= 0 (0 = channelwise), got {group}")
    for layer, width in inputs.items():
        if group and width % group:
            raise UserError(
                f"{flag} {group} does not divide the {layer} input width {width}: "
                "use a divisor of every layer width, or 0 for channelwise"
            )


def quantize_model(model: Transformer, scheme: QuantScheme) -> Transformer:
    """Quantize `model` in place with torchao (call `check_scheme` first)."""
    for name, module in model.parts():
        quantize_part(model, name, module, scheme)
    return model


def quantize_part(model: Transformer, name: str, module: nn.Module, scheme: QuantScheme) -> None:
    """Quantize one part of `model` (a name from Transformer.parts) in place: the loader
    calls this as each part's weights arrive, so a whole float32 model is never held. A tied
    LM head gets a quantized copy of its own while the embedding is still float."""

    head, head_group = scheme.head_scheme
    if name == "embed_tokens":
        if model.lm_head is None and (scheme.embedding, head) != ("none", "fp32"):
            c = model.config
            model.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
            model.lm_head.weight = nn.Parameter(module.weight.detach(), requires_grad=False)
            quantize_part(model, "lm_head", model.lm_head, scheme)
        if scheme.embedding != "none" and not is_quantized(module):
            _quantize_by_rows(module, _embedding_config(scheme))
    elif name == "lm_head":
        if head == OWN_INT8 and not is_quantized(module):
            model.lm_head = Int8Linear(module)
        elif head == OWN_6BIT_HEAD and not is_quantized(module):
            model.lm_head = Int6Linear(module)
        elif head != "fp32" and not is_quantized(module):
            _quantize_by_rows(module, _linear_config(head, head_group))
    elif scheme.linear == OWN_INT8:
        own_int8_linears(module)
    elif scheme.linear == OWN_MIXED_4BIT:
        own_mixed_linears(module)
    elif scheme.linear != "fp32":
        _quantize_linears(module, scheme)


def _quantize_linears(module: nn.Module, scheme: QuantScheme) -> None:
    """Every linear of `module` not yet quantized, with the scheme's layer config (8da4w-mix:
    MIXED_EIGHT_BIT's in 8da8w per channel first, the rest in 8da4w)."""
    from torchao.quantization import quantize_

    def fresh(m: nn.Module, fqn: str) -> bool:
        return isinstance(m, nn.Linear) and not is_quantized(m)

    if scheme.linear == MIXED_4BIT:
        quantize_(
            module,
            _linear_config("8da8w", 0),
            lambda m, fqn: fresh(m, fqn) and fqn.rsplit(".", 1)[-1] in MIXED_EIGHT_BIT,
        )
    quantize_(module, _linear_config(scheme.linear, scheme.group_size), fresh)


QUANTIZE_ROWS = 8192  # rows of a vocabulary-sized table quantized at a time


def _quantize_by_rows(module: nn.Embedding | nn.Linear, config) -> None:
    """quantize_(module, config) for a table with one row per token (an embedding, an LM head),
    a block of rows at a time: every scheme here scales rows (or groups within a row) on their
    own, so the result is the same, while torchao's float temporaries stay the size of a block
    rather than of the table (for a 151,936-token vocabulary, gigabytes)."""
    from torchao.quantization import quantize_

    weight = module.weight.detach()
    if weight.shape[0] <= QUANTIZE_ROWS:
        quantize_(module, config, lambda m, fqn: isinstance(m, type(module)))
        return
    pieces, first = [], None
    for start in range(0, weight.shape[0], QUANTIZE_ROWS):
        block = nn.Linear(weight.shape[1], 1, bias=False, device="meta")
        block.weight = nn.Parameter(weight[start : start + QUANTIZE_ROWS], requires_grad=False)
        quantize_(block, config)  # an embedding's weight-only config quantizes any weight
        names, attributes = block.weight.__tensor_flatten__()
        first = first or (type(block.weight), names, attributes)
        pieces.append([getattr(block.weight, n) for n in names])
    kind, names, attributes = first
    inner = {n: torch.cat([p[i] for p in pieces]) for i, n in enumerate(names)}
    quantized = kind.__tensor_unflatten__(inner, attributes, weight.shape, None)
    module.weight = nn.Parameter(quantized, requires_grad=False)


class Int8Linear(nn.Module):
    """A linear layer of the 8da8w-avx2 scheme: int8 weights (a symmetric scale per output
    channel) packed for our kernel, called as mtp_edge::linear_i8 (mtp_edge/ops.py)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from mtp_edge import ops

        ops.define()
        q, scale = ops.quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", ops.pack_weight(q))
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_sum", q.sum(1, dtype=torch.int32))
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mtp_edge.linear_i8(
            x, self.weight, self.weight_scale, self.weight_sum, self.bias
        )


class Int4Linear(nn.Module):
    """A 4-bit linear layer of the 8da4w-mix-avx2 scheme: values in [-8, 7] with a float16
    scale per group of 32 input columns, packed for our kernel, called as mtp_edge::linear_i4
    (mtp_edge/ops.py)."""

    bits = 4

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from mtp_edge import ops

        ops.define()
        if linear.in_features % ops.GROUP4:
            raise ValueError(
                f"a {self.bits}-bit layer's input width must be a multiple of {ops.GROUP4}, "
                f"got {linear.in_features}"
            )
        quantize, pack = (
            (ops.quantize_weight4, ops.pack_weight4)
            if self.bits == 4
            else (ops.quantize_weight6, ops.pack_weight6)
        )
        q, scale = quantize(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, weight_scale = pack(q, scale)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_sum", ops.weight4_sum(q, scale))
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mtp_edge.linear_i4(
            x, self.weight, self.weight_scale, self.weight_sum, self.bias
        )


class Int6Linear(Int4Linear):
    """A 6-bit linear layer (the LM head of `--head-quant 8da6w-avx2`): values in [-32, 31] with
    a float16 scale per group of 32 input columns, called as mtp_edge::linear_i6
    (mtp_edge/ops.py): 0.81 of the int8 head's bytes, as llama.cpp's Q6_K output tensor."""

    bits = 6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mtp_edge.linear_i6(
            x, self.weight, self.weight_scale, self.weight_sum, self.bias
        )


def own_int8_linears(module: nn.Module) -> nn.Module:
    """Replace every float nn.Linear inside `module` with an Int8Linear, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and not is_quantized(child):
            setattr(module, name, Int8Linear(child))
        else:
            own_int8_linears(child)
    return module


def own_mixed_linears(module: nn.Module) -> nn.Module:
    """8da4w-mix-avx2's layers for every float nn.Linear inside `module`, in place: an
    Int8Linear for those named in MIXED_EIGHT_BIT, an Int4Linear for the rest."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and not is_quantized(child):
            kind = Int8Linear if name in MIXED_EIGHT_BIT else Int4Linear
            setattr(module, name, kind(child))
        else:
            own_mixed_linears(child)
    return module


def is_quantized(module: nn.Module) -> bool:
    """Whether torchao already replaced this layer's weight (quantizing twice is an error)."""
    if isinstance(module, (Int8Linear, Int4Linear)):  # Int6Linear is an Int4Linear
        return True
    weight = getattr(module, "weight", None)
    return weight is not None and type(weight) not in (torch.Tensor, nn.Parameter)


def quantize_modules(module: nn.Module, scheme: QuantScheme) -> nn.Module:
    """Quantize every linear layer of `module` with the linear scheme and every embedding with
    the embedding scheme, in place (for modules other than a Transformer, e.g. a drafter)."""
    from torchao.quantization import quantize_

    def fresh(kind: type) -> Callable[[nn.Module, str], bool]:
        return lambda m, fqn: isinstance(m, kind) and not is_quantized(m)

    if scheme.embedding != "none":
        quantize_(module, _embedding_config(scheme), fresh(nn.Embedding))
    if scheme.linear == OWN_INT8:
        own_int8_linears(module)
    elif scheme.linear == OWN_MIXED_4BIT:
        own_mixed_linears(module)
    elif scheme.linear == OWN_6BIT_HEAD:  # a head's scheme, given to the head's holder
        _replace_linears(module, Int6Linear)
    elif scheme.linear != "fp32":
        _quantize_linears(module, scheme)
    return module


def _replace_linears(module: nn.Module, kind: type) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and not is_quantized(child):
            setattr(module, name, kind(child))
        else:
            _replace_linears(child, kind)


def _embedding_config(scheme: QuantScheme):
    from torchao.quantization import IntxWeightOnlyConfig

    return IntxWeightOnlyConfig(
        weight_dtype=_WEIGHT_BITS[scheme.embedding],
        granularity=_granularity(scheme.embedding_group_size),
    )


def _linear_config(name: str, group: int):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=_WEIGHT_BITS[name], weight_granularity=_granularity(group)
    )


def _granularity(group: int):
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerAxis(0) if group == 0 else PerGroup(group)
