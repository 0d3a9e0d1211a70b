"""Export our Transformer (and its MTP drafter step) to one Core ML multifunction .mlpackage.

Functions, each with static shapes (flexible shapes keep a model off the Neural Engine):
- `prefill`: `max_chunk` tokens; `verify`: k+1 tokens; `decode`: 1 token. Each takes
  `tokens [1, W] int32, input_pos [1] int32` and returns `logits [1, W, vocab]` (and `hidden
  [1, W, D]` with an MTP drafter). Calls with fewer tokens than W are padded at the end: the pad
  rows land in cache slots after the real ones, which no real query reads before the next call
  overwrites them, exactly like rejected drafts.
- `draft_step` (MTP drafter): `h [1, D], token [1] int32 -> draft_logits [1, Vd], next_h [1, D]`.
  A head that reads the target's cache (mtp.py) also takes `input_pos [1] int32` and declares the
  target's cache states: it writes its K/V row into the last layer's cache at input_pos and
  attends to slots <= input_pos, as the target functions do (drafted positions lie past every
  verified one, and the next target call overwrites them before any of its queries reads them).
The KV cache is Core ML state (`k_cache_i` / `v_cache_i`, [1, kv_heads, max_seq_len, head_dim],
fp16), written in place with `slice_update` at input_pos; the three target functions (and a
cache-reading draft step) declare the same states and weights, and save_multifunction stores
identical weights once.
Minimum deployment target iOS 18 / macOS 15 (states, per-block int4). Compute is fp16.

The PyTorch modules traced here are themselves fp16 and written as Core ML computes (fp16 norms
guarded against overflow, additive fp16 mask), so running them in PyTorch is the reference the
tests hold against eager decoding on Linux, where Core ML itself cannot run.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import draft_vocabulary, head_settings, refuse_self_heads
from mtp_edge.manifest import ModelFile
from mtp_edge.model import Attention, RMSNorm, Transformer, rotate_half
from mtp_edge.mtp import MTPHead, apply_rope

if TYPE_CHECKING:
    from mtp_edge.exporter.platform import ExportJob

DTYPE = torch.float16
MASKED = -3e4  # additive mask in fp16: exp() of it underflows to 0


class Fp16RMSNorm(nn.Module):
    """RMSNorm in fp16 that cannot overflow: x is divided by max|x| before squaring (x^2 of an
    activation above 256 is beyond fp16's range). Mathematically the same norm."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        y = x / scale
        mean = y.pow(2).mean(-1, keepdim=True) + self.eps / (scale * scale)
        return self.weight * (y * torch.rsqrt(mean))


def fp16_copy(module: nn.Module) -> nn.Module:
    module = copy.deepcopy(module).to(DTYPE).eval()
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, RMSNorm):
                setattr(parent, name, Fp16RMSNorm(child))
    return module


