"""Loading Hugging Face safetensors directories: same logits as transformers, clear errors;
native MTP layers mapped onto our head."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import hf_reference, save_hf_dir, tiny_model

from mtp_edge.checkpoints import is_native_mtp_key, load_model, load_native_mtp
from mtp_edge.errors import UserError
from mtp_edge.model import Block

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}

PROMPT = [1, 5, 17, 42, 96, 3, 3, 60, 7, 88, 31, 2]


def assert_same_logits(ours, reference):
    """Prefill, then token by token through the static cache, against transformers."""
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = reference(tokens).logits
        ours.setup_cache(64)
        torch.testing.assert_close(ours(tokens, torch.tensor([0])), expected, atol=1e-4, rtol=1e-4)
        ours.setup_cache(64)
        for i in range(tokens.shape[1]):
            step = ours(tokens[:, i : i + 1], torch.tensor([i]))
            torch.testing.assert_close(step[0, 0], expected[0, i], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch, options",
    [
        ("llama", dict(tied=True, rope_parameters=LLAMA3_ROPE)),
        ("llama", dict(tied=False, rope_parameters=LLAMA3_ROPE)),
        ("qwen2", dict(tied=False)),
        ("qwen3", dict(tied=True)),
    ],
)
def test_hf_directory_matches_transformers(tmp_path, arch, options):
    reference = hf_reference(arch, **options)
    loaded = load_model(str(save_hf_dir(reference, tmp_path / "tiny-model")))
    assert loaded.name == "tiny-model"
    assert loaded.config.arch == arch
    assert loaded.config.tie_word_embeddings == options["tied"]
    assert (loaded.model.lm_head is None) == options["tied"]
    assert loaded.tokenizer.vocab_size == 97
    assert_same_logits(loaded.model, reference)


def test_sharded_checkpoint(tmp_path):
    reference = hf_reference("qwen2")
    directory = save_hf_dir(reference, tmp_path, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("model-*.safetensors"))) > 2
    assert_same_logits(load_model(str(directory)).model, reference)


def test_bfloat16_load(tmp_path):
    loaded = load_model(str(save_hf_dir(hf_reference("llama"), tmp_path)), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_tokenizer_comes_along(tmp_path):
    reference = hf_reference("llama")
    directory = save_hf_dir(reference, tmp_path)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True})
    )
    tokenizer = load_model(str(directory)).tokenizer
    assert tokenizer.bos_id == 1 and tokenizer.eos_ids[0] == 2
    assert tokenizer.encode_prompt("the cat", chat=False)[0] == 1
    assert tokenizer.decode(tokenizer.encode("the cat!")) == "the cat!"


def test_missing_path():
    with pytest.raises(UserError, match="model not found: /no/such/model"):
        load_model("/no/such/model")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="has no config.json"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path):
    hf_reference("llama").config.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="no model.safetensors"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tmp_path):
    directory = save_hf_dir(hf_reference("llama"), tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_model(str(directory))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'.*llama, qwen2, qwen3"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq"])
def test_pre_quantized_checkpoints_are_named_not_misread(tmp_path, method):
    """An FP8 checkpoint's weights are float8 tensors beside `weight_scale_inv` scales: read as
    weights they would be wrong by the scales, so the directory is refused before its tensors."""
    hf_reference("qwen3").save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=f"pre-quantized weights .*: {method}\\), .* float model"):
        load_model(str(tmp_path))


def test_missing_tokenizer(tmp_path):
    hf_reference("llama").save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_model(str(tmp_path))


def test_errors_are_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError) as error:
        load_model(str(tmp_path))
    assert "\n" not in str(error.value)


# --- native MTP weights ----------------------------------------------------------------------


def native_state(target, style: str, seed: int = 0) -> dict:
    """A random native MTP module for `target` in a checkpoint's naming."""
    c = target.config
    d, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3

    block = {
        "input_layernorm.weight": 1 + rand(d),
        "self_attn.q_proj.weight": rand(c.num_heads * c.head_dim, d),
        "self_attn.k_proj.weight": rand(kv, d),
        "self_attn.v_proj.weight": rand(kv, d),
        "self_attn.o_proj.weight": rand(d, c.num_heads * c.head_dim),
        "post_attention_layernorm.weight": 1 + rand(d),
        "mlp.gate_proj.weight": rand(c.intermediate_size, d),
        "mlp.up_proj.weight": rand(c.intermediate_size, d),
        "mlp.down_proj.weight": rand(d, c.intermediate_size),
    }
    if style == "deepseek":
        prefix = f"model.layers.{c.num_layers}."
        own = {
            "enorm.weight": 1 + rand(d),
            "hnorm.weight": 1 + rand(d),
            "eh_proj.weight": rand(d, 2 * d),
            "shared_head.norm.weight": 1 + rand(d),
            "shared_head.head.weight": rand(c.vocab_size, d),
        }
    else:
        prefix = "mtp."
        own = {
            "pre_fc_norm_embedding.weight": 1 + rand(d),
            "pre_fc_norm_hidden.weight": 1 + rand(d),
            "fc.weight": rand(d, 2 * d),
            "norm.weight": 1 + rand(d),
        }
        block = {f"layers.0.{name}": t for name, t in block.items()}
    state = {"model.layers.0.mlp.up_proj.weight": rand(4, 4)}  # a target tensor: ignored
    state.update({prefix + name: t for name, t in {**own, **block}.items()})
    return state


