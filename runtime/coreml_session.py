"""The Core ML session: runs a bundle's multifunction .mlpackage with coremltools (macOS only).

The package has fixed-width target functions (prefill, verify, decode) sharing one KV cache
state, and, with an MTP drafter, a `draft_step` function (which, for a head that reads the
target's cache, takes the drafted position and runs on that same state). `FixedWidthSession`
maps a call of any length onto them: the narrowest function that holds the tokens, padded at the
end (the pad rows write cache slots after the real ones, which the next call overwrites before
any real query can read them). Near the end of the cache, where a padded call would write past
it, tokens go one at a time through `decode`. The same class runs the PyTorch programs handed to
the converter in the tests, so the padding logic checked on Linux is the one that runs on a Mac.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mtp_edge.errors import UserError
from mtp_edge.runtime.backends import refuse_self_heads
from mtp_edge.runtime.session import Output, check_token_ids

# call(function, tokens padded to its width, start) -> (logits [W, V], hidden [W, D] | None)
Call = Callable[[str, list[int], int], tuple[torch.Tensor, torch.Tensor | None]]


def available() -> bool:
    return sys.platform == "darwin"


class FixedWidthSession:
    name = "coreml"

    def __init__(
        self, call: Call, widths: dict[str, int], max_seq_len: int, vocab_size: int, hidden: bool
    ):
        self.call, self.widths, self.has_hidden = call, widths, hidden
        self.max_seq_len, self.vocab_size = max_seq_len, vocab_size
        self.max_chunk = max(widths.values())

    def forward(self, tokens: list[int], start: int, return_hidden: bool = False) -> Output:
        n = len(tokens)
        if not 1 <= n <= self.max_chunk:
            raise ValueError(f"a call takes 1..{self.max_chunk} tokens, got {n}")
        if start < 0 or start + n > self.max_seq_len:
            raise ValueError(f"positions up to {start + n} exceed the cache of {self.max_seq_len}")
        check_token_ids(tokens, self.vocab_size)
        if return_hidden and not self.has_hidden:
            raise UserError(
                "this Core ML package returns logits only, and the drafter needs the target's "
                "hidden states: re-export with --drafter mtp, or use ngram"
            )
        fits = sorted(
            (width, name)
            for name, width in self.widths.items()
            if width >= n and start + width <= self.max_seq_len
        )
        if fits:
            width, name = fits[0]
            logits, hidden = self.call(name, tokens + [0] * (width - n), start)
            logits, hidden = logits[:n], None if hidden is None else hidden[:n]
        else:
            outs = [self.call("decode", [t], start + i) for i, t in enumerate(tokens)]
            logits = torch.cat([o[0] for o in outs])
            hidden = None if outs[0][1] is None else torch.cat([o[1] for o in outs])
        return Output(logits, hidden if return_hidden else None)


def _require_apple() -> None:
    if not available():
        raise UserError(
            "Core ML runs only on Apple platforms (macOS 15+ / iOS 18+): run this bundle on a "
            "Mac, or export --target onnx or android for this machine"
        )


def _load(path: Path, function: str):
    import coremltools as ct

    if not path.exists():
        raise UserError(f"Core ML package {path} does not exist")
    return ct.models.MLModel(str(path), function_name=function)


class CoreMLSession(FixedWidthSession):
    def __init__(
        self, package: str | Path, methods: dict | None, max_seq_len, vocab_size, max_chunk
    ):
        """`methods` is the manifest's description of the functions (None: read the package)."""
        _require_apple()
        path = Path(package)
        if methods is None:
            methods = _describe(path)
        widths = {
            name: m["inputs"][0]["shape"][1] for name, m in methods.items() if name != "draft_step"
        }
        self.models = {name: _load(path, name) for name in widths}
        # One state for all target functions: they declare the same cache states.
        self.state = self.models["decode"].make_state()
        hidden = any(o["name"] == "hidden" for o in methods["decode"]["outputs"])
        super().__init__(self._predict, widths, max_seq_len, vocab_size, hidden)

    def _predict(self, function: str, tokens: list[int], start: int):
        feeds = {
            "tokens": np.array([tokens], dtype=np.int32),
            "input_pos": np.array([start], dtype=np.int32),
        }
        out = self.models[function].predict(feeds, state=self.state)
        hidden = out.get("hidden")
        return (
            torch.from_numpy(np.asarray(out["logits"], dtype=np.float32)[0]),
            None if hidden is None else torch.from_numpy(np.asarray(hidden, np.float32)[0]),
        )


