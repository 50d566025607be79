"""The import graph of service/: modules, imports between them, cycles, imports that point up the layers, and sizes.

`python scripts/import_graph.py` prints the figures; tests/test_architecture.py holds them to zero cycles and zero
upward imports. Layers are ranked in LAYERS (a module takes the rank of the longest prefix that names it): a module
may import its own rank or lower ones, never a higher one. `--layers FILE` ranks with another table (JSON object of
prefix -> rank), e.g. to measure an older tree whose modules had other names.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 400  # STYLE.md: modules under ~400 lines
GENERATED = ("service.rpc.cosyvoice_pb2", "service.rpc.cosyvoice_pb2_grpc")  # grpcio-tools output, not ours

# Lowest first. Transports (api, rpc) and the CLI sit on the runtime; the runtime on speech and the family registry;
# speech on the family protocol; a family on the shared layers, the engine kit, the frontend, the stores and the
# checks of verification.
LAYERS: dict[str, int] = {
    "service.errors": 0,
    "service.bundle": 1,
    "service.settings": 1,
    "service.levers": 1,  # the engine profile, read by the settings
    "service.requestids": 1,
    "service.audio": 2,
    "service.frontend": 2,
    "service.engine": 2,
    "service.stores": 2,
    "service.verify": 2,  # the checks every family's verification reports with
    "service.access": 3,
    "service.layers": 3,  # what several families share, on the kit
    "service.families.model": 3,
    "service.families": 4,  # the families themselves (service.families.<name>)
    "service.families.registry": 5,
    "service.speech": 6,
    "service.runtime": 7,
    "service.served": 7,  # the runtime's served models
    "service.memory_plan": 7,  # the runtime's memory budget
    "service.api": 8,
    "service.rpc": 8,
    "service.cli": 8,
    "service.__main__": 9,
    "service": 9,
}


@dataclass(frozen=True)
class Graph:
    """Modules (dotted names) with their internal imports and line counts."""

    imports: dict[str, set[str]]
    lines: dict[str, int]

    @property
    def edges(self) -> int:
        return sum(len(v) for v in self.imports.values())


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, root: Path = REPO) -> set[str]:
    """Absolute names a file imports (relative imports resolved); `from a import b` gives `a.b`, which names the
    module a.b if there is one, else what module a defines (so `from pkg import submodule` is no import of pkg's
    __init__ beyond the one every submodule import implies)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pkg = module_name(path, root).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if a.name != "*" else base for a in node.names)
    return found


def build(package: str = "service", root: Path = REPO) -> Graph:
    """Every module of `package` and the modules of `package` it imports (a name resolves to the module it names,
    or to the module that defines it: `from service.x import y` is an import of service.x.y if that is a module)."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    paths = {m: p for m, p in paths.items() if m not in GENERATED}
    imports: dict[str, set[str]] = {}
    for mod, path in paths.items():
        targets = {_resolve(name, paths) for name in imported_names(path, root) if name.split(".")[0] == package}
        imports[mod] = {t for t in targets if t is not None and t != mod}
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in paths.items()}
    return Graph(imports, lines)


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.imports.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph.imports):
        if v not in index:
            visit(v)
    return sorted(found)


def rank(module: str, layers: Mapping[str, int] = LAYERS) -> int:
    """The rank of the longest prefix of `module` in `layers` (KeyError when none names it)."""
    name = module
    while name:
        if name in layers:
            return layers[name]
        name = name.rpartition(".")[0]
    raise KeyError(f"{module} is in no layer of the table")


def upward(graph: Graph, layers: Mapping[str, int] = LAYERS) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module ranks higher than its importer."""
    return sorted((m, t) for m, ts in graph.imports.items() for t in ts if rank(t, layers) > rank(m, layers))


def top_level(graph: Graph, package: str = "service") -> list[str]:
    """Modules directly in the package (not packages themselves, not __init__ / __main__)."""
    return sorted(m for m in graph.imports if m.count(".") == 1 and m != f"{package}.__main__" and not _is_package(m))


def _is_package(module: str) -> bool:
    return (REPO / Path(*module.split("."))).is_dir()


def over(graph: Graph, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    return sorted(((m, n) for m, n in graph.lines.items() if n > limit), key=lambda x: -x[1])


def report(graph: Graph, layers: Mapping[str, int]) -> dict[str, object]:
    return {
        "modules": len(graph.imports),
        "imports": graph.edges,
        "cycles": cycles(graph),
        "upward_imports": [f"{a} -> {b}" for a, b in upward(graph, layers)],
        "top_level_modules": top_level(graph),
        f"modules_over_{MAX_LINES}_lines": [f"{m} ({n})" for m, n in over(graph)],
    }


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=Path, help="JSON object prefix -> rank (default: this script's LAYERS)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    layers = json.loads(args.layers.read_text(encoding="utf-8")) if args.layers else LAYERS
    figures = report(build(), layers)
    for key, value in figures.items():
        shown = len(value) if isinstance(value, list) else value
        print(f"{key}: {shown}")
        if isinstance(value, list):
            for item in value:
                print(f"  {item}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
