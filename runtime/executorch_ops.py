"""Our own attention op for ExecuTorch programs, `mtp_edge::sdpa`: causal SDPA over a static
KV cache, computed one (row, head) at a time so that a row's result does not depend on how many
rows share the call.

Why not ExecuTorch's `llama.custom_sdpa`: its rows move by a few ulps with the number of rows in
a call (and with the row's place in it), and in a model with 8-bit dynamically quantized
activations those ulps grow into different tokens. Speculative decoding must give the tokens
plain decoding gives, so with ExecuTorch's op every row of a verification had to be its own
one-row call (reading the whole cache once per row). With this op a (k+1)-token verification is
one call whose rows are bitwise the single steps', and every runtime runs the same kernel: the
Python runtime loads it from here, the native runner and the phone link it
(runtime/native/src/llama_ops.cpp).

- `define()` registers the op with torch (functional and out variants, an eager implementation
  and a shape function) so that models using it can be traced, exported and lowered;
- `load_kernels()` compiles runtime/native/src/{llama_ops,python_ops}.cpp against the installed
  ExecuTorch wheel once (a second or two with g++; cached by content in the user's cache
  directory) and loads the library, which registers the kernel with ExecuTorch's runtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from mtp_edge.errors import UserError

_SRC = Path(__file__).parent / "native" / "src"
SOURCES = [_SRC / "llama_ops.cpp", _SRC / "python_ops.cpp"]
HEADERS = [_SRC / "llama_ops.h"]

_library: torch.library.Library | None = None
_loaded: ctypes.CDLL | None = None


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int):
    """Eager reference: q [1, T, H, D], caches [1, S, KVH, D]; row i sees slots 0..start + i."""
    t, heads = q.shape[1], q.shape[2]
    n = start + t
    k = k_cache[:, :n].transpose(1, 2)
    v = v_cache[:, :n].transpose(1, 2)
    group = heads // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    visible = torch.arange(n)[None] <= (start + torch.arange(t))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible)
    return out.transpose(1, 2).contiguous()


def define() -> None:
    """Register torch.ops.mtp_edge.sdpa (and .out) with torch; idempotent."""
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("mtp_edge", "DEF")
    lib.define("sdpa(Tensor query, Tensor k_cache, Tensor v_cache, SymInt start_pos) -> Tensor")
    lib.define(
        "sdpa.out(Tensor query, Tensor k_cache, Tensor v_cache, SymInt start_pos, *, "
        "Tensor(a!) out) -> Tensor(a!)"
    )

    def functional(q, k_cache, v_cache, start_pos):
        return attention(q, k_cache, v_cache, int(start_pos))

    def out_variant(q, k_cache, v_cache, start_pos, *, out):
        out.resize_(q.shape).copy_(attention(q, k_cache, v_cache, int(start_pos)))
        return out

    lib.impl("sdpa", functional, "CPU")
    lib.impl("sdpa.out", out_variant, "CPU")
    lib.impl("sdpa", lambda q, k, v, s: torch.empty_like(q), "Meta")
    lib.impl("sdpa.out", lambda q, k, v, s, *, out: out, "Meta")
    _library = lib


def _executorch_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("executorch is not installed: pip install executorch==1.5.1")
    return Path(list(spec.submodule_search_locations)[0])


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtp-edge" / "ops"


def library_path() -> Path:
    """Where the compiled kernel library for these sources and this ExecuTorch is cached."""
    root = _executorch_root()
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(str(root).encode())
    digest.update((root / "lib" / "libexecutorch.so").read_bytes()[:4096])
    return _cache_dir() / f"libmtp_ops-{digest.hexdigest()[:16]}.so"


def build(target: Path) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise UserError(
            "no C++ compiler found: ExecuTorch bundles need mtp-edge's attention kernel, built "
            "once with g++; install g++ (e.g. apt-get install g++) or set CXX"
        )
    root = _executorch_root()
    include, lib = root / "include", root / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [
            compiler, "-O3", "-DNDEBUG", "-fPIC", "-shared", "-std=gnu++17",
            "-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED",
            "-DET_USE_THREADPOOL", f"-I{SOURCES[0].parent}", "-isystem", str(include),
            "-isystem", str(include / "executorch/runtime/core/portable_type/c10"),
            *map(str, SOURCES), f"-L{lib}", "-lexecutorch", "-lexecutorch_threadpool",
            f"-Wl,-rpath,{lib}", "-o", str(built),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
            raise UserError(f"building mtp-edge's attention kernel failed:\n{tail}")
        os.replace(built, target)  # atomic: a concurrent build of the same sources is harmless
    return target


def load_kernels() -> None:
    """Make mtp_edge::sdpa.out runnable under executorch.runtime in this process; idempotent."""
    global _loaded
    if _loaded is not None:
        return
    # ExecuTorch's runtime (and its kernel registry) must be loaded before our library joins it.
    from executorch.extension.pybindings import portable_lib  # noqa: F401

    path = library_path()
    if not path.is_file():
        print("[mtp-edge] building the attention kernel (once)", file=sys.stderr)
        build(path)
    _loaded = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
