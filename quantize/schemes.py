"""Quantization schemes for export: which torchao config each layer gets, checked before any work.

Linear layers: `8da4w` / `8da8w` (int8 activations quantized per token at run time, int4 / int8
weights), or `fp32`. The embedding table gets weight-only `8w` / `4w`, or `none`. These are the
forms ExecuTorch 1.5's XNNPACK partitioner lowers to its integer GEMMs, and ExecuTorch's quantized
kernels run the embedding lookup (`embedding_byte` / `embedding_4bit`) without dequantizing the
whole table. Weight-only int8 / int4 linears are refused: the XNNPACK partitioner takes them in
but drops the dequantization, so the program computes with the raw integers (wrong logits), and
outside XNNPACK there is no kernel for torchao's dequantize op ("Missing out variants").

A tied LM head is untied first, so the head gets a linear scheme and the table a lookup scheme.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from mtp_edge.errors import UserError
from mtp_edge.model import Transformer

LINEAR_SCHEMES = ("8da4w", "8da8w", "fp32")
EMBEDDING_SCHEMES = ("8w", "4w", "none")
_WEIGHT_BITS = {"8da4w": torch.int4, "8da8w": torch.int8, "8w": torch.int8, "4w": torch.int4}
_REFUSED = {
    "int8": "weight-only int8 linears are not lowered correctly by ExecuTorch's XNNPACK backend: "
    "use 8da8w (same int8 weights, activations quantized at run time)",
    "int4": "weight-only int4 linears are not lowered correctly by ExecuTorch's XNNPACK backend: "
    "use 8da4w (same int4 weights, activations quantized at run time)",
}


# What --quant each export target takes, and its default. ONNX: int4 / int8 = onnxruntime's
# MatMulNBits (blockwise weights, fp32 activations), or fp32. Core ML: int4 per block, int8 per
# channel, or fp16 weights; Core ML computes in fp16 whatever the weights.
TARGET_SCHEMES = {
    "android": LINEAR_SCHEMES,
    "onnx": ("int4", "int8", "fp32"),
    "coreml": ("int4", "int8", "fp16"),
}
# android: 8da8w, not 8da4w: on SmolLM2-135M 4-bit weights cost 1.59x perplexity (g32) and
# 3.4x (per channel) against 1.01x, and cut MTP acceptance so much that speculation stopped
# paying; 8da8w decodes slower (4.5 vs 3.4 ms a step) but speculates faster (benchmarks/).
DEFAULT_SCHEME = {"android": "8da8w", "onnx": "int4", "coreml": "int4"}


def default_group_size(linear: str, target: str = "android") -> int:
    """What a scheme uses when the user gives no group size: 32 for 4-bit weights (and for
    ONNX's blockwise int8), else 0 = one scale per output channel."""
    return 32 if linear in ("8da4w", "int4") or (target, linear) == ("onnx", "int8") else 0


def check_target_scheme(target: str, name: str, group: int) -> None:
    """Raise UserError for a --quant / --group-size that `target` (onnx, coreml) cannot take."""
    valid = TARGET_SCHEMES[target]
    if name not in valid:
        raise UserError(
            f"--quant {name} is not available for --target {target}: choose one of "
            f"{', '.join(valid)}"
        )
    blockwise = name == "int4" or (target, name) == ("onnx", "int8")
    if blockwise and (group < 16 or group & (group - 1)):
        raise UserError(
            f"--group-size {group}: {name} for {target} takes a block size that is a power of "
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
    _check_linear("LM head scheme", head, head_group, {"LM head": c.hidden_size})
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
    if name == "8da8w" and group != 0:
        raise UserError(
            f"{name} needs --group-size 0 (channelwise): XNNPACK groups only 4-bit weights"
        )
    if name == "8da4w":
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
    from torchao.quantization import quantize_

    head, head_group = scheme.head_scheme
    if model.lm_head is None and (scheme.embedding, head) != ("none", "fp32"):
        # Share the parameter: quantize_ gives each module its own quantized copy.
        c = model.config
        model.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.embed_tokens.weight

    def is_head(m: nn.Module, fqn: str) -> bool:
        return isinstance(m, nn.Linear) and fqn == "lm_head"

    if scheme.embedding != "none":
        quantize_(model, _embedding_config(scheme), lambda m, fqn: isinstance(m, nn.Embedding))
    if scheme.linear != "fp32":
        config = _linear_config(scheme.linear, scheme.group_size)
        quantize_(model, config, lambda m, fqn: isinstance(m, nn.Linear) and not is_head(m, fqn))
    if head != "fp32" and model.lm_head is not None:
        quantize_(model, _linear_config(head, head_group), is_head)
    return model


def quantize_modules(module: nn.Module, scheme: QuantScheme) -> nn.Module:
    """Quantize every linear layer of `module` with the linear scheme and every embedding with
    the embedding scheme, in place (for modules other than a Transformer, e.g. a drafter)."""
    from torchao.quantization import quantize_

    if scheme.embedding != "none":
        quantize_(module, _embedding_config(scheme), lambda m, fqn: isinstance(m, nn.Embedding))
    if scheme.linear != "fp32":
        config = _linear_config(scheme.linear, scheme.group_size)
        quantize_(module, config, lambda m, fqn: isinstance(m, nn.Linear))
    return module


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
