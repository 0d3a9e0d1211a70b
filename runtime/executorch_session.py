"""The ExecuTorch session: runs an exported .pte (XNNPACK) through `executorch.runtime`.

The program keeps its KV cache in mutable buffers inside the loaded method, so a session is one
cache: `forward(tokens, start)` writes positions start.. and attends to the slots before them,
exactly like the eager session. Slots left by rejected drafts are overwritten by the next call.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch

from mtp_edge.errors import UserError


class ExecuTorchSession:
    name = "executorch"

    def __init__(self, pte_path: str | Path, max_seq_len: int, vocab_size: int, max_chunk: int):
        # Register the kernels of the custom ops (llama.custom_sdpa / update_cache) and the
        # quantized ops (embedding_byte...) before the program is loaded.
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
        import executorch.kernels.quantized  # noqa: F401
        from executorch.extension.pybindings import portable_lib
        from executorch.runtime import Runtime

        path = Path(pte_path)
        if not path.is_file():
            raise UserError(f"ExecuTorch program {path} does not exist")
        # ExecuTorch has one thread pool per process (XNNPACK and the custom ops share it).
        threads = torch.get_num_threads()
        if portable_lib._threadpool_get_thread_count() != threads:
            portable_lib._unsafe_reset_threadpool(threads)
        self.program = Runtime.get().load_program(path)
        if "forward" not in self.program.method_names:
            raise UserError(f"{path} has no forward method: it is not an mtp-export program")
        self.method = self.program.load_method("forward")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_chunk = max_chunk

    def forward(self, tokens: list[int], start: int, return_hidden: bool = False):
        if not 1 <= len(tokens) <= self.max_chunk:
            raise ValueError(f"a call takes 1..{self.max_chunk} tokens, got {len(tokens)}")
        if start + len(tokens) > self.max_seq_len:
            raise ValueError(
                f"positions up to {start + len(tokens)} exceed the cache of {self.max_seq_len}"
            )
        inputs = [torch.tensor([tokens], dtype=torch.long), torch.tensor([start])]
        with single_threaded_blas():
            outputs = self.method.execute(inputs)
        # Outputs live in the method's planned memory, which the next call overwrites.
        logits = outputs[0][0].clone()
        if not return_hidden:
            return logits
        if len(outputs) < 2:
            raise UserError(
                "this ExecuTorch program returns logits only, and the drafter needs the "
                "target's hidden states: re-export with --drafter mtp, or use ngram"
            )
        return logits, outputs[1][0].clone()


class ExecuTorchStep:
    """A one-step drafter program: step(h [1, D], token [1]) -> (draft_logits [1, Vd], h')."""

    def __init__(self, pte_path: str | Path):
        import executorch.kernels.quantized  # noqa: F401
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(Path(pte_path))
        self.method = self.program.load_method("forward")

    def __call__(self, h: torch.Tensor, token: torch.Tensor):
        with single_threaded_blas():
            logits, g = self.method.execute([h.float().contiguous(), token.long()])
        return logits.clone(), g.clone()


def _mkl_thread_controls():
    """(get, set) of MKL's thread count in the torch library loaded here, or None."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return lib.mkl_serv_get_max_threads, lib.mkl_serv_set_num_threads
    except (OSError, AttributeError):  # no such library or no MKL in it (e.g. macOS, ARM)
        return None


_MKL = _mkl_thread_controls()


@contextlib.contextmanager
def single_threaded_blas():
    """Run ExecuTorch with MKL limited to one thread.

    ExecuTorch's SDPA kernel calls the BLAS symbol `sgemm_`, which in a process that has loaded
    torch resolves to torch's MKL. MKL then starts an OpenMP team inside each of ExecuTorch's
    pool threads; on 2 cores the oversubscription made every multi-token attention call cost
    ~0.5 ms (a 5-token verify of SmolLM2-135M: 24 ms instead of 5). On a phone, without torch,
    the kernel uses ExecuTorch's own GEMM and none of this happens.
    """
    if _MKL is None:
        yield
        return
    get_threads, set_threads = _MKL
    previous = get_threads()
    set_threads(1)
    try:
        yield
    finally:
        set_threads(previous)
