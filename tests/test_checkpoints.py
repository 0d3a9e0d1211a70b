"""Loading Hugging Face safetensors directories: same logits as transformers, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import hf_reference, save_hf_dir

from mtp_edge.checkpoints import load_model
from mtp_edge.errors import UserError

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


def test_missing_tokenizer(tmp_path):
    hf_reference("llama").save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_model(str(tmp_path))


def test_errors_are_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError) as error:
        load_model(str(tmp_path))
    assert "\n" not in str(error.value)