def native_reference(target, state: dict, style: str, h, emb):
    """The native module's formula, its attention run by our own Block over one position."""
    c = target.config
    if style == "deepseek":
        get = {k.split(f"layers.{c.num_layers}.", 1)[1]: v for k, v in state.items() if
               f"layers.{c.num_layers}." in k}  # fmt: skip
        e_norm, h_norm, fc = get["enorm.weight"], get["hnorm.weight"], get["eh_proj.weight"]
        norm, head = get["shared_head.norm.weight"], get["shared_head.head.weight"]
        layer = {
            k: v for k, v in get.items() if k.startswith(("self_attn", "mlp", "input", "post"))
        }
    else:
        get = {k[4:]: v for k, v in state.items() if k.startswith("mtp.")}
        e_norm, h_norm = get["pre_fc_norm_embedding.weight"], get["pre_fc_norm_hidden.weight"]
        fc, norm = get["fc.weight"], get["norm.weight"]
        head = target.lm_head.weight
        layer = {k[9:]: v for k, v in get.items() if k.startswith("layers.0.")}

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    x = torch.cat((rms(emb, e_norm), rms(h, h_norm)), -1) @ fc.T
    block = Block(c).double()
    block.load_state_dict(layer)
    block.self_attn.cache = type("Cache", (), {"update": lambda self, pos, k, v: (k, v)})()
    one = torch.ones(1, 1, 1, c.head_dim, dtype=torch.float64)
    out = torch.cat(
        [block(row[None, None], torch.tensor([0]), one, 0 * one, None, None)[0] for row in x]
    )
    return rms(out, norm) @ head.T, out


@pytest.mark.parametrize("style", ["deepseek", "qwen"])
def test_native_mtp_maps_onto_the_head(style):
    target = tiny_model(seed=5, vocab=48)
    state = native_state(target, style)
    head = load_native_mtp(state, target, "tiny")
    assert head.config.self_only_attention and head.config.draft_vocab_size == 48
    assert is_native_mtp_key(next(k for k in state if "fc" in k or "eh_proj" in k), 2)
    assert not is_native_mtp_key("model.layers.0.mlp.up_proj.weight", 2)
    h = torch.randn(3, 32, dtype=torch.float64)
    emb = target.embed_tokens(torch.tensor([1, 7, 30]))
    logits, g = head.step(h, emb)
    want_logits, want_g = native_reference(target, state, style, h, emb)
    torch.testing.assert_close(g, want_g)
    torch.testing.assert_close(logits, want_logits)


def test_native_mtp_refuses_what_it_cannot_run():
    target = tiny_model(seed=5, vocab=48)
    assert (
        load_native_mtp({"model.layers.0.mlp.up_proj.weight": torch.zeros(2)}, target, "t") is None
    )
    moe = native_state(target, "deepseek")
    moe["model.layers.2.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(UserError, match="mixture-of-experts.*mtp-train"):
        load_native_mtp(moe, target, "t")
    gated = native_state(target, "qwen")
    gated["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32)  # query + gate rows
    with pytest.raises(UserError, match="gated attention"):
        load_native_mtp(gated, target, "t")
    partial = native_state(target, "qwen")
    del partial["mtp.norm.weight"]
    with pytest.raises(UserError, match="lacks norm.weight"):
        load_native_mtp(partial, target, "t")
