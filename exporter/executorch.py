"""Export our Transformer to an ExecuTorch program for XNNPACK, in ExecuTorch's LLM conventions,
so that ExecuTorch's own runner (TextLLMRunner) can run it too:

- `forward(tokens [1, T] int64, input_pos [1] int64) -> logits [1, T, vocab] float32`, with T
  dynamic in 1..max_chunk: prefill chunks and the verification of k+1 drafted tokens are the
  same method;
- the KV cache is a pair of mutable buffers per layer in the layout of ExecuTorch's custom ops,
  [1, max_seq_len, kv_heads, head_dim], written in place by `llama.update_cache`; attention reads
  for a query at position p only the slots <= p. The slots of rejected drafts are never read and
  the next call overwrites them: rollback costs nothing;
- constant methods carrying the metadata the runner reads (max_seq_len, vocab size, eos ids...);
- with an MTP drafter, forward also writes the call's hidden states into a buffer and a
  `last_hidden() -> hidden [1, max_chunk, D]` method returns it (WithHidden): forward keeps the
  one output stock runners read, and no weight is held twice;
- with a drafter and ExecuTorch's attention kernel, a `verify(tokens [1, W], input_pos [1])`
  method sharing forward's KV cache, for checking k+1 = W tokens. Speculative output must equal
  plain output token for token, so each row of a verify must be bitwise what a one-token
  forward computes at that position. XNNPACK's
  linear layers are row-independent (also with dynamically quantized activations: each row has
  its own scale); attention decides the rest. ExecuTorch's `llama.custom_sdpa` is not
  row-exact: a W-row call computes every row's scores over the keys of the whole block and in
  different tiles, so rows move by a few ulps, and in a quantized model an ulp that crosses an
  int8 rounding step grows, layer by layer, into logits that differ by whole units (measured on
  SmolLM2-135M 8da4w: the argmax differed at 10% of positions). So the programs call our own op,
  `mtp_edge::sdpa` (mtp_edge/ops.py, kernel in runtime/native/src/llama_ops.cpp),
  which computes each row alone: a W-row call of `forward` is row-exact, so these programs need
  no `verify` method (export_program still adds one when asked, for measuring). With
  `attention_kernel="executorch"` (for ExecuTorch's stock runners, which carry only its own ops)
  the programs call `llama.custom_sdpa`, and `verify` calls it once per row, as the one-token
  call does;
- with an MTP head that reads the target's cache (mtp.py), a `draft(h [1, D], token [1],
  input_pos [1]) -> (draft_logits [1, Vd], next_h [1, D])` method: one draft step, run inside the
  target's program so that it reads (and writes, past the verified positions) the last layer's
  cache that forward and verify share, and the embedding table they use.

model.py is not changed for export: `exportable_copy` swaps, on a copy of the model, each
attention and norm for an export version made of ExecuTorch's custom ops and of ops that XNNPACK
takes whole, so that each layer lowers as one XNNPACK call around the two cache ops. In the
schemes whose linears are our own kernels (8da8w-avx2, 8da4w-mix-avx2) the linears cut every
layer into ~5 XNNPACK calls of a few element-wise ops each, and a call's fixed cost outweighed its
work: there the norms, the rotary embedding and SwiGLU are our ops (mtp_edge::rms_norm, rope,
swiglu), and a program with no product left for XNNPACK is lowered without it (`needs_xnnpack`).

Any other MTP head is a program of its own, drafter.pte, one recurrent draft step per call:
`forward(h [1, D] float32, token [1] int64) -> (draft_logits [1, Vd], next_h [1, D])`, static
shapes. A "self" (EAGLE) head carries its own KV cache as mutable buffers and takes a chunk:
`forward(h [1, T, D], tokens [1, T], input_pos [1]) -> (draft_logits [1, Vd], next_h [1, D])` of
the last row, T dynamic in 1..max_chunk, `input_pos` the position of tokens[0] (its K/V go to
slot input_pos - 1, mtp.py); attention is llama.update_cache and our mtp_edge::sdpa, as in the
target. The program carries its own (quantized) copy of the target's embedding table, because an
ExecuTorch program cannot read another program's weights; the per-step cost stays that of the
head alone (the table is only indexed).

`check` and `export` at the end are this platform's entry points for the bundle writer
(platform.py): target.pte, and drafter.pte for a draft model or a head outside the target.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers torch.ops.llama)
import torch
import torch.nn.functional as F
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import (
    EdgeCompileConfig,
    ExecutorchBackendConfig,
    to_edge_transform_and_lower,
)
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass
from torch import nn

from mtp_edge import ops
from mtp_edge.checkpoints import PartHook
from mtp_edge.config import ModelConfig
from mtp_edge.errors import UserError
from mtp_edge.exporter.platform import draft_vocabulary, head_settings
from mtp_edge.logs import estimated_stage
from mtp_edge.manifest import Manifest, ModelFile
from mtp_edge.model import MLP, Attention, RMSNorm, Transformer, rope_frequencies
from mtp_edge.mtp import MTPHead, SwiGLU
from mtp_edge.platforms import OWN_KERNEL_SCHEMES
from mtp_edge.quantize.schemes import (
    QuantScheme,
    check_scheme,
    quantize_model,
    quantize_modules,
    quantize_part,
)

if TYPE_CHECKING:
    from mtp_edge.exporter.platform import ExportJob

ops.define()  # torch.ops.mtp_edge.sdpa

# Which attention kernel the programs call: "mtp" (ours, mtp_edge::sdpa: row-exact, so a
# verification is one call) or "executorch" (llama.custom_sdpa, which ExecuTorch's stock
# runners carry; then `verify` calls it once per row).
ATTENTION_KERNELS = ("mtp", "executorch")


def sdpa(q, k_cache, v_cache, start, kernel: str):
    """Causal attention of q [1, T, H, hd] over the caches from position `start`."""
    if kernel == "mtp":
        return torch.ops.mtp_edge.sdpa(q, k_cache, v_cache, start)
    return torch.ops.llama.custom_sdpa(q, k_cache, v_cache, start, None, 0.0, True)


class CustomOpAttention(nn.Module):
    """Our Attention (same projections and norms) on ExecuTorch's cache-update and SDPA ops."""

    def __init__(
        self, attention: Attention, max_seq_len: int, kernel: str = "mtp", own_glue: bool = False
    ):
        super().__init__()
        a = attention
        self.kernel, self.own_glue = kernel, own_glue
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = a.q_proj, a.k_proj, a.v_proj, a.o_proj
        self.q_norm, self.k_norm = a.q_norm, a.k_norm
        self.max_seq_len = max_seq_len
        self.rows_apart = False  # set while exporting the `verify` method
        shape = (1, max_seq_len, a.num_kv_heads, a.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        if own_glue:
            return
        # rotate_half as a matrix: XNNPACK cannot split a tensor of dynamic length, but it takes
        # a linear layer, and multiplying by 0 and +-1 is exact.
        half = a.head_dim // 2
        rotate = torch.zeros(a.head_dim, a.head_dim)
        rotate[:half, half:] = -torch.eye(half)
        rotate[half:, :half] = torch.eye(half)
        self.register_buffer("rotate", rotate, persistent=False)

    def forward(self, x, positions, cos, sin, mask, kv_len):
        # Reshapes name the dynamic length -1: XNNPACK takes no symbolic sizes in a reshape.
        t = x.shape[1]
        q = self.q_proj(x).view(1, -1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(1, -1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(1, -1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, cos, sin)
        start = positions[0].item()
        torch._check(start >= 0)
        torch._check(start + t <= self.max_seq_len)
        torch.ops.llama.update_cache(k, self.k_cache, start)
        torch.ops.llama.update_cache(v, self.v_cache, start)
        if self.rows_apart and self.kernel == "executorch":
            # One single-query SDPA per row: bitwise what a one-token call computes (module doc).
            rows = [
                sdpa(q[:, r : r + 1], self.k_cache, self.v_cache, start + r, self.kernel)
                for r in range(t)
            ]
            out = torch.cat(rows, 1)
        else:  # our kernel computes each row alone: one call is row-exact
            out = sdpa(q, self.k_cache, self.v_cache, start, self.kernel)
        return self.o_proj(out.view(1, -1, self.num_heads * self.head_dim))

    def rotary(self, q, k, cos, sin):
        """q [1, T, H, hd] and k [1, T, KVH, hd] rotated by the rows of cos and sin (T x hd)."""
        if self.own_glue:
            cos, sin = cos.reshape(-1, self.head_dim), sin.reshape(-1, self.head_dim)
            return torch.ops.mtp_edge.rope(q, cos, sin), torch.ops.mtp_edge.rope(k, cos, sin)
        cos, sin = cos.view(1, -1, 1, self.head_dim), sin.view(1, -1, 1, self.head_dim)
        q = q * cos + F.linear(q, self.rotate) * sin
        k = k * cos + F.linear(k, self.rotate) * sin
        return q, k


class MatmulRMSNorm(nn.Module):
    """RMSNorm whose mean over the features is a product with a [1, D] row of 1/D.

    XNNPACK's mean takes only 4-D inputs reduced over the last two dims, and reshaping there and
    back with a dynamic length leaves reshapes it refuses: a plain mean would run outside the
    delegate and cut every layer into several XNNPACK calls. A linear layer stays inside.
    """

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        dim = norm.weight.shape[0]
        self.register_buffer("average", torch.full((1, dim), 1.0 / dim), persistent=False)

    def forward(self, x):
        mean = F.linear(x.pow(2), self.average)
        return self.weight * (x * torch.rsqrt(mean + self.eps))


class OwnRMSNorm(nn.Module):
    """RMSNorm as our op, mtp_edge::rms_norm: one call, outside any delegate."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        return torch.ops.mtp_edge.rms_norm(x, self.weight, self.eps)


class OwnSwiGLU(nn.Module):
    """down(silu(gate(x)) x up(x)) with silu(.) x . as our op, mtp_edge::swiglu."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.down_proj(torch.ops.mtp_edge.swiglu(self.gate_proj(x), self.up_proj(x)))


def own_glue(scheme: QuantScheme) -> bool:
    """Whether the programs of `scheme` do the element-wise work between linears in our ops:
    where every layer's linears are our kernels (module doc)."""
    return scheme.linear in OWN_KERNEL_SCHEMES


def with_export_norms(module: nn.Module, own: bool = False) -> nn.Module:
    """Every RMSNorm in `module` as its export version; with `own`, the norms and the SwiGLU
    MLPs as our ops."""
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if isinstance(child, RMSNorm):
                setattr(parent, name, OwnRMSNorm(child) if own else MatmulRMSNorm(child))
            elif own and isinstance(child, MLP | SwiGLU):
                setattr(parent, name, OwnSwiGLU(child))
    return module


def exportable_copy(
    model: Transformer, scheme: QuantScheme, max_seq_len: int, kernel: str = "mtp"
) -> Transformer:
    """A quantized copy of `model` with export attention and norms (model is untouched). The
    copy shares the weights: parts already quantized (`load_hook`) are not quantized again, and
    quantizing the others gives the copy new tensors, never a float copy of the model."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    model = copy.deepcopy(model, shared).eval()
    if model.dtype != torch.float32:
        model.float()
    model.setup_cache(max_seq_len)  # rotary tables for max_seq_len positions
    quantize_model(model, scheme)
    own = own_glue(scheme)
    for layer in model.layers:
        layer.self_attn = CustomOpAttention(layer.self_attn, max_seq_len, kernel, own)
    return with_export_norms(model, own)


class DraftMethod(nn.Module):
    """One step of a cache-reading MTP head, as a method of the target's program.

    `model` is the very module forward exports (so the cache buffers have the same names and
    the program shares them between methods); the head writes its K/V at `input_pos` in the
    last layer's cache and attends to the slots up to it, with the ops forward uses."""

    def __init__(self, model: Transformer, head: MTPHead):
        super().__init__()
        self.model, self.head = model, head

    def forward(self, h, token, input_pos):
        attention = self.model.layers[-1].self_attn
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start < attention.max_seq_len)
        cos = self.model.rope_cos[input_pos].view(1, 1, dim)
        sin = self.model.rope_sin[input_pos].view(1, 1, dim)

        def attend(q, k, v):  # q [1, H, hd], k/v [1, KVH, hd]
            q, k = attention.rotary(q.view(1, 1, heads, dim), k.view(1, 1, kv_heads, dim), cos, sin)
            torch.ops.llama.update_cache(k, attention.k_cache, start)
            torch.ops.llama.update_cache(v.view(1, 1, kv_heads, dim), attention.v_cache, start)
            out = sdpa(q, attention.k_cache, attention.v_cache, start, attention.kernel)
            return out.view(1, heads, dim)

        return self.head.step(h, self.model.embed_tokens(token), attend)


def draft_head_copy(head: MTPHead, scheme: QuantScheme, own: bool = False) -> MTPHead:
    """A quantized copy of `head` for export; `own`: its glue in our ops, as the target's."""
    head = copy.deepcopy(head).float().eval()
    quantize_modules(head, QuantScheme(scheme.linear, scheme.group_size, "none"))
    return with_export_norms(head, own)


def metadata_methods(
    model: Transformer, max_seq_len: int, max_chunk: int, bos_id: int | None, eos_ids: list[int]
) -> dict:
    """The constant methods ExecuTorch's LLM runner reads. In its terms `max_seq_len` is the
    most tokens one forward call takes (it prefills in chunks of that size) and
    `max_context_len` the positions the cache holds, our max_seq_len."""
    methods = {
        "get_max_seq_len": max_chunk,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": model.config.vocab_size,
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
    }
    if bos_id is not None:
        methods["get_bos_id"] = int(bos_id)
    if eos_ids:
        methods["get_eos_ids"] = [int(i) for i in eos_ids]
    return methods


# Bars of silent stages: (fixed, per layer) s a method, measured here (2-core VM, 8da8w, cache 2048;
# random llamas of 2/8/12 layers, 0.07/7.9/47M params: lowering 15/42/65 s a method, export 1-8 s).
# Layers predict it (4.2 + 5.0 s a layer); parameters do not (3.5 s/M up to 8 layers, then 0.6).
# Without XNNPACK (our kernels' schemes, 2026-12-07): 28-34 s for 24-30 layers whatever the
# methods (a 0.5B, a 1.5B shape, the default model with its draft method).
RATES = {"export": (1.0, 0.5), "lower": (4.2, 5.0), "lower-own": (4.0, 1.0)}


def estimate_s(stage: str, model: Transformer, methods: int = 1) -> float:
    fixed, per_layer = RATES[stage]
    return methods * (fixed + per_layer * model.config.num_layers)


# Products XNNPACK takes (aten ops after export; quantized linears are aten.linear on dequantized
# weights there). Our linears and glue ops are not among them.
_PRODUCTS = {"linear", "mm", "addmm", "bmm", "matmul", "convolution"}


def needs_xnnpack(programs) -> bool:
    """Whether any of the exported programs (one, or a dict by method name) has a product for
    XNNPACK. Without one, a delegate would get only element-wise ops and reshapes, a call of
    fixed cost (~9 us on an x86 core) for a few microseconds of work each, between our ops."""
    for program in programs.values() if isinstance(programs, dict) else [programs]:
        for node in program.graph.nodes:
            name = str(node.target).split(".")
            if node.op == "call_function" and name[0] == "aten" and name[1] in _PRODUCTS:
                return True
    return False


def lower(programs, constants: dict | None = None, share_mutable_buffers: bool = False):
    """Lower exported programs (one, or a dict by method name) for XNNPACK: the ExecuTorch
    program, to be written with `write_program` (its `.buffer` joins the .pte in memory)."""
    edge = to_edge_transform_and_lower(
        programs,
        # One partitioner for quantized and float ops alike. ExecuTorch's LLM recipe runs
        # XnnpackDynamicallyQuantizedPartitioner first, which puts every linear layer in a
        # delegate of its own; then each layer costs ~10 XNNPACK calls instead of two, and
        # lowering takes minutes longer.
        partitioner=[XnnpackPartitioner()] if needs_xnnpack(programs) else [],
        compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
        constant_methods=constants,
    )
    program = edge.to_executorch(
        ExecutorchBackendConfig(
            extract_delegate_segments=True,
            do_quant_fusion_and_const_prop=True,  # fuses the embedding into embedding_byte
            # The KV cache buffers get planned memory that lives as long as the loaded method;
            # inputs are the caller's tensors, not copied into the arena.
            memory_planning_pass=MemoryPlanningPass(
                alloc_graph_input=False, share_mutable_buffers=share_mutable_buffers
            ),
            emit_mutable_buffer_names=True,
            # Plan for the largest T, not the example's.
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        )
    )
    return program


def write_program(program, path) -> int:
    """Write a lowered program's .pte piece by piece, as serialization holds it: joining it into
    one bytes object first (`.buffer`) would hold the whole program a second time at the export's
    peak. Returns the bytes written."""
    with open(path, "wb") as f:
        program.write_to_file(f)
    return Path(path).stat().st_size


def export_program(
    model: Transformer,
    path: Path,
    *,
    quant: str,
    group_size: int,
    embedding_quant: str,
    max_seq_len: int,
    max_chunk: int,
    bos_id: int | None,
    eos_ids: list[int],
    embedding_group_size: int = 0,
    head_quant: str | None = None,
    head_group_size: int | None = None,
    return_hidden: bool = False,
    verify_width: int = 0,
    draft_head: MTPHead | None = None,
    draft_scheme: QuantScheme | None = None,
    attention_kernel: str = "mtp",
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Quantize a copy of `model`, export it to an XNNPACK .pte at `path` (written at the very
    end) and return its methods for the bundle manifest.

    `head_quant` / `head_group_size` give the LM head its own scheme (default: the linear one).
    `verify_width` W > 0 adds the row-exact `verify` method for W tokens (see the module doc).
    `draft_head` (a head that reads the target's cache) adds the `draft` method, quantized with
    `draft_scheme`. `attention_kernel`: one of ATTENTION_KERNELS.
    """
    say = progress or (lambda _message: None)
    scheme = QuantScheme(
        quant, group_size, embedding_quant, embedding_group_size, head_quant, head_group_size
    )
    check_scheme(scheme, model)
    if not 2 <= max_chunk <= max_seq_len:
        raise UserError(
            f"the chunk size must be between 2 and --max-seq-len {max_seq_len}, got {max_chunk}"
        )
    say(f"[quantize] {scheme.label()}")
    if attention_kernel not in ATTENTION_KERNELS:
        raise UserError(
            f"unknown attention kernel {attention_kernel!r}: use one of "
            + ", ".join(ATTENTION_KERNELS)
        )
    exportable = exportable_copy(model, scheme, max_seq_len, attention_kernel)
    if return_hidden:
        exportable = WithHidden(exportable, max_chunk)
    constants = metadata_methods(model, max_seq_len, max_chunk, bos_id, eos_ids)
    example = (torch.zeros((1, 2), dtype=torch.long), torch.zeros(1, dtype=torch.long))
    dynamic = ({1: torch.export.Dim("T", min=1, max=max_chunk)}, None)
    say(f"[export] torch.export, T in 1..{max_chunk}, cache of {max_seq_len} positions")
    if not 0 <= verify_width <= max_chunk:
        raise UserError(f"the verify width must be in 0..{max_chunk}, got {verify_width}")
    tracing = estimate_s("export", model)
    with torch.no_grad(), estimated_stage("exporting forward", tracing, "finishing: tracing"):
        programs = {
            "forward": torch.export.export(exportable, example, dynamic_shapes=dynamic, strict=True)
        }
    with torch.no_grad():
        if verify_width:
            rows = "one call" if attention_kernel == "mtp" else "row by row"
            say(f"[export] verify, {verify_width} tokens, attention {rows}")
            for attention in exportable.modules():
                if isinstance(attention, CustomOpAttention):
                    attention.rows_apart = True
            wide = (torch.zeros((1, verify_width), dtype=torch.long), example[1])
            with estimated_stage("exporting verify", tracing, "finishing: tracing"):
                programs["verify"] = torch.export.export(exportable, wide, strict=True)
        if return_hidden:
            programs["last_hidden"] = torch.export.export(LastHidden(exportable), (), strict=True)
        if draft_head is not None:
            say(f"[export] draft step ({draft_scheme.label()}), reading the last layer's cache")
            inner = exportable.model if isinstance(exportable, WithHidden) else exportable
            step = DraftMethod(inner, draft_head_copy(draft_head, draft_scheme, own_glue(scheme)))
            d = model.config.hidden_size
            draft_example = (torch.zeros(1, d), torch.zeros(1, dtype=torch.long), example[1])
            programs["draft"] = torch.export.export(step, draft_example, strict=True)
        xnnpack = needs_xnnpack(programs)
        backend = "XNNPACK" if xnnpack else "our kernels, no XNNPACK"
        say(f"[lower] {backend}")
        # verify (and draft) write the cache forward reads: one allocation for all
        lowering = (
            estimate_s("lower", model, len(programs)) if xnnpack else estimate_s("lower-own", model)
        )
        with estimated_stage(f"lowering ({backend})", lowering, "finishing: lowering, serializing"):
            program = lower(programs, constants, share_mutable_buffers=True)
    written = write_program(program, path)
    del program
    say(f"[write] {path} ({written / 1e6:.0f} MB)")
    methods = method_metadata(model, max_chunk, constants, verify_width)
    if draft_head is not None:
        d, vd = model.config.hidden_size, draft_head.config.draft_vocab_size
        methods["draft"] = {
            "inputs": [
                {"name": "h", "shape": [1, d], "dtype": "float32"},
                {"name": "token", "shape": [1], "dtype": "int64"},
                {"name": "input_pos", "shape": [1], "dtype": "int64"},
            ],
            "outputs": [
                {"name": "draft_logits", "shape": [1, vd], "dtype": "float32"},
                {"name": "next_h", "shape": [1, d], "dtype": "float32"},
            ],
        }
    if return_hidden:
        methods["last_hidden"] = {
            "inputs": [],
            "outputs": [
                {
                    "name": "hidden",
                    "shape": [1, max_chunk, model.config.hidden_size],
                    "dtype": "float32",
                }
            ],
        }
    return methods


class WithHidden(nn.Module):
    """forward returning the logits alone, as stock runners (TextLLMRunner) expect, and
    writing the call's final-normed hidden states (what an MTP drafter reads) into the buffer
    `hidden_rows` [1, max_chunk, 1, D], rows 0..T-1, which the `last_hidden` method returns
    (LastHidden). The buffer is a mutable buffer shared by both methods, like the KV cache:
    no copy of any weight."""

    def __init__(self, model: Transformer, max_chunk: int):
        super().__init__()
        self.model = model
        shape = (1, max_chunk, 1, model.config.hidden_size)
        self.register_buffer("hidden_rows", torch.zeros(shape), persistent=False)

    def forward(self, tokens, input_pos):
        logits, hidden = self.model(tokens, input_pos, return_hidden=True)
        torch.ops.llama.update_cache(hidden.unsqueeze(2), self.hidden_rows, 0)
        return logits


class LastHidden(nn.Module):
    """`last_hidden() -> hidden [1, max_chunk, D]`: the rows the last forward (or verify) call
    wrote, row i for its token i; rows past that call's T are stale. It writes its first row
    back unchanged, so that the buffer is mutable here too and the program shares it with
    forward (a buffer a method only reads would be frozen into it as a constant)."""

    def __init__(self, owner: WithHidden):
        super().__init__()
        self.register_buffer("hidden_rows", owner.hidden_rows, persistent=False)

    def forward(self):
        rows = self.hidden_rows.clone()
        torch.ops.llama.update_cache(rows[:, :1], self.hidden_rows, 0)
        return rows.squeeze(2)


def method_metadata(
    model: Transformer, max_chunk: int, constants: dict, verify_width: int = 0
) -> dict:
    vocab = model.config.vocab_size

    def tokens_method(width) -> dict:
        return {
            "inputs": [
                {"name": "tokens", "shape": [1, width], "dtype": "int64"},
                {"name": "input_pos", "shape": [1], "dtype": "int64"},
            ],
            "outputs": [{"name": "logits", "shape": [1, width, vocab], "dtype": "float32"}],
        }

    methods = {"forward": dict(tokens_method("T"), dynamic_dims={"T": [1, max_chunk]})}
    if verify_width:
        methods["verify"] = tokens_method(verify_width)
    for name, value in constants.items():
        values = value if isinstance(value, list) else [value]
        dtype = "bool" if isinstance(values[0], bool) else "int64"
        outputs = [
            {"name": f"{name}[{i}]", "shape": [], "dtype": dtype} for i in range(len(values))
        ]
        methods[name] = {"inputs": [], "outputs": outputs, "value": value}
    return methods


class MtpStep(nn.Module):
    def __init__(self, head: MTPHead, embedding: nn.Embedding):
        super().__init__()
        self.head, self.embedding = head, embedding

    def forward(self, h: torch.Tensor, token: torch.Tensor):
        return self.head.step(h, self.embedding(token))


class SelfHeadChunk(nn.Module):
    """A self head over a chunk of T rows with its cache in buffers (module doc). Its own
    forward rather than head.step: T rows in, and the LM head runs on the last row only."""

    def __init__(self, head: MTPHead, embedding: nn.Embedding, rope: ModelConfig, max_len: int):
        super().__init__()
        self.head, self.embedding = head, embedding
        block = head.blocks[0]
        self.attention = CustomOpAttention(block.cache_attn, max_len)
        block.cache_attn = None  # run below, with the cache ops
        angles = torch.outer(torch.arange(max_len + 1, dtype=torch.float64), rope_frequencies(rope))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, input_pos: torch.Tensor):
        head, first = self.head, self.head.blocks[0]
        positions = input_pos + torch.arange(tokens.shape[1])
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = head.proj(torch.cat((head.hnorm(h), head.enorm(self.embedding(tokens))), dim=-1))
        x = x + self.attention(first.attn_norm(x), positions - 1, cos, sin, None, None)
        x = x + first.mlp(first.norm(x))
        for block in head.blocks[1:]:
            x = block(x)
        last = x[:, -1]
        return head.lm_head(head.final_norm(last)), last


def export_mtp_program(
    head: MTPHead,
    embedding: nn.Embedding,
    path: Path,
    scheme: QuantScheme,
    progress: Callable[[str], None] | None = None,
    rope: ModelConfig | None = None,
    max_seq_len: int = 0,
    max_chunk: int = 0,
) -> tuple[dict, dict]:
    """Write the head's own program (module doc) to `path`; returns (manifest methods, drafter
    settings). A self head also needs the target's config (`rope`: its rotary embedding), the
    cache length and the longest chunk."""
    say = progress or (lambda _message: None)
    own = head.has_own_cache
    if own:
        step = SelfHeadChunk(
            copy.deepcopy(head).float().eval(), copy.deepcopy(embedding).float(), rope, max_seq_len
        )
    else:
        step = MtpStep(copy.deepcopy(head).float().eval(), copy.deepcopy(embedding).float())
    say(f"[quantize] drafter {scheme.label()}")
    quantize_modules(step, scheme)
    with_export_norms(step)
    d = head.config.hidden_size
    example = (torch.zeros(1, d), torch.zeros(1, dtype=torch.long))
    dynamic = None
    if own:
        example = (torch.zeros(1, 2, d), torch.zeros(1, 2, dtype=torch.long), torch.ones(1).long())
        chunk = torch.export.Dim("T", min=1, max=max_chunk)
        dynamic = ({1: chunk}, {1: chunk}, None)
    say("[export] drafter step" + (f", T in 1..{max_chunk}, own cache" if own else ""))
    with torch.no_grad():
        exported = torch.export.export(step, example, dynamic_shapes=dynamic, strict=True)
        say("[lower] drafter, XNNPACK")
        write_program(lower(exported), path)
    vd = head.config.draft_vocab_size
    outputs = [
        {"name": "draft_logits", "shape": [1, vd], "dtype": "float32"},
        {"name": "next_h", "shape": [1, d], "dtype": "float32"},
    ]
    settings = head_settings(head)
    if own:
        forward = {
            "inputs": [
                {"name": "h", "shape": [1, "T", d], "dtype": "float32"},
                {"name": "tokens", "shape": [1, "T"], "dtype": "int64"},
                {"name": "input_pos", "shape": [1], "dtype": "int64"},
            ],
            "outputs": outputs,
            "dynamic_dims": {"T": [1, max_chunk]},
        }
        settings.update(own_cache=True, max_chunk=max_chunk)
    else:
        forward = {
            "inputs": [
                {"name": "h", "shape": [1, d], "dtype": "float32"},
                {"name": "token", "shape": [1], "dtype": "int64"},
            ],
            "outputs": outputs,
        }
    return {"forward": forward}, settings


def check_heads(head: MTPHead, manifest: Manifest, reexport: str) -> None:
    """A heads-only update (exporter/update_heads.py) writes drafter.pte, which runs every head
    but one that reads the target's cache: that one is a `draft` method of target.pte."""
    if head.reads_target_cache:
        raise UserError(
            "these heads read the target's cache, so they run as a draft method of target.pte, "
            f"which this bundle's target program was exported without: {reexport}"
        )


def export_heads(
    head: MTPHead,
    embedding: nn.Embedding,
    target: Transformer,
    manifest: Manifest,
    directory: Path,
    progress: Callable[[str], None],
) -> tuple[dict[str, ModelFile], dict]:
    """The drafter files of a heads-only update: drafter.pte for `head`, quantized as the
    bundle's drafter was, with the float `embedding` table of `target` (quantized here with the
    bundle's embedding scheme, as the export's loader quantized the target's), and
    drafter_vocab.json."""
    old = manifest.models["drafter"]
    q = old.quant
    scheme = QuantScheme(q["scheme"], q["group_size"], q["embedding"])
    methods, settings = export_mtp_program(
        head,
        embedding,
        directory / old.file,
        scheme,
        progress,
        rope=target.config,
        max_seq_len=manifest.max_seq_len,
        max_chunk=manifest.max_chunk,
    )
    models = {
        "drafter": ModelFile(old.file, "", dict(q), methods),
        "drafter_vocab": draft_vocabulary(head, directory),
    }
    return models, settings


def load_hook(options, skeleton: Transformer, draft: bool = False) -> PartHook:
    """Quantize each part of the target (or, with `draft`, the draft model) with the export's
    scheme as the loader reads it (checkpoints.load_model), after checking the scheme fits."""
    import torchao.quantization  # noqa: F401  (its import, ~100 MB, before any stage's clock)

    scheme = draft_scheme_of(options) if draft else target_scheme_of(options)
    check_scheme(scheme, skeleton)

    def hook(model: Transformer, name: str, module: nn.Module) -> None:
        quantize_part(model, name, module, scheme)

    return hook


def target_scheme_of(options) -> QuantScheme:
    """The target's QuantScheme from the export's options (its own LM head scheme, if any)."""
    from mtp_edge.quantize.schemes import default_group_size

    o = options
    head_group = None if o.head_quant is None else default_group_size(o.head_quant)
    return QuantScheme(
        o.quant, o.group_size, o.embedding_quant, head=o.head_quant, head_group_size=head_group
    )


def draft_scheme_of(options) -> QuantScheme:
    """The draft model's QuantScheme (--head-quant is the target's alone)."""
    return QuantScheme(options.draft_quant, options.draft_group_size, options.embedding_quant)


def check(job: ExportJob) -> None:
    """The weight schemes, before anything is exported."""
    check_scheme(target_scheme_of(job.options), job.target.model)
    if job.draft_model is not None:
        check_scheme(draft_scheme_of(job.options), job.draft_model.model)


def export(job: ExportJob, directory: Path) -> tuple[dict[str, ModelFile], dict]:
    """target.pte (with a `verify` method when there is a drafter and forward is not row-exact,
    and the `draft` method of a
    head that reads the target's cache), and drafter.pte for any other drafter model."""
    o, head, draft_model = job.options, job.head, job.draft_model
    quant = {
        "scheme": o.quant,
        "group_size": o.group_size,
        "embedding": o.embedding_quant,
        "attention": o.attention_kernel,
    }
    draft_quant = dict(quant, scheme=o.draft_quant, group_size=o.draft_group_size)
    target_scheme = target_scheme_of(o)
    if o.head_quant is not None:
        quant["head"] = o.head_quant
        quant["head_group_size"] = target_scheme.head_group_size
    draft_scheme = draft_scheme_of(o)
    tokenizer = job.target.tokenizer

    def program(model: Transformer, path: Path, scheme: str, group: int, **extra) -> dict:
        return export_program(
            model,
            path,
            quant=scheme,
            group_size=group,
            embedding_quant=o.embedding_quant,
            max_seq_len=job.max_seq_len,
            max_chunk=job.max_chunk,
            bos_id=tokenizer.bos_id,
            eos_ids=tokenizer.eos_ids,
            attention_kernel=o.attention_kernel,
            progress=job.progress,
            **extra,
        )

    in_program = head is not None and head.reads_target_cache
    extra: dict = {"return_hidden": head is not None}
    # A row-exact verify method for k+1 tokens (module doc), only where forward is not row-exact
    # itself: on our attention op forward verifies at any width, and a second method would be
    # lowered for nothing and, where the runtime has no weight cache, pack its own copy of
    # every weight at load.
    if job.drafter_kind != "none" and o.attention_kernel != "mtp":
        extra["verify_width"] = o.k + 1
    if in_program:  # the draft step is a method of the target's program
        extra.update(draft_head=head, draft_scheme=draft_scheme)
    if o.head_quant is not None:
        extra.update(head_quant=o.head_quant, head_group_size=target_scheme.head_group_size)
    methods = program(job.target.model, directory / "target.pte", o.quant, o.group_size, **extra)
    models = {"target": ModelFile("target.pte", "", quant, methods)}
    settings: dict = {}
    if draft_model is not None:
        methods = program(
            draft_model.model, directory / "drafter.pte", o.draft_quant, o.draft_group_size
        )
        models["drafter"] = ModelFile("drafter.pte", "", draft_quant, methods)
    if head is not None:
        if in_program:
            settings = dict(head_settings(head), method="draft", reads_target_cache=True)
        else:
            methods, settings = export_mtp_program(
                head,
                job.target.model.embed_tokens,
                directory / "drafter.pte",
                draft_scheme,
                job.progress,
                rope=job.target.config,
                max_seq_len=job.max_seq_len,
                max_chunk=job.max_chunk,
            )
            models["drafter"] = ModelFile("drafter.pte", "", draft_quant, methods)
        models["drafter_vocab"] = draft_vocabulary(head, directory)
    return models, settings
