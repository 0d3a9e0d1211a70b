"""The ONNX Runtime session: runs an exported target.onnx on the CPU execution provider.

The KV cache is one OrtValue per layer and kind, allocated once. Through IOBinding each is bound
both as the `past_*` input and as the `present_*` output of every call, so GroupQueryAttention
writes the new rows into it in place (it checks that the two share a buffer): the cache is never
copied, grown or reallocated, and the session, like the others, is one cache that later calls
overwrite (rejected drafts need no rollback).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from mtp_edge.errors import UserError
from mtp_edge.machine import claim_cores
from mtp_edge.runtime.backends import refuse_self_heads
from mtp_edge.runtime.session import Output, check_token_ids

_ORT_DTYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(float16)": "float16"}


_SHARED_POOL: list[int] = []  # [threads of the process's one pool, 0 if it has none]


def _shared_pool() -> int:
    """One thread pool for every session of the process (target and drafter), set up before the
    first session: with a pool per session, two pools of spinning workers fight over the cores
    whenever the loop alternates drafter and target calls (measured: verify/decode 2.24 in the
    loop instead of 1.26). Falls back to per-session pools if onnxruntime's environment already
    exists (a session was opened elsewhere first)."""
    if not _SHARED_POOL:
        from onnxruntime.capi import _pybind_state

        try:
            threads = claim_cores()
            _pybind_state.set_global_thread_pool_sizes(threads, 1)
            _SHARED_POOL.append(threads)
        except Exception:  # the environment was created before: keep per-session pools
            _SHARED_POOL.append(0)
    return _SHARED_POOL[0]


def _session_options():
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    pool = os.environ.get("MTP_EDGE_ORT_POOL", "shared")
    if pool not in ("shared", "session"):
        raise UserError(f"MTP_EDGE_ORT_POOL must be 'shared' or 'session', not {pool!r}")
    if pool == "shared" and _shared_pool():
        # Workers spin between calls (onnxruntime's default): on a quiet 2-core machine plain
        # decoding ran at ~112 tok/s against ~88 sleeping (benchmarks/README.md).
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = claim_cores()
        # Workers of per-session pools sleep between calls: the other session's pool (and
        # any other process) competes with spinning workers.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _open(path: Path):
    import onnxruntime as ort

    if not path.is_file():
        raise UserError(f"ONNX model {path} does not exist")
    try:
        return ort.InferenceSession(
            str(path), _session_options(), providers=["CPUExecutionProvider"]
        )
    except Exception as e:  # onnxruntime raises its own exception types for a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"ONNX Runtime cannot load {path.name} ({first}): re-export it") from None


def check_signature(session, path: Path, method: dict) -> None:
    """Refuse a graph whose inputs/outputs differ from what the manifest says it has."""
    for kind, actual in (("inputs", session.get_inputs()), ("outputs", session.get_outputs())):
        expected = method[kind]
        got = [(a.name, _ORT_DTYPES.get(a.type, a.type)) for a in actual]
        want = [(e["name"], e["dtype"]) for e in expected]
        if got != want:
            raise UserError(
                f"{path.name} does not match the bundle manifest: its {kind} are "
                f"{[n for n, _ in got]}, the manifest says {[n for n, _ in want]}; re-export it"
            )
        for a, e in zip(actual, expected, strict=True):
            static = [d for d in e["shape"] if isinstance(d, int)]
            fixed = [d for d in a.shape if isinstance(d, int)]
            if len(a.shape) != len(e["shape"]) or static != fixed:
                raise UserError(
                    f"{path.name} does not match the bundle manifest: {a.name} has shape "
                    f"{a.shape}, the manifest says {e['shape']}; re-export it"
                )


def signature(session) -> dict:
    """A graph's inputs/outputs in the manifest's form; present_X is updated in place of past_X."""

    def describe(args):
        return [{"name": a.name, "shape": a.shape, "dtype": _ORT_DTYPES.get(a.type)} for a in args]

    inputs, outputs = describe(session.get_inputs()), describe(session.get_outputs())
    names = {i["name"] for i in inputs}
    in_place = {
        o["name"]: o["name"].replace("present_", "past_", 1)
        for o in outputs
        if o["name"].replace("present_", "past_", 1) in names
    }
    return {"inputs": inputs, "outputs": outputs, "in_place": in_place}


class OnnxSession:
    name = "onnxruntime"

    def __init__(
        self,
        onnx_path: str | Path,
        method: dict | None,
        max_seq_len: int,
        vocab_size: int,
        max_chunk: int,
    ):
        """`method` is the manifest's description of `forward` (names, shapes, in-place pairs);
        None reads it from the graph (the exporter's own check, before there is a manifest)."""
        import onnxruntime as ort

        path = Path(onnx_path)
        self.session = _open(path)
        if method is None:
            method = signature(self.session)
        check_signature(self.session, path, method)
        # The graph's own vocabulary (the logits' last dimension): what the manifest's is
        # checked against (open_target) and every token id before the embedding reads it.
        logits = next((o for o in self.session.get_outputs() if o.name == "logits"), None)
        width = logits.shape[-1] if logits is not None and logits.shape else None
        self.graph_vocab_size = width if isinstance(width, int) else None
        vocab_size = self.graph_vocab_size or vocab_size
        self.vocab_size, self.max_seq_len, self.max_chunk = vocab_size, max_seq_len, max_chunk
        # Quantized graphs compute a one-token call on another kernel path than longer calls,
        # with other rounding: such calls are padded to min_tokens (the pad row writes the slot
        # after the real ones, which the next call overwrites; the cache has a spare slot).
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.min_tokens = int(metadata.get("mtp_edge.min_tokens", "1"))
        positions = max_seq_len + self.min_tokens - 1
        self.output_names = [o["name"] for o in method["outputs"]]
        self.binding = self.session.io_binding()
        self.caches: dict[str, ort.OrtValue] = {}
        for present, past in method["in_place"].items():
            spec = next(i for i in method["inputs"] if i["name"] == past)
            if spec["shape"][2] != positions:
                raise UserError(
                    f"{path.name} holds {spec['shape'][2]} positions, the manifest says "
                    f"{positions}: re-export the bundle"
                )
            cache = ort.OrtValue.ortvalue_from_numpy(np.zeros(spec["shape"], np.float32))
            self.caches[past] = cache
            self.binding.bind_ortvalue_input(past, cache)
            self.binding.bind_ortvalue_output(present, cache)
        self.results = [n for n in self.output_names if n not in method["in_place"]]
        for name in self.results:
            self.binding.bind_output(name)
        self.bound = [*method["in_place"], *self.results]  # get_outputs() follows binding order

    def forward(self, tokens: list[int], start: int, return_hidden: bool = False) -> Output:
        if not 1 <= len(tokens) <= self.max_chunk:
            raise ValueError(f"a call takes 1..{self.max_chunk} tokens, got {len(tokens)}")
        if start < 0 or start + len(tokens) > self.max_seq_len:
            raise ValueError(
                f"positions up to {start + len(tokens)} exceed the cache of {self.max_seq_len}"
            )
        if return_hidden and "hidden" not in self.results:
            raise UserError(
                "this ONNX model returns logits only, and the drafter needs the target's hidden "
                "states: re-export with --drafter mtp, or use ngram"
            )
        check_token_ids(tokens, self.vocab_size)
        n = len(tokens)
        ids = np.array([tokens + [0] * (self.min_tokens - n)], dtype=np.int64)
        pos = np.array([start], dtype=np.int64)
        self.binding.bind_cpu_input("tokens", ids)
        self.binding.bind_cpu_input("input_pos", pos)
        for name in self.results:  # T varies: let ONNX Runtime allocate logits/hidden anew
            self.binding.bind_output(name)
        self.session.run_with_iobinding(self.binding)
        outputs = dict(zip(self.bound, self.binding.get_outputs(), strict=True))
        logits = torch.from_numpy(outputs["logits"].numpy()[0, :n])
        if not return_hidden:
            return Output(logits)
        return Output(logits, torch.from_numpy(outputs["hidden"].numpy()[0, :n]))


class OnnxStep:
    """A one-step drafter graph: step(h [1, D], token [1], position) -> (draft_logits [1, Vd], h').

    A head that reads the target's cache (the method names its `target_cache`) also takes the
    position and the target's last-layer cache, bound once, as past_* input and present_*
    output, to `target`'s own cache OrtValues: GroupQueryAttention writes the head's K/V row at
    `position` into the target's cache in place (safe: mtp.py) and attends to slots <= position.
    """

    def __init__(self, onnx_path: str | Path, method: dict, target: OnnxSession | None = None):
        path = Path(onnx_path)
        self.session = _open(path)
        check_signature(self.session, path, method)
        self.binding, self.positions = None, 0
        links = method.get("target_cache")
        if not links:
            return
        if target is None:
            raise ValueError(f"{path.name} reads the target's cache: pass the target session")
        self.binding = self.session.io_binding()
        for present, past in method["in_place"].items():
            cache = target.caches.get(links[past])
            spec = next(i for i in method["inputs"] if i["name"] == past)
            if cache is None or cache.shape() != spec["shape"]:
                raise UserError(
                    f"{path.name} reads a {links[past]} cache of shape {spec['shape']}, the "
                    f"target's is {None if cache is None else cache.shape()}: re-export the bundle"
                )
            self.binding.bind_ortvalue_input(past, cache)
            self.binding.bind_ortvalue_output(present, cache)
            self.positions = spec["shape"][2]
        self.bound = [*method["in_place"], "draft_logits", "next_h"]  # get_outputs() order

    def __call__(self, h: torch.Tensor, token: torch.Tensor, position: int = 0):
        h, token = h.float().contiguous().numpy(), token.long().numpy()
        if self.binding is None:
            logits, g = self.session.run(["draft_logits", "next_h"], {"h": h, "token": token})
            return torch.from_numpy(logits), torch.from_numpy(g)
        if not 0 <= position < self.positions:
            raise ValueError(f"draft position {position} is outside the cache of {self.positions}")
        b = self.binding
        b.bind_cpu_input("h", h)
        b.bind_cpu_input("token", token)
        b.bind_cpu_input("input_pos", np.array([position], dtype=np.int64))
        b.bind_output("draft_logits")
        b.bind_output("next_h")
        self.session.run_with_iobinding(b)
        outputs = dict(zip(self.bound, b.get_outputs(), strict=True))
        return (
            torch.from_numpy(outputs["draft_logits"].numpy()),
            torch.from_numpy(outputs["next_h"].numpy()),
        )


# The backend's entry points (runtime/backends.py): `bundle` is an opened bundle
# (runtime/bundle.py), `target()` gives its target session, opened once.


def available() -> bool:
    return True


def open_target(bundle) -> OnnxSession:
    """The target graph; the manifest's vocabulary checked against the graph's logits (its cache
    length is checked against the graph's cache inputs as the session binds them)."""
    from mtp_edge.runtime.bundle import check_manifest

    m = bundle.manifest
    entry = m.models["target"]
    session = OnnxSession(
        bundle.path / entry.file, entry.methods["forward"], m.max_seq_len, m.vocab_size, m.max_chunk
    )
    if session.graph_vocab_size is not None:
        check_manifest(bundle.path, m, {"vocab_size": session.graph_vocab_size}, entry.file)
    return session


def open_program(path: Path, max_seq_len: int, max_chunk: int) -> OnnxSession:
    """An exported target graph alone, before there is a bundle (export's quality checks)."""
    return OnnxSession(path, None, max_seq_len, 0, max_chunk)


def open_mtp_step(bundle, target) -> tuple[OnnxStep, int | None]:
    """The MTP head's step, and the cache length that bounds drafting (None: no cache)."""
    m = bundle.manifest
    refuse_self_heads(m, "onnxruntime")
    # A head that reads the target's cache is bound to the target session's buffers.
    shared = target() if m.drafter.reads_target_cache else None
    entry = m.models["drafter"]
    step = OnnxStep(bundle.path / entry.file, entry.methods["forward"], shared)
    return step, None if shared is None else shared.max_seq_len


def open_draft_model(bundle) -> OnnxSession:
    m = bundle.manifest
    entry = m.models["drafter"]
    return OnnxSession(
        bundle.path / entry.file, entry.methods["forward"], m.max_seq_len, m.vocab_size, m.max_chunk
    )
