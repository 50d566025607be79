"""Walk every import and enforce the layering of STYLE.md (who may import torch, onnxruntime, redis, FastAPI)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import import_graph
import pytest
from import_graph import module_name

REPO = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Absolute module names imported by a file (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pkg = module_name(path).split(".")
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
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


ALL_SERVICE = files("service")
ALL_EXPORT = files("export")


def _top(name: str) -> str:
    return name.split(".")[0]


def _owner(path: Path) -> str:
    """The layer a service file belongs to: 'engine', 'frontend', 'api', or the module name."""
    parts = path.relative_to(REPO / "service").parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def test_there_is_something_to_check() -> None:
    assert ALL_SERVICE and ALL_EXPORT


@pytest.mark.parametrize("path", ALL_SERVICE, ids=lambda p: str(p.relative_to(REPO)))
def test_service_layering(path: Path) -> None:
    owner = _owner(path)
    mods = imports_of(path)
    tops = {_top(m) for m in mods}
    assert "torch" not in tops, "service/ must run without torch"
    if owner != "engine":
        assert "onnxruntime" not in tops, "only service/engine imports onnxruntime"
    if path.relative_to(REPO / "service").as_posix() != "engine/ov_session.py":
        assert "openvino" not in tops, "only service/engine/ov_session.py imports openvino (sessions.py picks the runtime)"
    if owner != "stores":
        assert not tops & {"redis", "limits"}, "only service/stores reaches redis (and limits, the rate-limit counters)"
    if owner != "api":
        assert not tops & {"fastapi", "starlette", "uvicorn"}, "only service/api imports the web stack"
    internal = {m for m in mods if m.startswith("service.")}
    layer = {m.split(".")[1] for m in internal}
    if owner == "engine":
        assert not layer & {"frontend", "speech", "api", "rpc", "stores", "settings", "families", "layers"}, (
            "the kit imports no family"
        )
    if owner == "layers":
        assert not layer & {"frontend", "speech", "api", "rpc", "stores", "settings", "families"}, "layers import the kit only"
    if owner == "frontend":
        assert not layer & {"engine", "speech", "api", "rpc", "stores", "settings", "families"}
    if owner in ("errors", "bundle", "settings", "levers"):
        assert layer <= {"errors", "bundle", "levers"}
    if owner == "speech":
        assert not layer & {"api", "rpc", "runtime"}
    if owner in ("runtime", "access", "stores"):
        assert not layer & {"api", "rpc"}, "the runtime is transport-neutral: HTTP, gRPC and the CLI build on it"


TRANSPORTS = ("api", "rpc")
FAMILY_PROTOCOL = "service.families.model"


def _family_package(module: str) -> str | None:
    """`service.families.<name>` for a module inside a family package; None for the protocol, the registry, the
    prompt-voice library every family shares (service/families/voices.py), others."""
    parts = module.split(".")
    if parts[:2] != ["service", "families"] or len(parts) < 3 or parts[2] in ("model", "registry", "voices", "loaded"):
        return None
    return ".".join(parts[:3])


@pytest.mark.parametrize("path", ALL_SERVICE, ids=lambda p: str(p.relative_to(REPO)))
def test_transports_see_the_family_protocol_only(path: Path) -> None:
    """HTTP and gRPC reach a model through the runtime, speech and the family protocol: never an engine, a family
    package or the registry (so a new family touches no route)."""
    if _owner(path) not in TRANSPORTS:
        return
    internal = {m for m in imports_of(path) if m.startswith("service.")}
    assert not {m for m in internal if m.startswith("service.engine")}, "transports do not import the engine"
    families = {m for m in internal if m.startswith("service.families")}
    beyond = sorted(m for m in families if m != FAMILY_PROTOCOL and not m.startswith(f"{FAMILY_PROTOCOL}."))
    assert not beyond, f"transports import the family protocol ({FAMILY_PROTOCOL}) only, not {beyond}"


@pytest.mark.parametrize("path", ALL_SERVICE, ids=lambda p: str(p.relative_to(REPO)))
def test_only_the_registry_imports_a_family(path: Path) -> None:
    """A family package is imported by itself and by service/families/registry.py, nowhere else in service/."""
    own = _family_package(module_name(path))
    if module_name(path) == "service.families.registry":
        return
    foreign = {f for m in imports_of(path) if (f := _family_package(m)) is not None and f != own}
    assert not foreign, f"only service/families/registry.py imports a family package, not {sorted(foreign)}"


def test_the_import_graph_has_no_cycle_and_points_down() -> None:
    """Zero cycles between modules; no module imports one of a higher layer (scripts/import_graph.py ranks them)."""
    graph = import_graph.build()
    assert import_graph.cycles(graph) == []
    assert import_graph.upward(graph) == []


def _export_may_import(module: str) -> bool:
    """service.bundle, service.errors, a family's contract module (or its light package, which only names it)."""
    parts = module.split(".")
    if parts[:2] in (["service", "bundle"], ["service", "errors"]):
        return True
    return parts[:2] == ["service", "families"] and len(parts) >= 3 and (len(parts) == 3 or parts[3] == "contract")


@pytest.mark.parametrize("path", ALL_EXPORT, ids=lambda p: str(p.relative_to(REPO)))
def test_export_uses_only_the_bundle_contracts(path: Path) -> None:
    """export/ reads the neutral bundle contract and each family's contract module, nothing else of service/."""
    internal = {m for m in imports_of(path) if m.startswith("service.") or m == "service"}
    assert all(_export_may_import(m) for m in internal), sorted(m for m in internal if not _export_may_import(m))


@pytest.mark.parametrize("path", sorted((REPO / "service" / "families").glob("*/__init__.py")), ids=lambda p: p.parent.name)
def test_a_family_package_only_names_itself(path: Path) -> None:
    """Importing a family's contract (export/ does) must not load its engine: the package's __init__ is a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert all(isinstance(n, ast.Expr) for n in tree.body), f"{path} does more than name its package"


FAMILY_NAMES = re.compile(r"cosyvoice[0-9]|CosyVoice-?[0-9]|Fun-CosyVoice|CosyVoice-300M|\bv[0-9]\b|family_v", re.I)
KIT_FILES = sorted(p for p in (REPO / "service" / "engine").rglob("*") if p.suffix in (".py", ".c", ".h", ".md"))


@pytest.mark.parametrize("path", KIT_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_kit_names_no_family(path: Path) -> None:
    """The engine kit is family-neutral: no family's name in its code or words (cgroup v1/v2 are not families)."""
    text = path.read_text(encoding="utf-8").replace("cgroup v1", "cgroup").replace("cgroup v2", "cgroup")
    found = sorted({m.group(0) for m in FAMILY_NAMES.finditer(text)})
    assert not found, f"{path.relative_to(REPO)} names {found}"


def test_no_module_is_over_the_size_limit() -> None:
    """STYLE.md: modules under ~400 lines (generated stubs aside)."""
    graph = import_graph.build()
    assert import_graph.over(graph) == []
