"""Build and run the native C++ runtime (runtime/native): the `mtp-runner` entry point.

The C++ core is built with CMake against the pip-installed ExecuTorch into runtime/native/build
the first time it is needed (and brought up to date on later calls, which costs a second when
nothing changed); then the runner binary takes over the process with the same arguments.
`mtp-runner --help` and a missing or wrong `--bundle` are answered before anything is built.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from mtp_edge.cpu_class import ENV as CPU_CLASS_ENV
from mtp_edge.errors import UserError

SOURCE_DIR = Path(__file__).parent / "native"
BUILD_DIR = SOURCE_DIR / "build"
RUNNER = BUILD_DIR / "mtp-runner"
UNIT_TESTS = BUILD_DIR / "mtp-native-tests"
RUNNER_SOURCE = SOURCE_DIR / "tools" / "mtp_runner.cpp"  # its usage text is the one copy
# What a configured build directory holds besides CMakeCache.txt: the generator's own file
# (a configure that failed leaves the cache without it).
GENERATOR_FILES = ("Makefile", "build.ninja")


def nlohmann_include() -> Path | None:
    """The pip package nlohmann_json's header directory (the build's fallback for nlohmann/json
    when the system has none), without importing it."""
    spec = importlib.util.find_spec("nlohmann_json")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(spec.submodule_search_locations[0]) / "include"
    return include if (include / "nlohmann" / "json.hpp").is_file() else None


def configured(build_dir: Path) -> bool:
    return (build_dir / "CMakeCache.txt").is_file() and any(
        (build_dir / name).is_file() for name in GENERATOR_FILES
    )


def build(
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    build_dir: Path = BUILD_DIR,
    configure_args: Sequence[str] = (),
) -> Path:
    """Configure (when the build directory has no build system yet) and build the core, runner
    and C++ tests; returns the runner's path. A configure that fails leaves no build directory
    behind, so that the next call configures afresh. `configure_args` go to cmake after ours."""
    if not (SOURCE_DIR / "CMakeLists.txt").is_file():
        raise UserError(
            f"the native sources are not at {SOURCE_DIR}: mtp-runner needs a source checkout "
            "installed with pip install -e ."
        )
    if shutil.which("cmake") is None:
        raise UserError("cmake is not installed: install cmake and a C++17 compiler (g++)")
    build_dir = Path(build_dir)
    if not configured(build_dir):
        command = ["cmake", "-S", str(SOURCE_DIR), "-B", str(build_dir)]
        command += ["-DCMAKE_BUILD_TYPE=Release", f"-DMTP_PYTHON={sys.executable}"]
        include = nlohmann_include()
        if include is not None:
            command.append(f"-DMTP_NLOHMANN_INCLUDE={include}")
        try:
            _run([*command, *configure_args], progress)
        except UserError:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
    jobs = jobs or os.cpu_count() or 1
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs)], progress)
    return build_dir / "mtp-runner"


def _run(command: list[str], progress: Callable[[str], None] | None) -> None:
    if progress:
        progress(f"[native] {' '.join(command)}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return
    lines = (done.stdout + done.stderr).strip().splitlines()
    # Our CMakeLists says what is missing in one "error: ..." message (CMake indents it and may
    # wrap it): that line alone, not the screenful around it.
    for i, line in enumerate(lines):
        if line.strip().startswith("error: "):
            message = [line.strip()]
            for more in lines[i + 1 :]:
                if not more.strip():
                    break
                message.append(more.strip())
            raise UserError(" ".join(message).removeprefix("error: "))
    raise UserError(
        "building the native runtime failed (see runtime/native/README.md for the "
        "requirements):\n" + "\n".join(lines[-15:])
    )


def usage() -> str:
    """mtp-runner's usage text, read from its source (tools/mtp_runner.cpp kUsage)."""
    try:
        source = RUNNER_SOURCE.read_text()
    except OSError:
        raise UserError(
            f"the native sources are not at {SOURCE_DIR}: mtp-runner needs a source checkout "
            "installed with pip install -e ."
        ) from None
    found = re.search(r'kUsage\s*=\s*((?:"(?:[^"\\\n]|\\.)*"\s*)+);', source)
    if found is None:
        raise UserError(f"{RUNNER_SOURCE} has no kUsage text")
    literals = re.findall(r'"((?:[^"\\\n]|\\.)*)"', found.group(1))
    return "".join(ast.literal_eval(f'"{literal}"') for literal in literals)


def value_flags(text: str) -> set[str]:
    """The options that take a value, from the usage's synopsis ("--k K", "--drafter a|b")."""
    synopsis = []
    for line in text.splitlines():
        if not (line.startswith("usage:") or line.startswith(" ")):
            break
        synopsis.append(line)
    return set(re.findall(r"(--[\w-]+) [^\s\[\]()|-]", "\n".join(synopsis)))


def check_arguments(args: Sequence[str]) -> bool:
    """What mtp-runner can answer without the native build: True for --help; a missing
    --bundle, or one that is not a bundle directory, is a UserError (the runner's message)."""
    takes_value = value_flags(usage())
    bundle = None
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in ("--help", "-h"):
            return True
        if flag in takes_value:
            if i + 1 >= len(args):
                raise UserError(f"{flag} needs a value (see --help)")
            if flag == "--bundle":
                bundle = args[i + 1]
            i += 1
        i += 1
    if bundle is None:
        raise UserError("--bundle DIR is required (see --help)")
    if not Path(bundle).is_dir():
        raise UserError(f"bundle {bundle} does not exist: export one with mtp-export")
    if not (Path(bundle) / "manifest.json").is_file():
        raise UserError(f"{bundle} is not a bundle: it has no manifest.json")
    return False


def main() -> None:
    """`mtp-runner ...`: check the arguments, build if needed, then run the native runner with
    these arguments."""
    args = sys.argv[1:]
    try:
        if os.environ.get(CPU_CLASS_ENV):
            raise UserError(
                f"{CPU_CLASS_ENV} runs another CPU class's kernels in the Python runtime only "
                f"(the native runner's XNNPACK picks its kernels as the binary loads): unset it, "
                f"or measure with mtp-bench"
            )
        if check_arguments(args):
            print(usage(), end="")
            return
        runner = build(progress=lambda line: print(line, file=sys.stderr))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.execv(runner, [str(runner), *args])
