"""The import rules of docs/architecture.md, checked on the source tree: every import, at the top of a module or
inside a function, counts."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("common", "protos", "services")
ROLES = ("router", "verifier", "drafter")
APPS = ("engine", "training", "bench", "serving", "cli")
# The layers of docs/architecture.md, bottom to top: a unit (a package of common/, a module at common/'s top, a role,
# an application package) imports its own modules and units of lower layers only.
LAYERS = (
    ("protos", "common.errors"),
    ("common.argtypes", "common.sampling", "common.prompts", "common.tokens", "common.telemetry", "common.kernels"),
    ("common.models", "common.wire"),
    ("common.runtime",),
    ("common.contracts", "common.config"),
    ("common.config_reference",),
    ROLES,
    *((app,) for app in APPS),
)
LAYER = {unit: n for n, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("blockspec", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for top in TOPS for p in sorted((ROOT / top).rglob("*.py"))}


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The blockspec modules a file imports (`from package import module` counts as the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("blockspec")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("blockspec"):
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
            found |= subs or {node.module}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imports(path, modules) for name, path in modules.items()}


def area(module: str) -> str:
    """'common', 'protos', a role ('router', ...) or an application package ('cli', ...)."""
    parts = module.split(".")
    return parts[2] if parts[1] == "services" and len(parts) > 2 else parts[1]


def unit(module: str) -> str:
    """The unit of the layer rule: 'common.runtime', 'common.contracts', 'protos', a role or an application package
    ('common' and 'services' for the two package files that hold only a docstring)."""
    parts = module.split(".")
    return ".".join(parts[1:3]) if parts[1] == "common" and len(parts) > 2 else area(module)


def violations(graph: dict[str, set[str]], source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} imports {i}" for m, deps in graph.items() if area(m) == source
                  for i in deps if area(i) in forbidden)


def test_the_graph_sees_every_package(graph):
    assert {area(m) for m in graph} == {"common", "protos", "services", *ROLES, *APPS}
    assert {unit(m) for m in graph} - {"common", "services"} == LAYER.keys()  # every unit has its layer
    assert "blockspec.common.contracts" in graph["blockspec.services.router.step_loop"]  # the parser reads imports


def test_common_and_protos_import_no_service(graph):
    assert violations(graph, "common", ("services", *ROLES, *APPS)) == []
    assert violations(graph, "protos", ("common", "services", *ROLES, *APPS)) == []


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_no_other_role_and_no_application_package(graph, role):
    assert violations(graph, role, tuple(r for r in ROLES if r != role) + APPS) == []


def test_model_building_does_not_reach_into_the_router(graph):
    assert violations(graph, "build", ("router",)) == []


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a unit of the same or a higher layer than the importer's own (its own unit is fine)."""
    return sorted(f"{m} imports {i}" for m, deps in graph.items() for i in deps
                  if unit(m) != unit(i) and LAYER.get(unit(i), 0) >= LAYER.get(unit(m), len(LAYERS)))


def test_every_import_goes_down_the_layers(graph):
    assert layer_violations(graph) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"blockspec.common.models.decoder": {"blockspec.common.runtime.runner", "blockspec.common.kernels.x"},
             "blockspec.services.serving.rollout": {"blockspec.services.cli.validate",
                                                    "blockspec.services.serving.golive"},
             "blockspec.services.router.app": {"blockspec.services.verifier.service"}}
    assert layer_violations(graph) == [
        "blockspec.common.models.decoder imports blockspec.common.runtime.runner",
        "blockspec.services.router.app imports blockspec.services.verifier.service",
        "blockspec.services.serving.rollout imports blockspec.services.cli.validate"]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The units' graph: an edge where any module of one imports any module of another."""
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(unit(m), set()).update(unit(i) for i in deps if unit(i) != unit(m))
    return out


def test_the_package_graph_is_acyclic(graph):
    """Function-level imports included (the parser walks every node): serving and build, or serving and cli, may
    not import each other, however deep in a function the import sits."""
    packages = package_graph(graph)
    assert "training" in packages["cli"] and "bench" in packages["serving"]  # edges the graph must see
    assert cycles(packages) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is an import cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v] & graph.keys()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_the_cycle_check_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f", "a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]


def loaded_after_import(module: str) -> set[str]:
    code = f"import importlib, sys; importlib.import_module({module!r}); print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return set(out.split())


def test_the_router_loads_neither_role_nor_torch():
    """At run time too (an import hidden behind another module counts): the router's modules, imported in a fresh
    interpreter, load no role module, no model code and no torch."""
    router = sorted(m for m in source_modules() if area(m) == "router")
    code = ("import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in router)
            + "print('\\n'.join(sys.modules))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout.split())
    assert "blockspec.services.router.step_loop" in loaded
    assert sorted(m for m in loaded if m.startswith("blockspec.") and area(m) in ("verifier", "drafter", *APPS)) == []
    assert "torch" not in loaded and "blockspec.common.runtime.runner" not in loaded


def test_the_contracts_load_no_torch():
    loaded = loaded_after_import("blockspec.common.contracts")
    assert "blockspec.common.contracts" in loaded and "torch" not in loaded


def test_the_layer_diagram_in_the_docs_is_the_rule():
    """docs/architecture.md draws LAYERS, top first: a line per layer, its units before the description."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    diagram = text.split("## Layers and import rules", 1)[1].split("```")[1]
    drawn = []
    for line in diagram.strip().splitlines():
        words = line.split()
        units = words[: next((i for i, w in enumerate(words) if w not in LAYER and not w.startswith("common.")),
                             len(words))]
        drawn.append(set(units))
    assert drawn == [set(units) for units in reversed(LAYERS)]