class CoreMLAttention(nn.Module):
    """Attention on the cache state: the call's K/V rows go in place at `start` (slice_update;
    the calling function sets `start` for each call) and the queries attend to the whole cache
    under the additive fp16 mask. `k_cache` / `v_cache` are the functions' state tensors, which
    each function's module registers as buffers under the state names (programs)."""

    def __init__(self, attention: Attention, k_cache: torch.Tensor, v_cache: torch.Tensor):
        super().__init__()
        a = attention
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = a.q_proj, a.k_proj, a.v_proj, a.o_proj
        self.q_norm, self.k_norm = a.q_norm, a.k_norm
        self.k_cache, self.v_cache = k_cache, v_cache
        self.start: torch.Tensor | None = None

    def forward(self, x, positions, cos, sin, mask, kv_len):
        w, start = x.shape[1], self.start
        q = self.q_proj(x).view(1, w, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(1, w, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(1, w, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.k_cache[:, :, start : start + w] = k  # slice_update on the state, in place
        self.v_cache[:, :, start : start + w] = v
        groups = self.num_heads // self.num_kv_heads
        keys = self.k_cache.repeat_interleave(groups, dim=1)
        values = self.v_cache.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(1, w, -1))


class CoreMLTarget(nn.Module):
    """The target for a fixed width W: the model's forward, on the fp16 copy whose attention is
    CoreMLAttention. The caches are buffers (Core ML states), shared by passing the same
    `caches` to every width's module."""

    def __init__(self, model: Transformer, width: int, caches: list[torch.Tensor], hidden: bool):
        super().__init__()
        self.model, self.width, self.return_hidden = model, width, hidden
        for i in range(len(model.layers)):
            self.register_buffer(f"k_cache_{i}", caches[2 * i])
            self.register_buffer(f"v_cache_{i}", caches[2 * i + 1])

    def forward(self, tokens, input_pos):
        m, w = self.model, self.width
        positions = input_pos + torch.arange(w, dtype=torch.int32)
        cos = m.rope_cos[positions][None, None]
        sin = m.rope_sin[positions][None, None]
        slots = torch.arange(m.max_seq_len, dtype=torch.int32)
        mask = torch.where(slots[None, :] <= positions[:, None], 0.0, MASKED).to(DTYPE)
        start = input_pos[0]
        for layer in m.layers:
            layer.self_attn.start = start
        hidden = m.hidden_states(tokens, positions, cos, sin, mask)
        logits = m.logits(hidden)
        return (logits, hidden) if self.return_hidden else logits


class CoreMLDraftStep(nn.Module):
    """One step of an MLP-only head (attention "none"): no state."""

    def __init__(self, head: MTPHead, embedding: nn.Embedding):
        super().__init__()
        self.head, self.embedding = head, embedding

    def forward(self, h, token):
        return self.head.step(h.to(DTYPE), self.embedding(token))


class CoreMLCacheDraftStep(nn.Module):
    """One step of a head that reads the target's cache, at position input_pos.

    `model` is the fp16 target the target functions trace (its embedding table and rotary
    tables) and `caches` their cache tensors, registered under the same names so that the
    function declares the same states: its K/V row goes into the last layer's cache at
    input_pos (`slice_update`, as the target writes) and its query attends to slots
    <= input_pos with the target's additive fp16 mask."""

    def __init__(self, model: Transformer, head: MTPHead, caches: list[torch.Tensor]):
        super().__init__()
        self.model, self.head = model, head
        for i in range(len(model.layers)):
            self.register_buffer(f"k_cache_{i}", caches[2 * i])
            self.register_buffer(f"v_cache_{i}", caches[2 * i + 1])

    def forward(self, h, token, input_pos):
        m = self.model
        last = len(m.layers) - 1
        k_cache, v_cache = getattr(self, f"k_cache_{last}"), getattr(self, f"v_cache_{last}")
        cos, sin = m.rope_cos[input_pos], m.rope_sin[input_pos]  # [1, hd]
        slots = torch.arange(m.max_seq_len, dtype=torch.int32)
        mask = torch.where(slots[None, :] <= input_pos[:, None], 0.0, MASKED).to(DTYPE)
        start = input_pos[0]

        def attend(q, k, v):  # q [1, H, hd], k/v [1, KVH, hd]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache[:, :, start : start + 1] = k[:, :, None]  # slice_update on the state
            v_cache[:, :, start : start + 1] = v[:, :, None]
            groups = self.head.config.num_heads // self.head.config.num_kv_heads
            keys = k_cache.repeat_interleave(groups, dim=1)
            values = v_cache.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask)
            return out[:, :, 0]  # [1, H, hd]

        return self.head.step(h.to(DTYPE), m.embed_tokens(token), attend)


def widths(max_chunk: int, k: int) -> dict[str, int]:
    """Function name -> tokens per call."""
    return {"prefill": max_chunk, "verify": k + 1, "decode": 1}


def programs(
    model: Transformer,
    head: MTPHead | None,
    *,
    max_seq_len: int,
    max_chunk: int,
    k: int,
) -> dict[str, nn.Module]:
    """The fp16 PyTorch modules handed to the converter, by function name; the target functions
    (and a head's draft step that reads the target's cache) share one set of cache tensors, as
    the Core ML functions share their states."""
    target = fp16_copy(model)
    target.setup_cache(max_seq_len)  # rotary tables (fp16), and max_seq_len
    c = model.config
    shape = (1, c.num_kv_heads, max_seq_len, c.head_dim)
    caches = [torch.zeros(shape, dtype=DTYPE) for _ in range(2 * c.num_layers)]
    for i, layer in enumerate(target.layers):
        layer.self_attn = CoreMLAttention(layer.self_attn, caches[2 * i], caches[2 * i + 1])
    hidden = head is not None
    result = {
        name: CoreMLTarget(target, width, caches, hidden)
        for name, width in widths(max_chunk, k).items()
    }
    if head is not None and head.reads_target_cache:
        result["draft_step"] = CoreMLCacheDraftStep(target, fp16_copy(head), caches)
    elif head is not None:
        result["draft_step"] = CoreMLDraftStep(fp16_copy(head), fp16_copy(model.embed_tokens))
    return result


def draft_states(head: MTPHead | None) -> bool:
    """Whether the draft step declares (and writes) the target's cache states."""
    return head is not None and head.reads_target_cache


def _quantize(mlmodel, quant: str, group_size: int):
    from coremltools.optimize.coreml import (
        OpLinearQuantizerConfig,
        OptimizationConfig,
        linear_quantize_weights,
    )

    if quant == "fp16":
        return mlmodel
    if quant == "int4":
        op = OpLinearQuantizerConfig(
            mode="linear_symmetric",
            dtype="int4",
            granularity="per_block",
            block_size=group_size,
            weight_threshold=0,
        )
    else:
        op = OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=0
        )
    # The linear layers, the LM head and the embedding table (a tied head and the token gather
    # read one weight, which coremltools quantizes for all its uses or none); not the rotary
    # tables, which are gathered too.
    embedding_gathers = [
        o.name
        for function in mlmodel._mil_program.functions.values()
        for o in function.operations
        if o.op_type == "gather" and "embed" in o.x.name
    ]
    config = OptimizationConfig(
        op_type_configs={"linear": op}, op_name_configs=dict.fromkeys(embedding_gathers, op)
    )
    return linear_quantize_weights(mlmodel, config)


