"""The MTP head: a few-percent-of-a-target-step drafter that reads the target's hidden state.

One step (EAGLE / DeepSeek-V3 MTP family) takes the target's final-normed hidden state h at
position t and the embedding of the token at t+1, and predicts the token at t+2:

    x = proj([hnorm(h); enorm(emb)])          2D -> D
    x = x + MLP(norm(x))                      num_blocks times (SwiGLU)
    logits = lm_head(final_norm(x))           a reduced draft vocabulary, mapped to target ids

and returns x as the hidden state for its next step, so k steps run recurrently on its own output.

Two kinds of block (`MTPConfig.attention`):
- "none" (the default): x + MLP(norm(x)); the context arrives only through h.
- "target_cache": first x + Attention(norm(x)) whose keys and values are the *target's last
  layer's KV cache* (the positions the target has verified) plus the head's own K/V, which it
  writes into that cache at the position it drafts for. No cache of its own and no prefill of
  one: what the head reads at a position is what the target already wrote there. Writing is safe
  because a drafted position lies past everything the target has verified, and the target
  overwrites those slots in its next call before any query of its own reads them (the
  static-cache rule that makes rollback free). Its q/k/v/o start as the target's last layer's.
  On SmolLM2-135M it did not beat "none" (README.md, "The MTP drafter").
- "self" (EAGLE): first x + Attention(norm(x)) over the head's *own* KV cache. Its slot i holds
  the K/V of proj([h_i; emb(x_{i+1})]), the input that reads the token at position i+1 (the
  position the drafter passes, as for "target_cache", and the rotary position): built from the
  target's hidden states over the verified text, and from the head's own recurrent states past
  it while it drafts. After each verification the drafter feeds the newly verified positions
  (the verify call returns their hidden states) as one chunk, which overwrites the slots its
  drafts wrote; so the head sees the whole context through features of its own, not one state.

The token embedding is the target's own table (never copied into the head's file); the LM head
covers only the draft vocabulary (`draft_ids`), because the full head of a small target (SmolLM2:
576 x 49152) alone costs about a fifth of a target step.

An `attend(q, k, v)` callable carries the position-dependent part (rotary embedding, the cache,
the mask), so one head serves training (all positions at once, mtp_edge/train/context.py), the
eager drafter and every exporter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from mtp_edge.errors import UserError
from mtp_edge.files import write_with
from mtp_edge.model import RMSNorm, Transformer

_METADATA_KEY = "mtp_config"


@dataclass
class MTPConfig:
    hidden_size: int
    intermediate_size: int
    vocab_size: int  # the target's: draft ids index into it
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    num_blocks: int = 1
    # Native heads only: the block's attention evaluated over the current position alone, which
    # reduces to one D x D linear map (softmax over a single key is 1).
    self_only_attention: bool = False
    # "none" | "target_cache" | "self": see the module doc. The attention's shape is the target's.
    attention: str = "none"
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    attention_bias: bool = False
    target_name: str = ""
    target_hash: str = ""
    k: int = 4  # draft steps the head was trained for
    recipe: dict = field(default_factory=dict)  # how it was made, for the record

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> MTPConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., heads, head_dim] with cos/sin [..., head_dim] (per position)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(-2) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(-2)


class CacheAttention(nn.Module):
    """Projections of an attention over the target's cache; the attending is `attend`'s."""

    def __init__(self, c: MTPConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        d, bias = c.hidden_size, c.attention_bias
        self.q_proj = nn.Linear(d, c.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, c.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, c.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, d, bias=False)
        self.q_norm = self.k_norm = None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [..., D] -> o_proj(attend(q [..., H, hd], k [..., KVH, hd], v)) [..., D]."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(attend(q, k, v).flatten(-2))


class MTPBlock(nn.Module):
    """x + MLP(norm(x)), after an attention step for heads that have one (module doc)."""

    def __init__(self, c: MTPConfig, first: bool = True):
        super().__init__()
        self.attn_norm = self.attn = self.cache_attn = None
        if c.self_only_attention:
            self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.attn = nn.Linear(c.hidden_size, c.hidden_size, bias=True)
        elif c.attention in ("target_cache", "self") and first:
            # Only the first block attends: the head owns one slot per drafted position.
            self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.cache_attn = CacheAttention(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, attend: Attend | None = None):
        if self.attn is not None:
            x = x + self.attn(self.attn_norm(x))
        if self.cache_attn is not None:
            if attend is None:
                raise ValueError("this head attends to the target's cache: pass `attend`")
            x = x + self.cache_attn(self.attn_norm(x), attend)
        return x + self.mlp(self.norm(x))


class MTPHead(nn.Module):
    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.blocks = nn.ModuleList(MTPBlock(config, i == 0) for i in range(config.num_blocks))
        self.final_norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size))

    @property
    def reads_target_cache(self) -> bool:
        return self.config.attention == "target_cache"

    @property
    def has_own_cache(self) -> bool:
        """A "self" (EAGLE) head: it attends over a KV cache of its own features."""
        return self.config.attention == "self"

    @property
    def needs_context(self) -> bool:
        """Training needs a TrainContext (mtp_edge/train/context.py: rotary tables, padding;
        the target's K/V)."""
        return self.config.attention != "none"

    def step(self, h: torch.Tensor, token_emb: torch.Tensor, attend: Attend | None = None):
        """h [..., D], token_emb [..., D] -> (draft logits [..., Vd], next hidden [..., D]).

        `attend` (heads that read the target's cache) runs the attention at the drafted
        position: see mtp_edge/train/context.py and runtime/mtp_drafter.py."""
        x = self.proj(torch.cat((self.hnorm(h), self.enorm(token_emb)), dim=-1))
        for block in self.blocks:
            x = block(x, attend)
        return self.lm_head(self.final_norm(x)), x

    def forward(
        self,
        h: torch.Tensor,
        token_embs: torch.Tensor,
        context=None,
        return_hidden: bool = False,
    ):
        """Unrolled steps for training: h [B, L, D], token_embs [B, L, J, D] -> [B, L, J, Vd]
        (and with `return_hidden`, each step's output hidden state [B, L, J, D]).

        Origin t starts from the target's hidden state at t; step j reads the embedding of the
        token at t+j+1, as drafting does once the draft of step j-1 is right (the only case in
        which step j counts). Heads that attend take a `context` (a TrainContext,
        mtp_edge/train/context.py) whose `attends` gives each step's attention.
        """
        out, hidden = [], []
        attends = context.attends(self.config.attention) if self.needs_context else None
        for j in range(token_embs.shape[-2]):
            attend = next(attends) if attends is not None else None
            logits, h = self.step(h, token_embs[..., j, :], attend)
            out.append(logits)
            hidden.append(h)
        logits = torch.stack(out, dim=-2)
        return (logits, torch.stack(hidden, dim=-2)) if return_hidden else logits


def target_lm_head(target: Transformer) -> torch.Tensor:
    return target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight


def carry_vocabulary(
    head: MTPHead, start: MTPHead, target: Transformer, draft_ids: torch.Tensor
) -> MTPHead:
    """Give `head` (a copy of the trained `start`) the draft vocabulary `draft_ids`: tokens the
    two vocabularies share keep their trained LM-head rows, new tokens start from the target's."""
    with torch.no_grad():
        rows = target_lm_head(target)[draft_ids].clone().to(head.lm_head.weight.dtype)
        old = {int(t): i for i, t in enumerate(start.draft_ids)}
        for i, token in enumerate(draft_ids.tolist()):
            if token in old:
                rows[i] = start.lm_head.weight[old[token]]
        head.draft_ids.copy_(draft_ids)
        head.lm_head.weight.copy_(rows)
    return head


def init_from_target(head: MTPHead, target: Transformer, draft_ids: torch.Tensor) -> MTPHead:
    """Start the draft LM head and final norm from the target's, so that the head begins in the
    target's output space instead of learning it from scratch."""
    with torch.no_grad():
        head.draft_ids.copy_(draft_ids)
        head.lm_head.weight.copy_(target_lm_head(target)[draft_ids])
        head.final_norm.weight.copy_(target.norm.weight)
        block = head.blocks[0]
        if block.cache_attn is not None:  # keys it writes start in the space of the cache's
            last = target.layers[-1]
            block.attn_norm.weight.copy_(last.input_layernorm.weight)
            block.cache_attn.load_state_dict(last.self_attn.state_dict(), strict=False)
    return head


def cache_attention_config(target: Transformer, kind: str = "target_cache") -> dict:
    """MTPConfig fields of a head that attends (kind "target_cache": to `target`'s last-layer
    cache; "self": to its own) with the attention shape of `target`'s layers."""
    c = target.config
    return {
        "attention": kind,
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "qk_norm": c.qk_norm,
        "attention_bias": c.attention_bias,
    }


def target_fingerprint(target: Transformer) -> str:
    """sha256 over the target's config and fixed slices of its embedding, final norm and LM head.

    Slices are rounded to float16 so that the same weights loaded in another dtype match, while
    a different checkpoint (or a different quantization of the same one) does not.
    """
    tensors = [target.embed_tokens.weight, target.norm.weight[None]]
    if target.lm_head is not None:
        tensors.append(target.lm_head.weight)
    return fingerprint(target.config, [fingerprint_rows(weight) for weight in tensors])


def fingerprint_rows(weight: torch.Tensor) -> bytes:
    """The slice of one weight [rows, ...] that target_fingerprint hashes."""
    rows = torch.linspace(0, weight.shape[0] - 1, min(64, weight.shape[0])).long()
    return weight.detach()[rows].to(torch.float16).contiguous().numpy().tobytes()


def fingerprint(config, slices: list[bytes]) -> str:
    """target_fingerprint from the slices of the embedding, the final norm (as one row) and an
    untied LM head, taken while the weights were float (a loader that quantizes as it goes)."""
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    for piece in slices:
        digest.update(piece)
    return digest.hexdigest()


def save_heads(head: MTPHead, config: MTPConfig, path: str | Path) -> None:
    """Write `path` (fp16 safetensors, config in its metadata) and `<stem>.json` (readable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        name: t.detach().to(torch.float16 if t.is_floating_point() else t.dtype).contiguous()
        for name, t in head.state_dict().items()
    }
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
    write_with(path, lambda tmp: save_file(state, str(tmp), metadata={_METADATA_KEY: text}))
    write_with(heads_json_path(path), lambda tmp: tmp.write_text(text + "\n"))


def heads_json_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def load_heads(
    path: str | Path, target: Transformer, target_name: str, target_hash: str | None = None
) -> MTPHead:
    """Read heads written by `save_heads`, refusing heads trained for another target
    (`target_hash`: the target's fingerprint, when its weights are no longer float)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(
            f"{path} is a directory, not MTP heads: --heads takes a .safetensors heads file "
            "(the one mtp-train --out wrote)"
        )
    if not path.is_file():
        raise UserError(f"MTP heads not found: {path} (train them with mtp-train --out {path})")
    try:
        with safe_open(str(path), framework="pt") as f:
            config = MTPConfig.from_dict(json.loads((f.metadata() or {})[_METADATA_KEY]))
            state = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as e:
        raise UserError(
            f"{path} is not an MTP heads file ({type(e).__name__}: {e}): train it again with "
            "mtp-train"
        ) from None
    c = target.config
    if (config.hidden_size, config.vocab_size) != (c.hidden_size, c.vocab_size) or (
        config.target_hash != (target_hash or target_fingerprint(target))
    ):
        raise UserError(
            f"{path}: heads were trained for {config.target_name or 'another model'} "
            f"(hidden {config.hidden_size}, vocab {config.vocab_size}), not for {target_name} "
            f"(hidden {c.hidden_size}, vocab {c.vocab_size}); retrain with "
            f"mtp-train --model <{target_name}> --out {path}"
        )
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor.float().sum()):
            if not bool(torch.isfinite(tensor).all()):
                raise UserError(
                    f"{path}: tensor '{name}' holds NaN/inf values: the heads file is corrupt; "
                    f"train it again with mtp-train --out {path}"
                )
    head = MTPHead(config)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        first = (str(e).splitlines()[1:2] or [str(e)])[0].strip().rstrip(".")
        raise UserError(
            f"{path} does not match its own config ({first}): the file is damaged or "
            "was edited; train it again with mtp-train, or give the heads file that came with it"
        ) from None
    return head.to(target.dtype).eval()


HEADS_DIR = Path(__file__).parent / "heads"


def shipped_heads(model_name: str) -> Path | None:
    """The heads that ship with mtp-edge for a model (trained by mtp-train), if any."""
    path = HEADS_DIR / f"{model_name}.safetensors"
    return path if path.is_file() else None


def heads_file(model_name: str, heads: str | Path | None) -> str | Path | None:
    """The MTP heads to draft with: the ones given, else those shipped for the model, else
    None. What `--drafter auto` and `--drafter mtp` decide by, at export and at run time."""
    return heads or shipped_heads(model_name)


def auto_drafter(model_name: str, heads: str | Path | None) -> str:
    """`--drafter auto`: the best drafter available, MTP heads where given or shipped for the
    model, else n-gram lookup."""
    return "mtp" if heads_file(model_name, heads) else "ngram"
