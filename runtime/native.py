"""Build and run the native C++ runtime (runtime/native): the `mtp-runner` entry point.

The C++ core is built with CMake against the pip-installed ExecuTorch into runtime/native/build
the first time it is needed (and brought up to date on later calls, which costs a second when
nothing changed); then the runner binary takes over the process with the same arguments.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from mtp_edge.errors import UserError

SOURCE_DIR = Path(__file__).parent / "native"
BUILD_DIR = SOURCE_DIR / "build"
RUNNER = BUILD_DIR / "mtp-runner"
UNIT_TESTS = BUILD_DIR / "mtp-native-tests"


def build(jobs: int | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Configure (once) and build the core, runner and C++ tests; returns the runner's path."""
    if not (SOURCE_DIR / "CMakeLists.txt").is_file():
        raise UserError(
            f"the native sources are not at {SOURCE_DIR}: mtp-runner needs a source checkout "
            "installed with pip install -e ."
        )
    if shutil.which("cmake") is None:
        raise UserError("cmake is not installed: install cmake and a C++17 compiler (g++)")
    steps = []
    if not (BUILD_DIR / "CMakeCache.txt").is_file():
        steps.append(
            [
                "cmake",
                "-S",
                str(SOURCE_DIR),
                "-B",
                str(BUILD_DIR),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DMTP_PYTHON={sys.executable}",
            ]
        )
    steps.append(["cmake", "--build", str(BUILD_DIR), "-j", str(jobs or os.cpu_count() or 1)])
    for command in steps:
        if progress:
            progress(f"[native] {' '.join(command)}")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise UserError(
                "building the native runtime failed (see runtime/native/README.md for the "
                "requirements):\n" + "\n".join(tail)
            )
    return RUNNER


def main() -> None:
    """`mtp-runner ...`: build if needed, then run the native runner with these arguments."""
    try:
        runner = build(progress=lambda line: print(line, file=sys.stderr))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.execv(runner, [str(runner), *sys.argv[1:]])
