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

With `--gguf` the model is written as a GGUF file (OUT ending in .gguf) quantized the way
llama.cpp's Q4_K_M quantizes a model of that width: Q4_K blocks, Q6_K for the embedding and for
attn_v and ffn_down of the layers Q4_K_M gives more bits (the first and last eighth, every third
between), float32 norms and biases, and the tokenizer's metadata of --tokenizer-from. The blocks
are random bytes with small scales (weights of ~1e-3), which load as any Q4_K_M file does.
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


GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(rows: int, cols: int, kind, rng):
    """Valid Q4_K/Q6_K bytes: random quants and scales, small float16 block scales."""
    import gguf
    import numpy as np

    values, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // values, nbytes), dtype=np.uint8)
    scale = np.array([1e-4], dtype=np.float16).view(np.uint8)
    if kind == gguf.GGMLQuantizationType.Q6_K:  # ql, qh, int8 scales, then d
        blocks[:, -2:] = scale
    else:  # Q4_K: d, dmin, packed scales, quants
        blocks[:, 0:2] = blocks[:, 2:4] = scale
    return blocks.reshape(rows, -1)


def write_gguf(config: dict, tokenizer_from: Path, path: Path, seed: int) -> int:
    """A Q4_K_M-like GGUF of `config`'s shape; returns its parameter count."""
    import gguf
    import numpy as np

    q = gguf.GGMLQuantizationType
    arch = config["model_type"]
    d, f = config["hidden_size"], config["intermediate_size"]
    heads, kv, layers = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["num_hidden_layers"],
    )
    head_dim = d // heads
    if d % 256 or f % 256:
        sys.exit(f"error: --gguf needs widths divisible by 256 (K-quant blocks), got {d}, {f}")
    reader = gguf.GGUFReader(str(tokenizer_from))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{config['model_type']}-shaped")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    count = 0

    def matrix(name: str, rows: int, cols: int, kind) -> None:
        nonlocal count
        writer.add_tensor(name, random_blocks(rows, cols, kind, rng), raw_dtype=kind)
        count += rows * cols

    def vector(name: str, values) -> None:
        nonlocal count
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
        count += len(values)

    matrix("token_embd.weight", config["vocab_size"], d, q.Q6_K)
    for i in range(layers):
        p = f"blk.{i}."
        more = q.Q6_K if more_bits(i, layers) else q.Q4_K
        vector(p + "attn_norm.weight", np.ones(d))
        vector(p + "ffn_norm.weight", np.ones(d))
        for name, rows in (("attn_q", d), ("attn_k", kv * head_dim), ("attn_v", kv * head_dim)):
            matrix(p + f"{name}.weight", rows, d, more if name == "attn_v" else q.Q4_K)
            if arch == "qwen2":
                vector(p + f"{name}.bias", rng.normal(0, 0.02, rows))
        matrix(p + "attn_output.weight", d, d, q.Q4_K)
        matrix(p + "ffn_gate.weight", f, d, q.Q4_K)
        matrix(p + "ffn_up.weight", f, d, q.Q4_K)
        matrix(p + "ffn_down.weight", d, f, more)
    vector("output_norm.weight", np.ones(d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer-from", required=True, help="a GGUF of the same family")
    parser.add_argument("--out", required=True, help="the directory to write (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", action="store_true", help="write a Q4_K_M-like .gguf file")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        sys.exit(f"error: {out} exists; give a new path to --out")
    gguf = Path(args.tokenizer_from)
    if not gguf.is_file():
        sys.exit(f"error: no GGUF at {gguf}; give --tokenizer-from a .gguf of the same family")
    if args.gguf:
        if out.suffix != ".gguf":
            sys.exit(f"error: --gguf writes a .gguf file, got --out {out}")
        staging = out.with_name(out.name + ".partial")
        count = write_gguf(SHAPES[args.shape], gguf, staging, args.seed)
        staging.rename(out)
        print(f"{out}: {args.shape}, {count / 1e9:.2f}B parameters, random Q4_K_M-like blocks")
        return
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
