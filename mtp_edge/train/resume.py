"""What a run keeps to be resumed: the checkpoint (the head, AdamW's state and the best held-out
head in safetensors; the scalars in <out>.ckpt.json, no pickle) and the checks a resumed run
makes against it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mtp_edge.errors import UserError
from mtp_edge.files import write_with


def read_state(path: Path) -> dict:
    """<out>.ckpt.json, or nothing when there is none (or it is unreadable: then the
    checkpoint is refused later, with its own message)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def comparable(recipe: dict) -> dict:
    """A resumed run may change --steps or --minutes (train longer); the rest must match.
    Runs recorded before --labeller existed were labelled by the bundle when given, else by
    the target as loaded."""
    recipe = {"labeller": "bundle" if recipe.get("bundle") else "fp32", **recipe}
    return {k: v for k, v in recipe.items() if k not in ("steps", "minutes")}


def save_checkpoint(
    path_st: Path, path_json: Path, head, optimizer, state: dict, best: dict | None = None
) -> None:
    """Head and AdamW state (and the best held-out head's weights, `best`) as tensors in
    safetensors, scalars in JSON (no pickle)."""
    tensors = {f"head.{n}": t.detach().cpu().contiguous() for n, t in head.state_dict().items()}
    tensors.update({f"best.{n}": t.cpu().contiguous() for n, t in (best or {}).items()})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            tensors[f"optim.{i}.{key}"] = torch.as_tensor(value).cpu().contiguous()
    write_with(path_st, lambda tmp: save_file(tensors, str(tmp)))
    write_with(path_json, lambda tmp: tmp.write_text(json.dumps(state, indent=2) + "\n"))


def load_checkpoint(path_st: Path, path_json: Path, head, optimizer) -> tuple[dict, dict]:
    """The state saved by save_checkpoint, loaded into `head` and `optimizer`; returns the
    scalars and the best held-out head's weights (empty when none was kept)."""
    try:
        state = json.loads(path_json.read_text())
        with safe_open(str(path_st), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(
            f"cannot read the checkpoint {path_st}: {e}; rerun without --resume"
        ) from None
    head.load_state_dict({n[5:]: t for n, t in tensors.items() if n.startswith("head.")})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, tensor in tensors.items():
        if name.startswith("optim."):
            _, i, key = name.split(".", 2)
            optimizer.state[params[int(i)]][key] = tensor.to(params[int(i)].device)
    best = {n[5:]: t for n, t in tensors.items() if n.startswith("best.")}
    return state, best
