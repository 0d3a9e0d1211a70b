"""Export our Transformer to ONNX (torch.onnx dynamo exporter) for ONNX Runtime on CPU.

`forward(tokens [1, T] int64, input_pos [1] int64, past_key_i, past_value_i ...) ->
(logits [1, T, vocab], [hidden [1, T, D]], present_key_i, present_value_i ...)`, T dynamic in
1..max_chunk. Attention is com.microsoft GroupQueryAttention over a static cache
[1, kv_heads, max_seq_len, head_dim] per layer: given `seqlens_k = start + T - 1` it writes the T
new K/V rows at slots start.. and lets a query at position p read slots <= p only. When the
runtime binds each past_* input and its present_* output to the same OrtValue, GQA detects the
shared buffer and writes into it in place: no per-step copy, growth or concatenation of the cache
(onnxruntime-genai's `past_present_share_buffer`). Rejected drafts cost nothing: their slots are
overwritten by the next call, exactly as on the other backends.

Weights: fp32, or int4 / int8 through onnxruntime's MatMulNBits quantizer (blockwise, symmetric,
fp32 activations: see _save_quantized for why not int8 activations). Every linear layer is
exported as a MatMul against a pre-transposed constant, the form the quantizer matches.

The MTP drafter is a graph of its own, drafter.onnx (one draft step). For a head that reads the
target's cache (mtp.py) the step also takes `input_pos` and the target's last-layer cache as
past_key/past_value -> present_key/present_value, and attends with the same GroupQueryAttention
(one new row at slot input_pos, seqlens_k = input_pos): the runtime binds those to the target
session's own cache OrtValues, so the head's K/V row lands in the target's cache in place.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
import torch
import torch.nn.functional as F
from torch import nn

from mtp_edge.errors import UserError
from mtp_edge.exporter.onnx_ops import gqa, gqa_onnx, gqa_rope, gqa_rope_onnx
from mtp_edge.exporter.platform import draft_vocabulary, head_settings, refuse_self_heads
from mtp_edge.manifest import Manifest, ModelFile
from mtp_edge.model import MLP, Attention, Transformer, rope_frequencies, rotate_half
from mtp_edge.mtp import MTPHead, apply_rope

if TYPE_CHECKING:
    from mtp_edge.exporter.platform import ExportJob

OPSET = 18
MIN_TOKENS = "mtp_edge.min_tokens"  # graph metadata: fewest tokens per call (the session pads)


class MatMulLinear(nn.Module):
    """x @ W^T with W^T stored as a constant: exported as one MatMul that the quantizers take."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight_t", weight.detach().t().contiguous().float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def _transpose_linears(module: nn.Module) -> None:
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, MatMulLinear(child.weight, child.bias))


def _fused(*linears: nn.Linear) -> MatMulLinear:
    """One MatMul for linears that read the same input (outputs side by side): fewer, larger
    MatMulNBits calls. The quantizer's blocks run along the input dim, so each output column
    is quantized exactly as it would be alone."""
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                torch.zeros(lin.out_features) if b is None else b
                for lin, b in zip(linears, biases, strict=True)
            ]
        )
    return MatMulLinear(torch.cat([lin.weight for lin in linears]), bias)


class GQAAttention(nn.Module):
    """Attention as one GroupQueryAttention over caches that are graph inputs, q, k and v one
    MatMul. It rotates q and k itself (`fused_rotary`: cos/sin are then the whole tables, read
    at the call's positions) or takes them rotated (cos/sin: the rows of the call's positions).
    For each call OnnxTarget sets `past` (this layer's cache inputs), `seqlens_k` and
    `total_len`, and collects `present`, the caches GroupQueryAttention returns."""

    def __init__(self, attention: Attention, fused_rotary: bool):
        super().__init__()
        a = attention
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv = _fused(a.q_proj, a.k_proj, a.v_proj)
        self.o_proj = MatMulLinear(a.o_proj.weight, a.o_proj.bias)
        self.q_norm, self.k_norm = a.q_norm, a.k_norm
        self.fused_rotary = fused_rotary
        self.past = self.present = self.seqlens_k = self.total_len = None

    def forward(self, x, positions, cos, sin, mask, kv_len):
        t, d, heads, kv_heads = x.shape[1], self.head_dim, self.num_heads, self.num_kv_heads
        width = kv_heads * d
        qkv = self.qkv(x)
        q, k, v = qkv, None, None  # packed
        if self.q_norm is not None or not self.fused_rotary:
            q, k, v = qkv.split([heads * d, width, width], -1)
        if self.q_norm is not None:  # Qwen3: RMSNorm per head on q and k before the rotation
            q = self.q_norm(q.view(1, t, heads, d)).reshape(1, t, -1)
            k = self.k_norm(k.view(1, t, kv_heads, d)).reshape(1, t, -1)
        if self.fused_rotary:
            out, k_cache, v_cache = gqa_rope(
                q, k, v, *self.past, self.seqlens_k, self.total_len, cos, sin, heads, kv_heads
            )
        else:
            q, k = q.view(1, t, heads, d), k.view(1, t, kv_heads, d)
            q = (q * cos + rotate_half(q) * sin).reshape(1, t, -1)
            k = (k * cos + rotate_half(k) * sin).reshape(1, t, -1)
            out, k_cache, v_cache = gqa(
                q, k, v, *self.past, self.seqlens_k, self.total_len, heads, kv_heads
            )
        self.present = [k_cache, v_cache]
        return self.o_proj(out)


