"""The packages import one way: no import circle, and no module imports one above it.

The layers, lowest first: ``configuration`` ← ``processing`` ← the model's parts (every ``modeling_dsv41`` module the
model is built from: attention, MoE, Engram, the cache, the released format, placement, ...) ← the model
(``modeling_dsv41.modeling_dsv41``) ← what uses the model (training, the optimizer, the CLI, Hub export, the serving
exports and the package's ``__init__``, which registers the Auto classes). Imports are read from the source
(function-level ones too), so an import deferred into a function to dodge a circle counts like any other. Within the
parts, a subpackage (``released/``, ``generation/``) is one unit: its modules together sit above or below a flat
module, never both.

Sizes, read with ``ast`` too: no module of ``modeling_dsv41`` over 600 lines, and no function of the modules a forward
runs through (the model, its decoder layer, attention, MoE, Engram, mHC, DSpark and what they call) over 60 lines, so
that each forward reads top to bottom.
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


MAX_MODULE_LINES = 600
MAX_FORWARD_PATH_FUNCTION_LINES = 60
FORWARD_PATH = (
    "modeling_dsv41.py",
    "decoder_layer.py",
    "residual_stream.py",
    "padding.py",
    "outputs.py",
    "attention.py",
    "sparse_attention.py",
    "layer_cache.py",
    "rotary.py",
    "moe.py",
    "engram.py",
    "hyper_connections.py",
    "dspark.py",
    "norms.py",
    "linear.py",
)
# the forwards the limit is about: each must be found, so that the check cannot pass by missing them
FORWARDS = {
    "DeepseekV41Model.forward",
    "DeepseekV41ForCausalLM.forward",
    "DeepseekV41DecoderLayer.forward",
    "DeepseekV41Attention.forward",
    "DeepseekV41Indexer.forward",
    "DeepseekV41MoE.forward",
    "DeepseekV41Gate.forward",
    "DeepseekV41Experts.forward",
    "DeepseekV41Engram.forward",
    "DeepseekV41HyperConnectedBlock.hyper_connected",
    "DeepseekV41DSparkBlock.forward",
    "DeepseekV41DSpark.draft",
    "DeepseekV41DSpark.teacher_forced",
}


def _function_lengths(source: str) -> dict[str, int]:
    """Every function of ``source`` (methods as ``Class.name``, nested ones under their parent) → its lines, from
    ``def`` to its last line, docstring included."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")

    visit(ast.parse(source), "")
    return lengths


def test_no_module_is_over_600_lines():
    paths = sorted((ROOT / "modeling_dsv41").rglob("*.py"))
    assert len(paths) > 50
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines()) for path in paths}
    long = sorted(f"{name}: {n} lines" for name, n in lengths.items() if n > MAX_MODULE_LINES)
    assert not long, f"over {MAX_MODULE_LINES} lines (split by concept):\n" + "\n".join(long)


def test_no_function_on_the_forward_path_is_over_60_lines():
    lengths = {}
    for name in FORWARD_PATH:
        lengths.update(_function_lengths((ROOT / "modeling_dsv41" / name).read_text(encoding="utf-8")))
    assert FORWARDS <= lengths.keys(), sorted(FORWARDS - lengths.keys())
    long = sorted(f"{name}: {n} lines" for name, n in lengths.items() if n > MAX_FORWARD_PATH_FUNCTION_LINES)
    assert not long, f"over {MAX_FORWARD_PATH_FUNCTION_LINES} lines on the forward path:\n" + "\n".join(long)


def test_function_lengths_count_from_def_to_last_line():
    """The counter sees methods and nested functions, and counts decorators out and docstrings in."""
    body = "\n".join(f"        x{i} = {i}" for i in range(61))
    source = f'''class A:
    @staticmethod
    def forward():
        """Doc."""
{body}

        def inner():
            return 1

def short():
    return 2
'''
    lengths = _function_lengths(source)
    assert lengths == {"A.forward": 66, "A.forward.inner": 2, "short": 2}
    assert lengths["A.forward"] > MAX_FORWARD_PATH_FUNCTION_LINES
