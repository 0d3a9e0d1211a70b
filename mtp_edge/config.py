"""Model configuration: one dataclass for the llama family (llama, qwen2, qwen3)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mtp_edge.errors import UserError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF `architectures[0]` / `model_type` -> our architecture name.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "qwen2": "qwen2",
    "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
}


def check_architecture(name: str) -> str:
    arch = _HF_MODEL_TYPES.get(name)
    if arch is None:
        raise UserError(
            f"unsupported architecture '{name}': supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama-3.x style {"rope_type": "llama3", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k
    max_position_embeddings: int = 2048
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Build from a transformers `config.json` dictionary."""
        name = cfg.get("model_type") or (cfg.get("architectures") or ["?"])[0]
        arch = check_architecture(name)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 nests rope settings here
            if isinstance(rope_params, dict):
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
                "default",
                None,
            ):
                rope_scaling = None
            return cls(
                arch=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            )
        except KeyError as e:
            raise UserError(f"config.json is missing the field {e.args[0]!r}") from None
