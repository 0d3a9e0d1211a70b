"""The MTP drafter as its own ExecuTorch program: one recurrent draft step per call.

`forward(h [1, D] float32, token [1] int64) -> (draft_logits [1, Vd], next_h [1, D])`, static
shapes. The program carries its own (quantized) copy of the target's embedding table, because an
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
from torch import nn

from mtp_edge.exporter.executorch import MatmulRMSNorm
from mtp_edge.model import RMSNorm
from mtp_edge.mtp import MTPHead
from mtp_edge.quantize.schemes import QuantScheme, quantize_modules


class MtpStep(nn.Module):
    def __init__(self, head: MTPHead, embedding: nn.Embedding):
        super().__init__()
        self.head, self.embedding = head, embedding

    def forward(self, h: torch.Tensor, token: torch.Tensor):
        return self.head.step(h, self.embedding(token))


def export_mtp_program(
    head: MTPHead,
    embedding: nn.Embedding,
    directory: Path,
    scheme: QuantScheme,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, dict]:
    """Write drafter.pte and drafter_vocab.json into `directory`; returns their manifest methods."""
    say = progress or (lambda _message: None)
    step = MtpStep(copy.deepcopy(head).float().eval(), copy.deepcopy(embedding).float())
    say(f"[quantize] drafter {scheme.label()}")
    quantize_modules(step, scheme)
    for parent in list(step.modules()):
        for name, child in parent.named_children():
            if isinstance(child, RMSNorm):
                setattr(parent, name, MatmulRMSNorm(child))
    d = head.config.hidden_size
    example = (torch.zeros(1, d), torch.zeros(1, dtype=torch.long))
    say("[export] drafter step")
    with torch.no_grad():
        exported = torch.export.export(step, example, strict=True)
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
            )
        )
    (directory / "drafter.pte").write_bytes(program.buffer)
    ids = head.draft_ids.tolist()
    (directory / "drafter_vocab.json").write_text(json.dumps({"draft_ids": ids}))
    vd = head.config.draft_vocab_size
    methods = {
        "forward": {
            "inputs": [
                {"name": "h", "shape": [1, d], "dtype": "float32"},
                {"name": "token", "shape": [1], "dtype": "int64"},
            ],
            "outputs": [
                {"name": "draft_logits", "shape": [1, vd], "dtype": "float32"},
                {"name": "next_h", "shape": [1, d], "dtype": "float32"},
            ],
        }
    }
    return methods, {"draft_vocab_size": vd, "hidden_size": d}
