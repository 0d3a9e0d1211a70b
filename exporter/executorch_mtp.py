"""The MTP drafter as its own ExecuTorch program: one recurrent draft step per call.

`forward(h [1, D] float32, token [1] int64) -> (draft_logits [1, Vd], next_h [1, D])`, static
shapes. A "self" (EAGLE) head carries its own KV cache as mutable buffers and takes a chunk:
`forward(h [1, T, D], tokens [1, T], input_pos [1]) -> (draft_logits [1, Vd], next_h [1, D])` of
the last row, T dynamic in 1..max_chunk, `input_pos` the position of tokens[0] (its K/V go to
slot input_pos - 1, mtp.py); attention is llama.update_cache and our mtp_edge::sdpa, as in the
target. The program carries its own (quantized) copy of the target's embedding table, because an
ExecuTorch program cannot read another program's weights; the per-step cost stays that of the
head alone (the table is only indexed). `draft_ids` (draft index -> target id) is written next to
it as JSON, so the runtime maps the logits back without running the model.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass
from torch import nn

from mtp_edge.config import ModelConfig
from mtp_edge.exporter.executorch import CustomOpAttention, MatmulRMSNorm
from mtp_edge.model import RMSNorm, rope_frequencies
from mtp_edge.mtp import MTPHead
from mtp_edge.quantize.schemes import QuantScheme, quantize_modules


class MtpStep(nn.Module):
    def __init__(self, head: MTPHead, embedding: nn.Embedding):
        super().__init__()
        self.head, self.embedding = head, embedding

    def forward(self, h: torch.Tensor, token: torch.Tensor):
        return self.head.step(h, self.embedding(token))


class SelfHeadChunk(nn.Module):
    """A self head over a chunk of T rows with its cache in buffers (module doc)."""

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
    directory: Path,
    scheme: QuantScheme,
    progress: Callable[[str], None] | None = None,
    rope: ModelConfig | None = None,
    max_seq_len: int = 0,
    max_chunk: int = 0,
) -> tuple[dict, dict]:
    """Write drafter.pte and drafter_vocab.json into `directory`; returns their manifest methods.

    A self head also needs the target's config (`rope`: its rotary embedding), the cache length
    and the longest chunk."""
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
    for parent in list(step.modules()):
        for name, child in parent.named_children():
            if isinstance(child, RMSNorm):
                setattr(parent, name, MatmulRMSNorm(child))
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
        edge = to_edge_transform_and_lower(
            exported,
            partitioner=[XnnpackPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
        )
        program = edge.to_executorch(
            ExecutorchBackendConfig(
                extract_delegate_segments=True,
                do_quant_fusion_and_const_prop=True,
                memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
                emit_mutable_buffer_names=True,
                sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),  # plan for the largest T
            )
        )
    (directory / "drafter.pte").write_bytes(program.buffer)
    ids = head.draft_ids.tolist()
    (directory / "drafter_vocab.json").write_text(json.dumps({"draft_ids": ids}))
    vd = head.config.draft_vocab_size
    outputs = [
        {"name": "draft_logits", "shape": [1, vd], "dtype": "float32"},
        {"name": "next_h", "shape": [1, d], "dtype": "float32"},
    ]
    settings = {"draft_vocab_size": vd, "hidden_size": d}
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
