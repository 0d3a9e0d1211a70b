"""What a bundle's programs read and compute per call, taken from the .pte files themselves:
the byte and FLOP counts the roofline prediction (devices/predict.py) turns into time."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from mtp_edge.errors import UserError
from mtp_edge.manifest import Manifest
from mtp_edge.memory import weight_bits
from mtp_edge.platforms import PLATFORMS, by_backend

F32 = 4  # the KV cache, logits and hidden states are float32 in our programs


@dataclass
class ProgramShape:
    """What one .pte program reads and computes, taken from the program itself."""

    file_bytes: int
    embedding_bytes: int  # the token embedding table (a gather: T rows read per call)
    embedding_rows: int
    hidden: int  # width of the embedding table's rows (0 without a table)
    layers: int  # attention layers (KV cache pairs); 0 for the MTP drafter step
    kv_heads: int
    head_dim: int
    q_heads: int
    cache_len: int

    @property
    def streamed_bytes(self) -> int:
        return self.file_bytes - self.embedding_bytes

    @property
    def row_bytes(self) -> float:
        return self.embedding_bytes / self.embedding_rows if self.embedding_rows else 0.0


@cache
def program_shape(path: Path, vocab_size: int) -> ProgramShape:
    """Read the KV-cache buffers and the embedding table from an ExecuTorch program."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import Tensor

    try:
        program = deserialize_pte_binary(path.read_bytes())
    except Exception as e:  # a file that is not a .pte: say which one
        raise UserError(f"cannot read ExecuTorch program {path}: {e}") from None
    program = getattr(program, "program", program)
    plan = next(p for p in program.execution_plan if p.name == "forward")
    tensors = [v.val for v in plan.values if isinstance(v.val, Tensor)]
    elem = {"FLOAT": 4, "HALF": 2, "BFLOAT16": 2, "CHAR": 1, "BYTE": 1, "LONG": 8, "INT": 4}

    def nbytes(t) -> int:
        n = 1
        for s in t.sizes:
            n *= s
        return n * elem.get(t.scalar_type.name, 4)

    # The static caches are what ExecuTorch's llama::update_cache writes (its second argument),
    # one K and one V per layer, [1, S, H, D]; the attention op's first argument is the query
    # [1, T, Hq, D] (our mtp_edge::sdpa, or ExecuTorch's llama::custom_sdpa).
    caches, queries = {}, []
    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            if not hasattr(call, "op_index"):
                continue
            op = plan.operators[call.op_index].name
            if op == "llama::update_cache":
                caches[call.args[1]] = plan.values[call.args[1]].val
            elif op in ("mtp_edge::sdpa", "llama::custom_sdpa"):
                queries.append(plan.values[call.args[0]].val)
    kv = list(caches.values())
    kv_heads = kv[0].sizes[2] if kv else 0
    head_dim = kv[0].sizes[3] if kv else 0
    q_heads = queries[0].sizes[2] if queries else kv_heads
    # Constant tensors with one row per token id: the embedding table and its scales.
    table = [
        t
        for t in tensors
        if t.allocation_info is None and len(t.sizes) == 2 and t.sizes[0] == vocab_size
    ]
    return ProgramShape(
        file_bytes=path.stat().st_size,
        embedding_bytes=sum(nbytes(t) for t in table),
        embedding_rows=vocab_size if table else 0,
        hidden=max((t.sizes[1] for t in table), default=0),
        layers=len(kv) // 2,
        kv_heads=kv_heads,
        head_dim=head_dim,
        q_heads=q_heads,
        cache_len=kv[0].sizes[1] if kv else 0,
    )


@dataclass
class BundleCost:
    """Bytes and FLOPs per call of a bundle's target and drafter, from its files."""

    name: str
    target: ProgramShape
    target_bits: float  # bits per linear weight incl. scales
    drafter_bits: float
    vocab: int
    hidden: int
    drafter_kind: str
    drafter: ProgramShape | None
    k: int

    @property
    def target_params(self) -> float:
        """Linear-layer weights (incl. the LM head), from their bytes and the scheme."""
        return self.target.streamed_bytes * 8 / self.target_bits

    def target_call(self, tokens: int, context: int) -> tuple[float, float]:
        """(bytes, flops) of one target call of `tokens` tokens after `context` positions."""
        t = self.target
        kv_per_position = 2 * t.layers * t.kv_heads * t.head_dim * F32
        activations = tokens * (self.vocab + self.hidden) * F32  # logits + hidden out
        activations += tokens * t.layers * 8 * self.hidden * F32  # residual stream in/out
        nbytes = (
            t.streamed_bytes
            + tokens * t.row_bytes
            + kv_per_position * (context + tokens)  # read the cache, write the new slots
            + activations
        )
        attention = 4 * t.layers * t.q_heads * t.head_dim * tokens * (context + tokens)
        return nbytes, 2 * self.target_params * tokens + attention

    def draft_step(self) -> tuple[float, float]:
        """(bytes, flops) of one MTP drafter step (it has no KV cache: weights only)."""
        d = self.drafter
        if d is None:
            return 0.0, 0.0
        weights = d.streamed_bytes + d.row_bytes
        return weights + 2 * self.hidden * F32, 2 * d.streamed_bytes * 8 / self.drafter_bits


def bundle_cost(bundle_dir: str | Path) -> BundleCost:
    path = Path(bundle_dir)
    m = Manifest.load(path, verify=False)
    row = by_backend(m.backend)
    if row is None or not row.predictable:
        readable = [p.backend for p in PLATFORMS.values() if p.predictable]
        raise UserError(
            f"mtp-predict reads bundles for {', '.join(readable)}; {path} is '{m.backend}'"
        )
    target_file = m.models["target"]
    kind = m.drafter.kind
    target = program_shape(path / target_file.file, m.vocab_size)
    drafter = None
    if kind in ("mtp", "draft-lm") and "drafter" in m.models:
        drafter = program_shape(path / m.models["drafter"].file, m.vocab_size)
    return BundleCost(
        name=path.name,
        target=target,
        target_bits=weight_bits(target_file.quant),
        drafter_bits=weight_bits(m.models["drafter"].quant) if drafter else 32.0,
        vocab=m.vocab_size,
        hidden=target.hidden,
        drafter_kind=kind,
        drafter=drafter,
        k=m.drafter.k,
    )
