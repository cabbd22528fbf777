"""The packages import one way: no import circle, and no module imports one above it.

The layers, lowest first: ``configuration`` ← ``processing`` ← the model's parts (every ``modeling_dsv41`` module the
model is built from: attention, MoE, Engram, the cache, the released format, placement, ...) ← the model
(``modeling_dsv41.modeling_dsv41``) ← what uses the model (training, the optimizer, the CLI, Hub export, the serving
exports and the package's ``__init__``, which registers the Auto classes). Imports are read from the source (function-level ones
too), so an import deferred into a function to dodge a circle counts like any other. Within the parts, a subpackage
(``released/``, ``generation/``) is one unit: its modules together sit above or below a flat module, never both.
"""

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configuration", "processing", "modeling_dsv41")
MODEL = "modeling_dsv41.modeling_dsv41"
USERS = (
    "modeling_dsv41.training",
    "modeling_dsv41.optim",
    "modeling_dsv41.cli",
    "modeling_dsv41.hub.export",
    "modeling_dsv41.serving",
)


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its source (``from x import submodule`` names the
    submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            if target.split(".")[0] in PACKAGES:
                submodules = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
                found |= submodules or {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGES}
    return found - {module}


def _layer(module: str) -> int:
    if module.split(".")[0] == "configuration":
        return 0
    if module.split(".")[0] == "processing":
        return 1
    if module == MODEL:
        return 3
    if module == "modeling_dsv41" or module.startswith(USERS):
        return 4
    return 2


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def test_no_module_imports_one_above_it(graph):
    upward = sorted(
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in graph.items()
        for target in targets
        if _layer(target) > _layer(module)
    )
    assert not upward, "\n".join(upward)


def test_there_is_no_import_circle(graph):
    order, state = [], {}  # depth-first: 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circle = path[path.index(target) :] + [target]
                pytest.fail("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2
        order.append(module)

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(order) == len(graph)


def _unit(module: str) -> str:
    """A module's unit for the package-level graph: its subpackage of ``modeling_dsv41`` (``modeling_dsv41.released``),
    else the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "modeling_dsv41" and len(parts) > 2 else module


def test_subpackages_sit_on_one_level(graph):
    """No circle between a subpackage and the flat modules: the released format's loading uses placement and the
    parallel plans, so they must not import anything of ``released/`` (the number formats live below them all)."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))

    def reachable(unit: str) -> set[str]:
        seen, todo = set(), [unit]
        while todo:
            for target in units.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    circles = sorted(f"{a} <-> {b}" for a in units for b in units.get(a, ()) if a in reachable(b) and a < b)
    assert not circles, "\n".join(circles)


def test_the_codec_imports_nothing_of_ours(graph):
    """The number formats are pure tensor arithmetic below every other module."""
    assert graph["modeling_dsv41.codec"] == set()
    assert "modeling_dsv41.codec" in graph["modeling_dsv41.engram"] & graph["modeling_dsv41.released.conversions"]


def test_the_layout_test_sees_the_imports(graph):
    """The graph is read right: the model imports its parts and the CLI imports the model."""
    assert {"modeling_dsv41.attention", "modeling_dsv41.released.pretrained_io"} <= graph[MODEL]
    assert MODEL in graph["modeling_dsv41.cli.inspection"]
    assert "configuration.configuration_dsv41" in graph["modeling_dsv41.parallel"]
