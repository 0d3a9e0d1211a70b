"""Tiny random models for the tests: a transformers reference, and ours with its weights."""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

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


# A chat template in the ChatML frame the tiny tokenizer's special tokens spell.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Held while the native runtime builds in runtime/native/build: two test processes (pytest-xdist
# workers, or two runs side by side) must not run cmake in one build directory at once.
# The lock file sits in that directory (ignored by git), so that no run leaves it in /tmp.
NATIVE_BUILD_LOCK = Path(__file__).resolve().parent.parent / "runtime/native/build/.tests.lock"


def run_shared_dir(factory, name: str) -> Path:
    """A directory `name` of this run's pytest temporary base that every test process of the
    run sees: under pytest-xdist each worker's base sits in the run's, which they share."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "shared" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on `path` (created if missing), across processes; blocks until free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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


def save_chat_dir(directory, seed: int = 3, **overrides):
    """A tiny llama with a chat template and a bos token that opens every prompt."""
    model_dir = save_hf_dir(hf_reference("llama", seed=seed, **overrides), Path(directory))
    config = {"bos_token": "<|im_start|>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


def amplify_cache_attention(path, factor: float = 4.0) -> None:
    """Scale the random head's attention output so that its drafts depend on what it reads in
    the cache: with the plain random head, a draft method reading a cache of its own (zeros)
    drafts the same tokens, and the tests could not tell (checked by breaking the sharing). A
    self head's drafts then depend more on the rows fed into its own cache."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        state = {name: f.get_tensor(name) for name in f.keys()}
    state["blocks.0.cache_attn.o_proj.weight"] *= factor
    save_file(state, str(path), metadata=metadata)


def without_drafting_policy(bundle: Path) -> None:
    """Make `bundle`'s manifest say what `mtp-export --ngram-sizes none --draft-confidence 0`
    writes: no drafting policy (the exporter writes nothing else differently for them)."""
    path = Path(bundle) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["drafter"].pop("lookup", None)
    manifest["drafter"].pop("draft_confidence", None)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def setup_options(bundle, max_seq_len: int):
    """The LoadOptions of a plain `--bundle DIR --no-chat-template` command."""
    from mtp_edge.runtime.assemble import LoadOptions

    return LoadOptions(bundle=str(bundle), max_seq_len=max_seq_len, chat=False)


def cache_home_sharing_kernels(path: Path) -> Path:
    """A fresh cache directory for XDG_CACHE_HOME at `path` (for tests of what mtp-edge keeps
    there, e.g. the verified-once stamps) in which the attention kernel library the user's cache
    holds is already present: a process loading ExecuTorch bundles under it would otherwise
    compile the kernel again (runtime/executorch_ops.py, ~20 s)."""
    from mtp_edge.runtime import executorch_ops

    library = executorch_ops.library_path()  # the user's cache: XDG_CACHE_HOME as it is now
    if not library.is_file():
        executorch_ops.build(library)
    ops = path / "mtp-edge" / "ops"
    ops.parent.mkdir(parents=True, exist_ok=True)
    ops.symlink_to(library.parent, target_is_directory=True)
    return path


def run_in_process(script: str, argument: str, **env: str):
    """Run `script` in a fresh Python process (a kernel version is chosen once per process) with
    `env` added to the environment and `argument` as sys.argv[1]; it must print "ok"."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script, argument], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", (env, done.stderr[-3000:])
    return done