class FusedMLP(nn.Module):
    """The MLP with gate and up as one MatMul."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.gate_up = _fused(mlp.gate_proj, mlp.up_proj)
        self.down_proj = MatMulLinear(mlp.down_proj.weight, mlp.down_proj.bias)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class OnnxTarget(nn.Module):
    """The model's forward with the caches as inputs/outputs, on a copy of the model whose
    attention and MLP are swapped for GQAAttention and FusedMLP.

    Shaped for onnxruntime's per-node cost (a decode step is a few ms): q, k, v are one MatMul
    and gate/up another, and GroupQueryAttention applies the rotary embedding itself
    (do_rotary) and takes q, k, v packed (unless the model normalises q and k first). The LM
    head is a MatMul against the transposed table, the form the quantizer takes."""

    def __init__(self, model: Transformer, max_seq_len: int, return_hidden: bool):
        super().__init__()
        model = copy.deepcopy(model).float().eval()
        model.setup_cache(max_seq_len)  # rotary tables for max_seq_len positions
        half = model.config.head_dim // 2
        # onnxruntime rotates inside GroupQueryAttention only for head sizes that are multiples
        # of 16 (every real model's); others get the rotation as graph nodes.
        self.fused_rotary = model.config.head_dim % 16 == 0
        if self.fused_rotary:
            self.register_buffer("cos_cache", model.rope_cos[:, :half].contiguous())
            self.register_buffer("sin_cache", model.rope_sin[:, :half].contiguous())
        else:
            self.register_buffer("cos_table", model.rope_cos)
            self.register_buffer("sin_table", model.rope_sin)
        for layer in model.layers:
            layer.self_attn = GQAAttention(layer.self_attn, self.fused_rotary)
            layer.mlp = FusedMLP(layer.mlp)
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.lm_head = MatMulLinear(head)
        model.lm_head = None
        self.model, self.return_hidden = model, return_hidden

    def forward(self, tokens, input_pos, caches: list[torch.Tensor]):
        t = tokens.shape[1]
        seqlens_k = (input_pos + (t - 1)).to(torch.int32)
        total_len = (input_pos[0] + t).to(torch.int32)
        if self.fused_rotary:
            cos, sin = self.cos_cache, self.sin_cache
        else:
            positions = input_pos + torch.arange(t)
            cos = self.cos_table[positions][None, :, None]
            sin = self.sin_table[positions][None, :, None]
        attentions = [layer.self_attn for layer in self.model.layers]
        for a, k_cache, v_cache in zip(attentions, caches[0::2], caches[1::2], strict=True):
            a.past, a.seqlens_k, a.total_len = (k_cache, v_cache), seqlens_k, total_len
        hidden = self.model.hidden_states(tokens, None, cos, sin, None)
        present = [cache for a in attentions for cache in a.present]
        for a in attentions:
            a.past = a.present = a.seqlens_k = a.total_len = None
        logits = self.lm_head(hidden)
        return (logits, hidden, *present) if self.return_hidden else (logits, *present)


def cache_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]
    return past, [name.replace("past_", "present_") for name in past]


def export_program(
    model: Transformer,
    path: Path,
    *,
    quant: str,
    group_size: int,
    max_seq_len: int,
    max_chunk: int,
    return_hidden: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Export `model` to `path` (ONNX, quantized with `quant`) and return its manifest methods."""
    say = progress or (lambda _message: None)
    if not 2 <= max_chunk <= max_seq_len:
        raise UserError(
            f"the chunk size must be between 2 and --max-seq-len {max_seq_len}, got {max_chunk}"
        )
    c = model.config
    # Quantized graphs take at least 2 tokens per call (the session pads single tokens; see
    # _save_quantized), so their cache has one spare slot for the pad row at the last position.
    min_tokens = 1 if quant == "fp32" else 2
    positions = max_seq_len + min_tokens - 1
    wrapper = OnnxTarget(model, positions, return_hidden).eval()
    cache_shape = (1, c.num_kv_heads, positions, c.head_dim)
    past, present = cache_names(c.num_layers)
    caches = [torch.zeros(cache_shape) for _ in past]
    example = (torch.zeros((1, 2), dtype=torch.long), torch.zeros(1, dtype=torch.long), caches)
    dynamic = ({1: torch.export.Dim("T", min=1, max=max_chunk)}, None, [None] * len(caches))
    outputs = ["logits", "hidden"] if return_hidden else ["logits"]
    say(f"[export] torch.onnx (dynamo), T in 1..{max_chunk}, cache of {max_seq_len} positions")
    with torch.no_grad(), _quiet():
        program = torch.onnx.export(
            wrapper,
            example,
            dynamo=True,
            dynamic_shapes=dynamic,
            input_names=["tokens", "input_pos", *past],
            output_names=[*outputs, *present],
            custom_translation_table={
                torch.ops.mtp_edge.gqa.default: gqa_onnx,
                torch.ops.mtp_edge.gqa_rope.default: gqa_rope_onnx,
            },
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
    proto = _fuse_for_ort(program)
    onnx.helper.set_model_props(proto, {MIN_TOKENS: str(min_tokens)})
    _save_quantized(proto, Path(path), quant, group_size, say)
    vocab = c.vocab_size
    cache = {"shape": list(cache_shape), "dtype": "float32"}
    forward = {
        "inputs": [
            {"name": "tokens", "shape": [1, "T"], "dtype": "int64"},
            {"name": "input_pos", "shape": [1], "dtype": "int64"},
            *[{"name": name, **cache} for name in past],
        ],
        "outputs": [
            {"name": "logits", "shape": [1, "T", vocab], "dtype": "float32"},
            *[{"name": "hidden", "shape": [1, "T", c.hidden_size], "dtype": "float32"}]
            * return_hidden,
            *[{"name": name, **cache} for name in present],
        ],
        "dynamic_dims": {"T": [1, max_chunk]},
        "in_place": dict(zip(present, past, strict=True)),  # bind each pair to one buffer
        "min_tokens": min_tokens,
    }
    return {"forward": forward}


def _fuse_for_ort(program) -> onnx.ModelProto:
    """onnxscript's fusions for onnxruntime: each RMSNorm (and the residual add before it)
    becomes one (Skip)SimplifiedLayerNormalization node instead of seven elementwise ones,
    which onnxruntime does not fuse itself here. A decode step is short enough (a few ms) for
    per-node overhead to matter: the graph drops from ~1280 to ~850 nodes."""
    import onnx_ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    with _quiet():
        model, _ = optimize_for_ort(program.model)
    return onnx_ir.serde.serialize_model(model)


def _save_quantized(proto, path: Path, quant: str, group_size: int, say) -> None:
    """Quantize the exported graph's MatMul weights and write it to `path` as one file."""
    if quant in ("int4", "int8"):
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        bits = int(quant[3:])
        say(f"[quantize] {quant} MatMulNBits, block {group_size}")
        # accuracy_level 4: int8 activations (quantized per row) and integer dot products, the
        # fast CPU path. A call of one token takes another kernel path, whose logits differ by
        # up to 0.7 on SmolLM2-135M from those of the same token in a longer call; calls of 2+
        # tokens agree exactly row by row. So the session pads single-token calls to two
        # (min_tokens), and verifying k+1 tokens gives exactly what k+1 steps give: lossless.
        # (Level 1, fp32 activations, is consistent without padding but makes a 5-token call
        # 3x a 1-token call; onnxruntime's dynamic int8 quantization uses one activation scale
        # per tensor, so a token's logits depend on the other tokens of the call.)
        quantizer = MatMulNBitsQuantizer(
            proto, bits=bits, block_size=group_size, is_symmetric=True, accuracy_level=4
        )
        with _quiet():
            quantizer.process()
        proto = quantizer.model.model
    size = proto.ByteSize()
    if size >= 2**31:
        raise UserError(
            f"the {quant} ONNX graph is {size / 1e9:.1f} GB, over protobuf's 2 GB single-file "
            "limit: use --quant int4 or int8"
        )
    say(f"[write] {path.name} ({size / 1e6:.0f} MB)")
    onnx.save(proto, path)


@contextlib.contextmanager
def _quiet():
    """Keep the exporter's and the quantizer's chatter out of the progress lines: the quantizer
    logs every node at INFO level (and sets up the root logger to show it), the exporter's
    passes log at INFO and warn about optional packages and axis names."""
    names = ("onnxruntime.quantization", "onnx_ir", "onnxscript", "torch.onnx")
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*dynamic axes will not be renamed")
            yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


class MtpStep(nn.Module):
    def __init__(self, head: MTPHead, embedding: nn.Embedding):
        super().__init__()
        self.head, self.embedding = head, embedding

    def forward(self, h, token):
        return self.head.step(h, self.embedding(token))


class CacheMtpStep(nn.Module):
    """One step of a head that reads the target's cache: its K/V row goes to slot input_pos of
    the target's last-layer cache (past -> present, bound in place by the runtime) and its query
    attends to slots 0..input_pos, with the target's rotary tables."""

    def __init__(self, head: MTPHead, embedding: nn.Embedding, cos, sin):
        super().__init__()
        self.head, self.embedding = head, embedding
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)

    def forward(self, h, token, input_pos, past_key, past_value):
        a = self.head.blocks[0].cache_attn
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [1, hd]
        seqlens_k = input_pos.to(torch.int32)  # one new row at input_pos: total input_pos + 1
        total_len = (input_pos[0] + 1).to(torch.int32)
        present = []

        def attend(q, k, v):  # q [1, H, hd], k/v [1, KVH, hd]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out, k_cache, v_cache = gqa(
                q.reshape(1, 1, -1), k.reshape(1, 1, -1), v.reshape(1, 1, -1),
                past_key, past_value, seqlens_k, total_len, a.num_heads, a.num_kv_heads,
            )  # fmt: skip
            present.extend((k_cache, v_cache))
            return out.view(1, a.num_heads, a.head_dim)

        logits, next_h = self.head.step(h, self.embedding(token), attend)
        return logits, next_h, *present