def _convert(module: nn.Module, manifest_io: dict, states: list):
    import coremltools as ct

    inputs = [
        ct.TensorType(name=i["name"], shape=tuple(i["shape"]), dtype=_NP[i["dtype"]])
        for i in manifest_io["inputs"]
    ]
    outputs = [ct.TensorType(name=o["name"], dtype=np.float32) for o in manifest_io["outputs"]]
    example = tuple(
        torch.zeros(i["shape"], dtype=_TORCH[i["dtype"]]) for i in manifest_io["inputs"]
    )
    with torch.no_grad():
        traced = torch.jit.trace(module.eval(), example, check_trace=False)
    return ct.convert(
        traced,
        inputs=inputs,
        outputs=outputs,
        states=states,
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
        convert_to="mlprogram",
        skip_model_load=True,
    )


@contextlib.contextmanager
def _unused_states_allowed():
    """Let a function declare states it does not touch (the draft step uses one layer's cache of
    the states every function declares, so that one MLState serves them all). coremltools'
    backend pass that makes unused inputs "used" wraps them in an identity op, which a state
    input cannot take: for the duration, the pass leaves state inputs alone."""
    from coremltools.converters.mil.backend.nn.passes import handle_unused_inputs as unused
    from coremltools.converters.mil.mil import types

    original = getattr(unused, "_handle_unused_inputs_func", None)
    if original is None:  # another coremltools: let the conversion say what it thinks
        yield
        return

    class WithoutStates:  # the function, as the pass sees it: inputs minus the states
        def __init__(self, function):
            self.function = function
            self.inputs = {
                n: v for n, v in function.inputs.items() if not types.is_state(v.sym_type)
            }

        def __enter__(self):
            return self.function.__enter__()

        def __exit__(self, *exc):
            return self.function.__exit__(*exc)

    unused._handle_unused_inputs_func = lambda function: original(WithoutStates(function))
    try:
        yield
    finally:
        unused._handle_unused_inputs_func = original