def _describe(path: Path) -> dict:
    """Function name -> inputs/outputs with shapes, read from the package's spec."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(path))
    methods = {}
    for function in spec.description.functions:
        methods[function.name] = {
            "inputs": [
                {"name": i.name, "shape": list(i.type.multiArrayType.shape)} for i in function.input
            ],
            "outputs": [{"name": o.name} for o in function.output],
        }
    return methods


class CoreMLStep:
    """The package's draft_step function: step(h [1, D], token [1], position) -> (draft_logits,
    h'). A head that reads the target's cache (its function takes `input_pos`) runs on the
    target session's state: pass `session`, whose cache it writes at `position` and reads."""

    def __init__(self, package: str | Path, session: CoreMLSession | None = None):
        _require_apple()
        path = Path(package)
        self.model = _load(path, "draft_step")
        inputs = [i["name"] for i in _describe(path)["draft_step"]["inputs"]]
        self.reads_target_cache = "input_pos" in inputs
        if self.reads_target_cache and session is None:
            raise ValueError("this draft step reads the target's cache: pass the target session")
        self.state = session.state if self.reads_target_cache else None

    def __call__(self, h: torch.Tensor, token: torch.Tensor, position: int = 0):
        feeds = {
            "h": h.float().numpy().astype(np.float32),
            "token": token.numpy().astype(np.int32),
        }
        if self.reads_target_cache:
            feeds["input_pos"] = np.array([position], dtype=np.int32)
            out = self.model.predict(feeds, state=self.state)
        else:
            out = self.model.predict(feeds)
        return (
            torch.from_numpy(np.asarray(out["draft_logits"], dtype=np.float32)),
            torch.from_numpy(np.asarray(out["next_h"], dtype=np.float32)),
        )


# The backend's entry points (runtime/backends.py): `bundle` is an opened bundle
# (runtime/bundle.py), `target()` gives its target session, opened once.


def open_target(bundle) -> CoreMLSession:
    """The package's target functions; the manifest's cache length checked against the
    package's cache states (its vocabulary and bos/eos are checked against the tokenizer's
    metadata when the bundle opens)."""
    from mtp_edge.runtime.bundle import check_manifest

    m = bundle.manifest
    entry = m.models["target"]
    session = CoreMLSession(
        bundle.path / entry.file, entry.methods, m.max_seq_len, m.vocab_size, m.max_chunk
    )
    positions = cache_positions(bundle.path / entry.file)
    if positions is not None:
        check_manifest(bundle.path, m, {"max_seq_len": positions}, entry.file)
    return session


def cache_positions(path: Path) -> int | None:
    """The positions the package's cache states hold ([1, kv_heads, positions, head_dim]), read
    from its spec; None when it declares no state."""
    import coremltools as ct

    spec = ct.utils.load_spec(str(path))
    for function in spec.description.functions:
        for state in function.state:
            shape = list(state.type.stateType.arrayType.shape)
            if len(shape) == 4:
                return int(shape[2])
    return None


def open_program(path: Path, max_seq_len: int, max_chunk: int) -> CoreMLSession | None:
    """An exported package alone (export's quality checks); None where Core ML cannot run."""
    if not available():
        return None
    return CoreMLSession(path, None, max_seq_len, 0, max_chunk)


def open_mtp_step(bundle, target) -> tuple[CoreMLStep, int | None]:
    """The package's draft step, and the cache length that bounds drafting (None: no cache)."""
    m = bundle.manifest
    refuse_self_heads(m, "coreml")
    shared = target() if m.drafter.reads_target_cache else None
    step = CoreMLStep(bundle.path / m.models["target"].file, shared)
    return step, None if shared is None else shared.max_seq_len


def open_draft_model(bundle):
    raise UserError("Core ML bundles carry no separate draft model: use --drafter mtp or ngram")
