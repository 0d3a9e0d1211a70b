"""Write an HF model directory of a published model's shape, with random weights.

What an export costs in time and memory depends on the model's shapes, not on its weights, so a
model of a size development has no checkpoint for can still be exported and measured. The
weights are drawn small (normal, std 0.02) so that activations stay finite; the perplexity an
export of such a model reports means nothing. The tokenizer comes from a GGUF of the same
family (the published sizes of a family share one), so prompts tokenize as for the real model:
the 0.5B Qwen GGUF for the Qwen shapes, the default model's for SmolLM2-1.7B.

    python benchmarks/shaped_model.py --shape qwen2.5-1.5b \
        --tokenizer-from Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf --out /tmp/qwen2.5-1.5b-shaped
    /usr/bin/time -v mtp-export --target android -m /tmp/qwen2.5-1.5b-shaped --drafter ngram
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

# The published configurations (config.json of each model card), the fields our loader reads:
# what the qwen2.5 sizes share, then each size's own.
_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
SHAPES = {
    "qwen2.5-1.5b": _QWEN25
    | {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
    },
    "smollm2-1.7b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 130000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2.5-3b": _QWEN25
    | {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
    },
}


def tensors(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Every weight of a llama or qwen2 decoder (qwen2: biases on q, k and v), in bfloat16,
    named as transformers names them."""
    d, f = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = d // heads

    def normal(*shape: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32)
        out.normal_(0.0, 0.02, generator=generator)
        return out.to(torch.bfloat16)

    out = {"model.embed_tokens.weight": normal(config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        out[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        for name, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
            out[p + f"self_attn.{name}_proj.weight"] = normal(rows, d)
            if config["model_type"] == "qwen2":
                out[p + f"self_attn.{name}_proj.bias"] = normal(rows)
        out[p + "self_attn.o_proj.weight"] = normal(d, heads * head_dim)
        out[p + "mlp.gate_proj.weight"] = normal(f, d)
        out[p + "mlp.up_proj.weight"] = normal(f, d)
        out[p + "mlp.down_proj.weight"] = normal(d, f)
    out["model.norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer-from", required=True, help="a GGUF of the same family")
    parser.add_argument("--out", required=True, help="the directory to write (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        sys.exit(f"error: {out} exists; give a new directory to --out")
    gguf = Path(args.tokenizer_from)
    if not gguf.is_file():
        sys.exit(f"error: no GGUF at {gguf}; give --tokenizer-from a .gguf of the same family")
    from transformers import AutoTokenizer

    config = SHAPES[args.shape]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    staging = out.with_name(out.name + ".partial")
    staging.mkdir(parents=True, exist_ok=False)
    tokenizer.save_pretrained(staging)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = tensors(config, torch.Generator().manual_seed(args.seed))
    count = sum(t.numel() for t in weights.values())
    save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
    staging.rename(out)
    print(f"{out}: {args.shape}, {count / 1e9:.2f}B parameters, random weights (std 0.02)")


if __name__ == "__main__":
    main()
