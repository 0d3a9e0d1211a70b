"""The compiled kernels of our ops (`mtp_edge::sdpa`, the linears `linear_i8`, `linear_i4`,
`linear_i6`, the glue, defined in mtp_edge/ops.py) for the Python runtime.

`load_kernels()` compiles runtime/native/src/{llama_ops,int8_linear,python_ops}.cpp against the
installed ExecuTorch wheel once (seconds with g++; cached by content in the user's cache
directory) and loads the library, which registers the kernels with ExecuTorch's runtime. The
native runner and the phone link the same sources.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mtp_edge import cpu_class, logs
from mtp_edge.errors import UserError

_SRC = Path(__file__).parent / "native" / "src"
SOURCES = [_SRC / "llama_ops.cpp", _SRC / "int8_linear.cpp", _SRC / "python_ops.cpp"]
HEADERS = [_SRC / "llama_ops.h", _SRC / "int8_linear.h", _SRC / "threadpool.h"]

_loaded: ctypes.CDLL | None = None


def _executorch_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("executorch is not installed: pip install executorch==1.5.1")
    return Path(list(spec.submodule_search_locations)[0])


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtp-edge" / "ops"


def library_path(flags: list[str] | tuple[str, ...] = ()) -> Path:
    """Where the compiled kernel library for these sources, this ExecuTorch and these extra
    compiler `flags` (see `build`) is cached."""
    root = _executorch_root()
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(str(root).encode())
    for flag in flags:
        digest.update(b"\0" + flag.encode())
    digest.update((root / "lib" / "libexecutorch.so").read_bytes()[:4096])
    return _cache_dir() / f"libmtp_ops-{digest.hexdigest()[:16]}.so"


def build(target: Path, flags: list[str] | tuple[str, ...] = ()) -> Path:
    """Compile the kernel library to `target`; `flags` are extra compiler flags (e.g.
    -DMTP_EDGE_BASELINE: the baseline version alone, as other architectures build it)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise UserError(
            "no C++ compiler found: ExecuTorch bundles need mtp-edge's kernels, built once with "
            "g++; install g++ (e.g. apt-get install g++) or set CXX"
        )
    root = _executorch_root()
    include, lib = root / "include", root / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [
            compiler, "-O3", "-DNDEBUG", "-fPIC", "-shared", "-std=gnu++17",
            "-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED",
            "-DET_USE_THREADPOOL", *flags, f"-I{SOURCES[0].parent}", "-isystem", str(include),
            "-isystem", str(include / "executorch/runtime/core/portable_type/c10"),
            *map(str, SOURCES), f"-L{lib}", "-lexecutorch", "-lexecutorch_threadpool",
            f"-Wl,-rpath,{lib}", "-o", str(built),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
            raise UserError(f"building mtp-edge's kernels failed:\n{tail}")
        os.replace(built, target)  # atomic: a concurrent build of the same sources is harmless
    return target


def load_kernels() -> None:
    """Make our ops' .out kernels runnable under executorch.runtime in this process;
    idempotent."""
    global _loaded
    if _loaded is not None:
        return
    cpu_class.check()  # MTP_EDGE_CPU_CLASS applied, or its error, before a program runs
    # ExecuTorch's runtime (and its kernel registry) must be loaded before our library joins it.
    from executorch.extension.pybindings import portable_lib  # noqa: F401

    path = library_path()
    if not path.is_file():
        logs.say("[mtp-edge] building our kernels (once)")  # progress: not with -q
        build(path)
    _loaded = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