def export_mtp_program(
    head: MTPHead,
    embedding: nn.Embedding,
    path: Path,
    quant: str,
    group_size: int,
    progress: Callable[[str], None] | None = None,
    *,
    target: Transformer | None = None,
    target_forward: dict | None = None,
) -> tuple[dict, dict]:
    """Write the head's graph (one draft step, static shapes, with its own copy of the embedding
    table) to `path`; returns (manifest methods, drafter settings).

    A head that reads the target's cache needs `target` (its rotary tables) and `target_forward`
    (the exported target's manifest method: the name and shape of its last-layer cache)."""
    say = progress or (lambda _message: None)
    d, vd = head.config.hidden_size, head.config.draft_vocab_size
    head_copy, embedding = copy.deepcopy(head).float(), copy.deepcopy(embedding).float()
    inputs = [
        {"name": "h", "shape": [1, d], "dtype": "float32"},
        {"name": "token", "shape": [1], "dtype": "int64"},
    ]
    outputs = [
        {"name": "draft_logits", "shape": [1, vd], "dtype": "float32"},
        {"name": "next_h", "shape": [1, d], "dtype": "float32"},
    ]
    example = (torch.zeros(1, d), torch.zeros(1, dtype=torch.long))
    translations = {}
    links = None
    if head.reads_target_cache:
        if target is None or target_forward is None:
            raise ValueError("a head that reads the target's cache needs the target and its method")
        last = target.config.num_layers - 1
        links = {"past_key": f"past_key_{last}", "past_value": f"past_value_{last}"}
        spec = next(i for i in target_forward["inputs"] if i["name"] == links["past_key"])
        cache = {"shape": list(spec["shape"]), "dtype": "float32"}
        angles = torch.outer(
            torch.arange(cache["shape"][2], dtype=torch.float64), rope_frequencies(target.config)
        )
        angles = torch.cat((angles, angles), dim=-1)
        step = CacheMtpStep(head_copy, embedding, angles.cos().float(), angles.sin().float())
        inputs += [
            {"name": "input_pos", "shape": [1], "dtype": "int64"},
            *[{"name": name, **cache} for name in ("past_key", "past_value")],
        ]
        outputs += [{"name": name, **cache} for name in ("present_key", "present_value")]
        zeros = torch.zeros(cache["shape"])
        example = (*example, torch.zeros(1, dtype=torch.long), zeros, zeros.clone())
        translations = {torch.ops.mtp_edge.gqa.default: gqa_onnx}
        what = f"reading the target's last-layer cache ({cache['shape'][2]} positions)"
    else:
        step = MtpStep(head_copy, embedding)
        what = "torch.onnx (dynamo)"
    step = step.eval()
    _transpose_linears(step)
    say(f"[export] drafter step, {what}")
    with torch.no_grad(), _quiet():
        program = torch.onnx.export(
            step,
            example,
            dynamo=True,
            input_names=[i["name"] for i in inputs],
            output_names=[o["name"] for o in outputs],
            custom_translation_table=translations or None,
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
    _save_quantized(_fuse_for_ort(program), Path(path), quant, group_size, say)
    forward = {"inputs": inputs, "outputs": outputs}
    settings = head_settings(head)
    if links is not None:
        # present_X is written in place of past_X, both bound to the target's cache `links[X]`
        forward.update(
            in_place={"present_key": "past_key", "present_value": "past_value"},
            target_cache=links,
        )
        settings["reads_target_cache"] = True
    return {"forward": forward}, settings


def check_heads(head: MTPHead, manifest: Manifest, reexport: str) -> None:
    """A heads-only update (exporter/update_heads.py) re-exports drafter.onnx: not for a self
    head, which no ONNX bundle runs yet."""
    if head.has_own_cache:
        raise UserError(
            "--target onnx does not run self-attending (EAGLE) MTP heads yet: pass heads "
            "trained with --attention none or target_cache"
        )


def export_heads(
    head: MTPHead,
    embedding: nn.Embedding,
    target: Transformer,
    manifest: Manifest,
    directory: Path,
    progress: Callable[[str], None],
) -> tuple[dict[str, ModelFile], dict]:
    """The drafter files of a heads-only update: drafter.onnx for `head`, quantized as the
    bundle's drafter was, binding the target's cache as its export did (the target's forward
    method in the manifest names it), and drafter_vocab.json."""
    old = manifest.models["drafter"]
    q = old.quant
    methods, settings = export_mtp_program(
        head,
        embedding,
        directory / old.file,
        q["scheme"],
        q["group_size"],
        progress,
        target=target,
        target_forward=manifest.models["target"].methods["forward"],
    )
    models = {
        "drafter": ModelFile(old.file, "", dict(q), methods),
        "drafter_vocab": draft_vocabulary(head, directory),
    }
    return models, settings


def check(job: ExportJob) -> None:
    """No self-attending heads yet (its weight schemes are the platform table's, checked by
    resolve_options)."""
    refuse_self_heads(job)


def export(job: ExportJob, directory: Path) -> tuple[dict[str, ModelFile], dict]:
    """target.onnx, and drafter.onnx for a draft model or an MTP head (a head that reads the
    target's cache binds it at run time: module doc)."""
    o, head, draft_model, target = job.options, job.head, job.draft_model, job.target.model
    quant = {"scheme": o.quant, "group_size": o.group_size, "embedding": "none"}  # fp32 table
    draft_quant = dict(quant, scheme=o.draft_quant, group_size=o.draft_group_size)

    def graph(
        model: Transformer, path: Path, scheme: str, group: int, return_hidden: bool = False
    ) -> dict:
        return export_program(
            model,
            path,
            quant=scheme,
            group_size=group,
            max_seq_len=job.max_seq_len,
            max_chunk=job.max_chunk,
            return_hidden=return_hidden,
            progress=job.progress,
        )

    methods = graph(
        target, directory / "target.onnx", o.quant, o.group_size, return_hidden=head is not None
    )
    models = {"target": ModelFile("target.onnx", "", quant, methods)}
    settings: dict = {}
    if draft_model is not None:
        methods = graph(
            draft_model.model, directory / "drafter.onnx", o.draft_quant, o.draft_group_size
        )
        models["drafter"] = ModelFile("drafter.onnx", "", draft_quant, methods)
    if head is not None:
        methods, settings = export_mtp_program(
            head,
            target.embed_tokens,
            directory / "drafter.onnx",
            o.draft_quant,
            o.draft_group_size,
            job.progress,
            target=target,  # a head that reads the target's cache binds it
            target_forward=models["target"].methods["forward"],
        )
        models["drafter"] = ModelFile("drafter.onnx", "", draft_quant, methods)
        models["drafter_vocab"] = draft_vocabulary(head, directory)
    return models, settings