class _WithoutProgressBars:
    """stderr without tqdm bars ("...: 100%|███| 12/12 [00:01<00:00, 9.5 passes/s]", or "...: 0
    passes [00:00, ? passes/s]"): everything else (a warning, an error, also one written right
    after a bar on its line) passes through when its line ends."""

    BAR = re.compile(r"^.*?(\|\s*\d+/\d+|\d+ \w+) \[[^\]]*\]")

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, _, self.pending = self.pending.partition("\n")
            self._judge(line)
        return len(text)

    def _judge(self, line: str) -> None:
        shown = self.BAR.sub("", line.split("\r")[-1])  # the last redraw, its bar taken out
        if shown.strip():
            self.stream.write(shown + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        if self.pending:
            self._judge(self.pending)
            self.pending = ""


@contextlib.contextmanager
def _quiet():
    """coremltools draws a progress bar per pass (dozens per function) on stderr and logs
    warnings about tracing details (tuple outputs, state variables): keep them out of the way,
    but not its errors."""
    log = logging.getLogger("coremltools")
    level = log.level
    log.setLevel(logging.ERROR)
    filtered = _WithoutProgressBars(sys.stderr)
    try:
        with contextlib.redirect_stderr(filtered):
            yield
    finally:
        filtered.close()
        log.setLevel(level)


_NP = {"int32": np.int32, "float32": np.float32}
_TORCH = {"int32": torch.int32, "float32": torch.float32}


def function_io(name: str, model: Transformer, head: MTPHead | None, width: int | None) -> dict:
    """A function's inputs and outputs as the manifest records them."""
    c = model.config
    if name == "draft_step":
        d, vd = head.config.hidden_size, head.config.draft_vocab_size
        inputs = [
            {"name": "h", "shape": [1, d], "dtype": "float32"},
            {"name": "token", "shape": [1], "dtype": "int32"},
        ]
        if head.reads_target_cache:
            inputs.append({"name": "input_pos", "shape": [1], "dtype": "int32"})
        return {
            "inputs": inputs,
            "outputs": [
                {"name": "draft_logits", "shape": [1, vd], "dtype": "float32"},
                {"name": "next_h", "shape": [1, d], "dtype": "float32"},
            ],
        }
    outputs = [{"name": "logits", "shape": [1, width, c.vocab_size], "dtype": "float32"}]
    if head is not None:
        outputs.append({"name": "hidden", "shape": [1, width, c.hidden_size], "dtype": "float32"})
    return {
        "inputs": [
            {"name": "tokens", "shape": [1, width], "dtype": "int32"},
            {"name": "input_pos", "shape": [1], "dtype": "int32"},
        ],
        "outputs": outputs,
    }


def export_package(
    model: Transformer,
    head: MTPHead | None,
    path: Path,
    *,
    quant: str,
    draft_quant: str,
    group_size: int,
    max_seq_len: int,
    max_chunk: int,
    k: int,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, dict]:
    """Convert, quantize and save the multifunction package at `path`; returns (manifest
    methods, drafter settings)."""
    import coremltools as ct

    say = progress or (lambda _message: None)
    if k + 1 > max_chunk or not 2 <= max_chunk <= max_seq_len:
        raise UserError(
            f"Core ML needs k+1 <= chunk <= --max-seq-len: got k {k}, chunk {max_chunk}, "
            f"max-seq-len {max_seq_len}"
        )
    c = model.config
    cache = {"shape": [1, c.num_kv_heads, max_seq_len, c.head_dim], "dtype": "float16"}
    state_names = [f"{kv}_cache_{i}" for i in range(c.num_layers) for kv in ("k", "v")]
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=tuple(cache["shape"]), dtype=np.float16),
                     name=name)
        for name in state_names
    ]  # fmt: skip
    modules = programs(model, head, max_seq_len=max_seq_len, max_chunk=max_chunk, k=k)
    sizes = widths(max_chunk, k)
    methods: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        descriptor = ct.utils.MultiFunctionDescriptor()
        for name, module in modules.items():
            spec = function_io(name, model, head, sizes.get(name))
            started = time.perf_counter()
            say(f"[convert] Core ML function {name}")
            scheme = draft_quant if name == "draft_step" else quant
            block = f", block {group_size}" if scheme == "int4" else ""
            say(f"[quantize] {name}: {scheme}{block}")
            part = Path(tmp) / f"{name}.mlpackage"
            stateful = name != "draft_step" or draft_states(head)
            with _quiet(), _unused_states_allowed():
                mlmodel = _convert(module, spec, states if stateful else [])
                _quantize(mlmodel, scheme, group_size).save(str(part))
            descriptor.add_function(str(part), src_function_name="main", target_function_name=name)
            methods[name] = {**spec, "seconds": round(time.perf_counter() - started, 1)}
            if stateful:
                methods[name]["states"] = [{"name": s, **cache} for s in state_names]
        descriptor.default_function_name = "decode"
        say(f"[write] {path.name}")
        staging = Path(tmp) / path.name
        with _quiet():
            ct.utils.save_multifunction(descriptor, str(staging))
        shutil.move(str(staging), str(path))
    settings: dict = {"functions": sizes}
    if head is not None:
        settings.update(head_settings(head))
        if head.reads_target_cache:  # its function writes the target's last-layer cache state
            settings["reads_target_cache"] = True
    return methods, settings


def check(job: ExportJob) -> None:
    """No separate draft model and no self-attending heads (its weight schemes are the platform
    table's, checked by resolve_options)."""
    if job.drafter_kind == "draft-lm":
        raise UserError(
            "--target coreml carries no separate draft model yet: use --drafter mtp or ngram"
        )
    refuse_self_heads(job)


def export(job: ExportJob, directory: Path) -> tuple[dict[str, ModelFile], dict]:
    """One package, model.mlpackage: the target functions and the head's draft step."""
    o, head = job.options, job.head
    quant = {"scheme": o.quant, "group_size": o.group_size, "embedding": "none"}  # fp16 table
    methods, settings = export_package(
        job.target.model,
        head,
        directory / "model.mlpackage",
        quant=o.quant,
        draft_quant=o.draft_quant,
        group_size=o.group_size,
        max_seq_len=job.max_seq_len,
        max_chunk=job.max_chunk,
        k=o.k,
        progress=job.progress,
    )
    models = {"target": ModelFile("model.mlpackage", "", quant, methods)}
    if head is not None:
        models["drafter_vocab"] = draft_vocabulary(head, directory)
    return models, settings
