"""The ExecuTorch session: runs an exported .pte (XNNPACK) through `executorch.runtime`.

The program keeps its KV cache in mutable buffers inside the loaded method, so a session is one
cache: `forward(tokens, start)` writes positions start.. and attends to the slots before them,
exactly like the eager session. Slots left by rejected drafts are overwritten by the next call.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtp_edge.errors import UserError
from mtp_edge.machine import executorch_threads, hand_cores_to_executorch  # noqa: F401 (the row's threads hook)
from mtp_edge.runtime.session import Output, check_token_ids

# Calls of up to this many tokens go row-exact through `verify` when the program has it: the
# loop's verifications (k + 1 <= 16 tokens). Longer calls are prefill chunks and take `forward`.
EXACT_ROWS_MAX = 16


class ExecuTorchSession:
    """A session on an mtp-export program. Each row of a call must equal bitwise the one-token
    forward at its position, so that speculative decoding reproduces plain decoding exactly,
    also on a quantized program. On our attention op (`row_exact_forward`) every call is a
    `forward` call of its own width. On ExecuTorch's, a call of 2..EXACT_ROWS_MAX tokens on a
    program with a `verify` method runs through verify (in windows of its width W, padded with
    copies of the last token, whose rows are discarded and whose cache slots the next call
    overwrites), which computes attention row by row."""

    name = "executorch"

    def __init__(
        self,
        pte_path: str | Path,
        max_seq_len: int,
        vocab_size: int,
        max_chunk: int,
        row_exact_forward: bool = False,
    ):
        # Register the kernels of the custom ops (llama.custom_sdpa / update_cache) and the
        # quantized ops (embedding_byte...) before the program is loaded.
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
        import executorch.kernels.quantized  # noqa: F401
        from executorch.runtime import Runtime

        from mtp_edge.runtime.executorch_ops import load_kernels

        load_kernels()  # mtp_edge::sdpa, the attention mtp-export's programs call
        path = Path(pte_path)
        if not path.is_file():
            raise UserError(f"ExecuTorch program {path} does not exist")
        hand_cores_to_executorch()
        self.program = Runtime.get().load_program(path)
        if "forward" not in self.program.method_names:
            raise UserError(f"{path} has no forward method: it is not an mtp-export program")
        self.method = self.program.load_method("forward")
        self.verify, self.verify_width = None, 0
        # Each loaded method packs its own copy of the weights (these bindings have no XNNPACK
        # weight cache), so a row-exact program's verify, never called, is not loaded.
        if "verify" in self.program.method_names and not row_exact_forward:
            self.verify = self.program.load_method("verify")
            self.verify_width = self.program.metadata("verify").input_tensor_meta(0).sizes()[1]
        # The hidden states of the last call, for an MTP drafter (exporter/executorch.py,
        # WithHidden); programs exported before it return them as forward's second output.
        self.last_hidden = None
        if "last_hidden" in self.program.method_names:
            self.last_hidden = self.program.load_method("last_hidden")
        # The constants mtp-export stored in the program (exporter/executorch.py,
        # metadata_methods): what a bundle's manifest is checked against (open_target), and the
        # vocabulary every token id is checked against before the embedding kernel reads it.
        self.constants = program_constants(self.program)
        self.vocab_size = self.constants.get("get_vocab_size", vocab_size)
        self.max_seq_len = max_seq_len
        self.max_chunk = max_chunk
        # A program on our row-exact attention op (manifest quant "attention": "mtp") gives the
        # same rows from `forward` at any width, so every call goes there at its own width:
        # a 2-token verification costs less than one padded to `verify`'s static k+1.
        self.row_exact_forward = row_exact_forward

    def forward(self, tokens: list[int], start: int, return_hidden: bool = False) -> Output:
        if not 1 <= len(tokens) <= self.max_chunk:
            raise ValueError(f"a call takes 1..{self.max_chunk} tokens, got {len(tokens)}")
        if start + len(tokens) > self.max_seq_len:
            raise ValueError(
                f"positions up to {start + len(tokens)} exceed the cache of {self.max_seq_len}"
            )
        check_token_ids(tokens, self.vocab_size)
        if (
            self.verify is not None
            and not self.row_exact_forward
            and 2 <= len(tokens) <= EXACT_ROWS_MAX
        ):
            pieces = [
                self._call(tokens[i : i + self.verify_width], start + i, return_hidden)
                for i in range(0, len(tokens), self.verify_width)
            ]
            return _joined(pieces, return_hidden)
        return self._call(tokens, start, return_hidden)

    def _call(self, tokens: list[int], start: int, return_hidden: bool) -> Output:
        n, w = len(tokens), self.verify_width
        if n == 1 or self.row_exact_forward or not 0 < n <= w:
            outputs = self.method.execute([torch.tensor([tokens]), torch.tensor([start])])
        elif start + w <= self.max_seq_len:
            padded = tokens + tokens[-1:] * (w - n)
            outputs = self.verify.execute([torch.tensor([padded]), torch.tensor([start])])
        else:  # too close to the end of the cache for the padding: one row per call
            rows = [self._call([t], start + i, return_hidden) for i, t in enumerate(tokens)]
            return _joined(rows, return_hidden)
        # Outputs live in the method's planned memory, which the next call overwrites.
        logits = outputs[0][0, :n].clone()
        if not return_hidden:
            return Output(logits)
        if self.last_hidden is not None:
            return Output(logits, self.last_hidden.execute([])[0][0, :n].clone())
        if len(outputs) < 2:
            raise UserError(
                "this ExecuTorch program returns logits only, and the drafter needs the "
                "target's hidden states: re-export with --drafter mtp, or use ngram"
            )
        return Output(logits, outputs[1][0, :n].clone())


def program_constants(program) -> dict:
    """The program's constant methods (`get_*`, no inputs) by name: an int, or a list of ints
    for one that holds several (get_eos_ids)."""
    out = {}
    for name in sorted(program.method_names):
        if not name.startswith("get_") or program.metadata(name).num_inputs() != 0:
            continue
        values = program.load_method(name).execute([])
        ints = [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if len(ints) == len(values) and ints:
            out[name] = ints if name == "get_eos_ids" else ints[0]
    return out


def _joined(pieces: list[Output], return_hidden: bool) -> Output:
    logits = torch.cat([p.logits for p in pieces])
    return Output(logits, torch.cat([p.hidden for p in pieces]) if return_hidden else None)


class ExecuTorchStep:
    """One draft step: step(h [1, D], token [1], position) -> (draft_logits [1, Vd], h').

    Either a drafter program of its own (`forward(h, token)`), or a method of the target's
    loaded program (`draft(h, token, input_pos)`), which then shares the target's cache; or a
    self head's program with its own cache (`max_chunk` > 0: `forward(h [1, T, D], tokens
    [1, T], input_pos)`, fed in chunks of at most max_chunk rows)."""

    def __init__(
        self,
        pte_path: str | Path | None = None,
        program=None,
        method: str = "forward",
        max_chunk: int = 0,
    ):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (a self head's ops)
        import executorch.kernels.quantized  # noqa: F401
        from executorch.runtime import Runtime

        from mtp_edge.runtime.executorch_ops import load_kernels

        load_kernels()
        hand_cores_to_executorch()
        self.program = program or Runtime.get().load_program(Path(pte_path))
        if method not in self.program.method_names:
            raise UserError(f"the program has no '{method}' method: re-export the bundle")
        self.method = self.program.load_method(method)
        self.takes_position = method != "forward"
        self.max_chunk = max_chunk

    def __call__(self, h: torch.Tensor, token: torch.Tensor, position: int = 0):
        if self.max_chunk:
            for i in range(0, len(token), self.max_chunk):
                rows = slice(i, i + self.max_chunk)
                logits, g = self.method.execute(
                    [
                        h[rows].float().contiguous()[None],
                        token[rows].long()[None],
                        torch.tensor([position + i]),
                    ]
                )
            return logits.clone(), g.clone()
        inputs = [h.float().contiguous(), token.long()]
        if self.takes_position:
            inputs.append(torch.tensor([position]))
        logits, g = self.method.execute(inputs)
        return logits.clone(), g.clone()


# The backend's entry points (runtime/backends.py): `bundle` is an opened bundle
# (runtime/bundle.py), `target()` gives its target session, opened once.


def available() -> bool:
    return True


def open_target(bundle) -> ExecuTorchSession:
    m = bundle.manifest
    entry = m.models["target"]
    row_exact = entry.quant.get("attention") == "mtp"
    session = ExecuTorchSession(
        bundle.path / entry.file, m.max_seq_len, m.vocab_size, m.max_chunk, row_exact
    )
    check_against_program(bundle, session, entry.file)
    return session


# The manifest's keys and the program's constant methods that hold the same number.
MANIFEST_CONSTANTS = {
    "max_seq_len": "get_max_context_len",
    "max_chunk": "get_max_seq_len",
    "vocab_size": "get_vocab_size",
    "bos_id": "get_bos_id",
    "eos_ids": "get_eos_ids",
}


def check_against_program(bundle, session: ExecuTorchSession, file: str) -> None:
    """The manifest's numbers against the program's own constants; an edited manifest is one
    line (a cache length one too long reads past the cache, a vocabulary one too large lets an
    id through to the embedding kernel). Absent bos/eos constants mean none."""
    from mtp_edge.runtime.bundle import check_manifest

    constants = session.constants
    if "get_max_context_len" not in constants:
        raise UserError(
            f"{bundle.path / file} carries no get_max_context_len constant: it was not written "
            "by mtp-export; re-export the bundle"
        )
    facts = {key: constants.get(name) for key, name in MANIFEST_CONSTANTS.items()}
    facts["eos_ids"] = facts["eos_ids"] or []
    check_manifest(bundle.path, bundle.manifest, facts, file)


def open_program(path: Path, max_seq_len: int, max_chunk: int) -> ExecuTorchSession:
    """An exported target program alone, before there is a bundle (export's quality checks)."""
    return ExecuTorchSession(path, max_seq_len, 0, max_chunk)


def open_mtp_step(bundle, target) -> tuple[ExecuTorchStep, int | None]:
    """The MTP head's step, and the cache length that bounds drafting (None: no cache)."""
    m = bundle.manifest
    spec = m.drafter
    if spec.method is not None:  # a method of the target's program, on its cache
        session = target()
        return ExecuTorchStep(program=session.program, method=spec.method), session.max_seq_len
    # A program of its own (a self head's with its own cache, fed in chunks).
    chunk = spec.max_chunk if spec.own_cache else 0
    step = ExecuTorchStep(bundle.path / m.models["drafter"].file, max_chunk=chunk)
    return step, m.max_seq_len if spec.own_cache else None


def open_draft_model(bundle) -> ExecuTorchSession:
    m = bundle.manifest
    entry = m.models["drafter"]
    session = ExecuTorchSession(bundle.path / entry.file, m.max_seq_len, m.vocab_size, m.max_chunk)
    from mtp_edge.runtime.bundle import check_manifest

    keys = ("max_seq_len", "max_chunk")  # the draft model's vocabulary may be sized otherwise
    facts = {key: session.constants.get(MANIFEST_CONSTANTS[key]) for key in keys}
    check_manifest(bundle.path, m, facts, entry.file)
    return session
