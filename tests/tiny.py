"""Tiny random models for the tests: a transformers reference, and ours with its weights."""

from __future__ import annotations

import torch

from mtp_edge.config import ModelConfig
from mtp_edge.model import Transformer


def hf_reference(arch: str, tied: bool = False, vocab: int = 97, seed: int = 0, **overrides):
    """A transformers model of `arch` with random weights (std 0.2, so logits are far from flat)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    settings = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def ours_from_hf(reference, dtype=torch.float32, max_seq_len: int = 256) -> Transformer:
    config = ModelConfig.from_hf(reference.config.to_dict())
    state = {k.removeprefix("model."): v for k, v in reference.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = Transformer.from_state_dict(config, state, dtype)
    model.setup_cache(max_seq_len)
    return model


def tiny_model(
    seed: int = 0, vocab: int = 64, dtype=torch.float64, max_seq_len: int = 256, **overrides
) -> Transformer:
    """One of ours with random weights, no transformers involved (fast, for loop tests)."""
    config = ModelConfig(
        arch="llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = Transformer(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.setup_cache(max_seq_len)
    return model


def byte_level_tokenizer(vocab: int = 97):
    """A tiny byte-level BPE tokenizer with `vocab` tokens (the tiny models' vocabulary size)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", ".", ",", "!", "?"]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a")]
    tokens = specials + chars + ["".join(m) for m in merges]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def save_hf_dir(reference, directory, vocab: int = 97, **save_options):
    """A Hugging Face model directory: safetensors weights, config.json and tokenizer.json."""
    reference.save_pretrained(directory, safe_serialization=True, **save_options)
    byte_level_tokenizer(vocab).save(str(directory / "tokenizer.json"))
    return directory


def chi_square_pvalue(counts, dist: dict, samples: int) -> float:
    """Chi-square p-value of sampled sequence `counts` against the exact distribution `dist`;
    a sample where the target gives probability 0 fails at once."""
    from scipy.stats import chisquare

    observed, expected, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for seq, p in dist.items():
        if p == 0:
            assert counts[seq] == 0, f"sampled {seq}, which the target gives probability 0"
        elif p * samples < 5:  # pool rare cells so the chi-square approximation holds
            pooled_obs += counts[seq]
            pooled_exp += p * samples
        else:
            observed.append(counts[seq])
            expected.append(p * samples)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


def save_random_heads(model_dir, path, attention: str = "target_cache"):
    """MTP heads with random weights for the model in `model_dir`, saved at `path` (lossless
    tests do not need good drafts): a 64-token draft vocabulary at the top of the vocabulary.
    `attention`: "target_cache" (reads the target's cache), "self" (its own cache) or "none"
    (see mtp.py)."""
    from mtp_edge.checkpoints import load_model
    from mtp_edge.mtp import (
        MTPConfig,
        MTPHead,
        cache_attention_config,
        init_from_target,
        save_heads,
        target_fingerprint,
    )

    target = load_model(str(model_dir))
    c = target.config
    extra = cache_attention_config(target.model, attention) if attention != "none" else {}
    config = MTPConfig(
        c.hidden_size,
        2 * c.hidden_size,
        c.vocab_size,
        64,
        target_name=target.name,
        target_hash=target_fingerprint(target.model),
        **extra,
    )
    torch.manual_seed(0)
    head = MTPHead(config)
    init_from_target(head, target.model, torch.arange(c.vocab_size - 64, c.vocab_size))
    save_heads(head, config, path)
    return path


def setup_options(bundle, max_seq_len: int):
    """The LoadOptions of a plain `--bundle DIR --no-chat-template` command."""
    from mtp_edge.runtime.assemble import LoadOptions

    return LoadOptions(bundle=str(bundle), max_seq_len=max_seq_len, chat=False)
