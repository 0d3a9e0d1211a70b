"""The house plan's doors, checked on the source: who may import whom, no import cycle, and one
meaning per file name (no two modules share one, no module shares a stem with a folder beside it).

Every `import` of an mtp_edge module counts, also inside functions: a lazy import still ties the
two modules together. The rooms (see the README's map):
- ground: mtp_edge's own modules other than the CLI, the API and train/; imports only ground;
- quantize: ground; exporter: ground and quantize (never runtime);
- runtime: ground (never exporter); devices and train: ground and runtime;
- the CLI and the API: anything; nothing imports the CLI.
The package root (mtp_edge/__init__.py) counts as the API, whose names it offers: the ground
must not reach it (the version lives in mtp_edge/version.py). A process started with `-m`
counts as an import of its module, so that an export's child process (exporter/lowering_child)
is seen on the parent's side of the graph.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The import packages whose folders stand at the repository root (pyproject's package-dir).
PACKAGES = ("mtp_edge", "mtp_edge.runtime", "mtp_edge.exporter", "mtp_edge.quantize",
            "mtp_edge.devices")  # fmt: skip

ALLOWED = {
    "ground": {"ground"},
    "quantize": {"ground", "quantize"},
    "exporter": {"ground", "quantize", "exporter"},
    "runtime": {"ground", "runtime"},
    "devices": {"ground", "runtime", "devices"},
    "train": {"ground", "runtime", "train"},
    "api": {"ground", "quantize", "exporter", "runtime", "devices", "train"},
    "server": {"ground", "runtime", "devices", "api"},
    "cli": {"ground", "quantize", "exporter", "runtime", "devices", "train", "api", "server"},
}


def package_files() -> dict[str, Path]:
    """Module name -> source file, for every module of the installed packages."""
    modules = {}
    for package in PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for file in sorted(folder.rglob("*.py")):
            parts = file.relative_to(folder).with_suffix("").parts
            if not all((file.parents[i] / "__init__.py").exists() for i in range(len(parts) - 1)):
                continue  # a script in a folder that is not a package (runtime/native/tools)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = file
    return modules


def name_clashes(files: list[Path], root: Path = ROOT) -> list[str]:
    """Module files that share a name (`__init__.py` aside), and modules beside a folder of their
    stem (runtime/x.py next to runtime/x/): either makes a traceback or a reader guess which."""
    by_name: dict[str, list[Path]] = {}
    for file in files:
        if file.name != "__init__.py":
            by_name.setdefault(file.name, []).append(file)
    clashes = [
        f"{name}: " + ", ".join(str(f.relative_to(root)) for f in sorted(same))
        for name, same in sorted(by_name.items())
        if len(same) > 1
    ]
    clashes += [
        f"{file.relative_to(root)} sits beside the folder {file.relative_to(root).with_suffix('')}/"
        for file in sorted(files)
        if file.with_suffix("").is_dir()
    ]
    return clashes


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"  # the package itself re-exports the API's names (mtp_edge.load...)
    if parts[1] in ("quantize", "exporter", "runtime", "devices", "train", "cli", "api", "server"):
        return parts[1]
    return "ground"


def imports(file: Path, module: str, known: set[str]) -> set[str]:
    """The mtp_edge modules `file` imports anywhere (module level or inside functions), the
    package root `mtp_edge` included, and the modules it starts as processes (`-m NAME` in an
    argument list: the child's imports run because of the parent)."""
    tree = ast.parse(file.read_text())
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # `from pkg import module` imports the module; `from pkg import name`, the package
            names = [f"{base}.{a.name}" for a in node.names]
            names = [name if name in known else base for name in names]
        elif isinstance(node, ast.List | ast.Tuple):
            names = started_modules(node)
        for name in names:
            while name and name not in known:  # `from pkg.module import function` -> pkg.module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def started_modules(node: ast.List | ast.Tuple) -> list[str]:
    """The module an argument list runs with `-m` (`[sys.executable, "-m", "mtp_edge.x", ...]`)."""
    texts = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    return [
        name
        for flag, name in zip(texts, texts[1:], strict=False)
        if flag == "-m" and isinstance(name, str) and name.startswith("mtp_edge")
    ]


def graph() -> dict[str, set[str]]:
    files = package_files()
    known = set(files)
    return {m: imports(f, m, known) for m, f in files.items()}


def test_every_package_is_found():
    modules = set(package_files())
    names = ("mtp_edge.cli", "mtp_edge.cli.run", "mtp_edge.manifest", "mtp_edge.runtime.loop",
             "mtp_edge.train", "mtp_edge.exporter.pipeline",
             "mtp_edge.devices.harness")  # fmt: skip
    for name in names:
        assert name in modules


def test_an_installed_package_has_the_kernel_sources():
    """A wheel carries only the files pyproject's package data names: every source and header
    the Python runtime compiles into our kernels (runtime/executorch_ops.py) must be there."""
    import tomllib

    from mtp_edge.runtime import executorch_ops

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = set(data["tool"]["setuptools"]["package-data"]["mtp_edge.runtime"])
    needed = {str(p.relative_to(ROOT / "runtime")) for p in executorch_ops.SOURCES}
    needed |= {str(p.relative_to(ROOT / "runtime")) for p in executorch_ops.HEADERS}
    assert needed <= shipped, sorted(needed - shipped)
    # and every header the sources include from their own folder
    for source in executorch_ops.SOURCES + executorch_ops.HEADERS:
        for line in source.read_text().splitlines():
            if line.startswith('#include "'):
                assert f"native/src/{line.split(chr(34))[1]}" in shipped, (source.name, line)


def test_one_meaning_per_file_name():
    clashes = name_clashes(list(package_files().values()))
    assert not clashes, "rename so that each file name is one module's:\n" + "\n".join(clashes)


def test_the_name_check_sees_shared_names_and_folders(tmp_path):
    for path in ("a/report.py", "b/report.py", "b/native.py", "b/native/x.cpp", "a/__init__.py",
                 "b/__init__.py", "a/only.py"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert name_clashes(list(tmp_path.rglob("*.py")), tmp_path) == [
        "report.py: a/report.py, b/report.py",
        "b/native.py sits beside the folder b/native/",
    ]


def test_imports_go_through_the_doors():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            if room(target) not in ALLOWED[room(module)] and room(target) != room(module):
                wrong.append(f"{module} ({room(module)}) imports {target} ({room(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path):
    """The checker itself: a function-level import counts, and a two-module cycle is found."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from mtp_edge.runtime import loop\n")
    assert imports(a, "mtp_edge.exporter.a", {"mtp_edge.runtime.loop"}) == {"mtp_edge.runtime.loop"}
    assert room("mtp_edge.exporter.a") == "exporter" and "runtime" not in ALLOWED["exporter"]


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_package_root_is_in_the_graph_and_the_ground_does_not_reach_it():
    edges = graph()
    assert "mtp_edge" in edges and "mtp_edge.api" in edges["mtp_edge"]
    # cpu_class: MTP_EDGE_CPU_CLASS must act as mtp_edge loads, before ExecuTorch does
    assert edges["mtp_edge"] - {"mtp_edge.api"} <= {"mtp_edge.version", "mtp_edge.cpu_class"}
    wrong = [m for m in edges if room(m) == "ground" and "mtp_edge" in reachable(edges, m)]
    assert not wrong, wrong


def test_the_export_child_does_not_reenter_the_parent():
    """The parent (exporter.pipeline, through exporter.lowering_parent) starts the child
    (exporter.lowering_child); both import the loading module, and the child reaches neither
    the parent's modules nor the API or the CLI."""
    edges = graph()
    child = "mtp_edge.exporter.lowering_child"
    assert child in edges["mtp_edge.exporter.lowering_parent"]  # seen through `-m`
    assert "mtp_edge.exporter.loading" in edges[child]
    assert "mtp_edge.exporter.loading" in edges["mtp_edge.exporter.pipeline"]
    parent_side = {
        "mtp_edge.exporter.pipeline",
        "mtp_edge.exporter.lowering_parent",
        "mtp_edge.api",
    }
    assert not reachable(edges, child) & parent_side
    assert not any(room(m) == "cli" for m in reachable(edges, child))


def test_the_checker_sees_the_root_and_started_processes(tmp_path):
    a = tmp_path / "a.py"
    a.write_text(
        "from mtp_edge import __version__, logs\n"
        "ARGS = [sys.executable, '-m', 'mtp_edge.exporter.child', '1']\n"
    )
    known = {"mtp_edge", "mtp_edge.logs", "mtp_edge.exporter.child"}
    assert imports(a, "mtp_edge.exporter.a", known) == known
