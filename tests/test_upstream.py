"""The private names of transformers, PEFT, TRL and accelerate we rely on (``modeling_dsv41/upstream.py``) are all
listed there, and every listed one is still there in the installed versions: a failure names the private API, the
installed version and the versions the list was checked against."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import pkgutil
from pathlib import Path

import pytest

from modeling_dsv41.upstream import LIBRARIES, Library

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configuration", "processing", "modeling_dsv41")
BY_NAME = {library.name: library for library in LIBRARIES}


def where(library: Library) -> str:
    installed = importlib.metadata.version(library.name)
    return f"{library.name} {installed} (the list was checked against {', '.join(library.checked)})"


def resolve(path: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(path)


def project_classes() -> list[type]:
    classes = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names = [package] + [info.name for info in pkgutil.walk_packages(module.__path__, f"{package}.")]
        for name in names:
            if name.endswith("__main__"):  # runs the command line
                continue
            module = importlib.import_module(name)
            classes += [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == name]
    return classes


def upstream_definition(cls: type, name: str) -> tuple[Library, type] | None:
    """The first class after ``cls`` in its MRO that defines ``name``, where it is one of the libraries'."""
    for base in cls.__mro__[1:]:
        if name in vars(base):
            library = BY_NAME.get(base.__module__.split(".")[0])
            return (library, base) if library is not None else None
    return None


def overrides() -> list[tuple[Library, str, type, type, str]]:
    """(library, listed path, our class, its upstream base, method name) of every private method a project class
    defines over one of the libraries'."""
    found = []
    for cls in project_classes():
        for name, value in vars(cls).items():
            if not name.startswith("_") or name.startswith("__") or name == "_abc_impl":  # (abc's own bookkeeping)
                continue
            definition = upstream_definition(cls, name)
            if definition is not None:
                library, base = definition
                found.append((library, f"{base.__module__}.{base.__qualname__}.{name}", cls, base, name))
    return found


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda library: library.name)
def test_every_listed_private_name_is_still_there(library):
    missing = []
    for path in (*library.overridden, *library.imported):
        try:
            resolve(path)
        except (ImportError, AttributeError) as error:
            missing.append(f"{path} ({type(error).__name__}: {error})")
    for module, attribute in library.read:
        if attribute not in inspect.getsource(importlib.import_module(module)):
            missing.append(f"{module} no longer mentions {attribute}")
    assert not missing, f"{where(library)} moved private APIs we rely on:\n" + "\n".join(missing)


def test_every_private_method_we_override_is_listed():
    unlisted = [
        f"{cls.__module__}.{cls.__qualname__}.{name} overrides {path}: list it in upstream.py ({where(library)})"
        for library, path, cls, _, name in overrides()
        if path not in library.overridden
    ]
    assert not unlisted, "\n".join(unlisted)


def _function(value):
    """The function of a method, class method or static method; None for anything else."""
    value = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
    return inspect.unwrap(value) if inspect.isfunction(value) else None


def _parameters(function) -> tuple[set[str], set[str], bool]:
    """(every named parameter, the required ones, whether it takes **kwargs), ``self`` / ``cls`` left out."""
    params = list(inspect.signature(function).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return (
        {p.name for p in named},
        {p.name for p in named if p.default is p.empty},
        any(p.kind is p.VAR_KEYWORD for p in params),
    )


def test_our_overrides_take_what_upstream_passes():
    """An override must accept every parameter the upstream method has (they are what its callers pass), and need
    none it lacks."""
    mismatched = []
    for library, path, cls, base, name in overrides():
        ours, theirs = _function(vars(cls)[name]), _function(vars(base)[name])
        if ours is None or theirs is None:  # a class attribute: no signature
            continue
        ours, our_required, our_kwargs = _parameters(ours)
        theirs, _, their_kwargs = _parameters(theirs)
        unaccepted = sorted(theirs - ours) if not our_kwargs else []
        unknown = sorted(our_required - theirs) if not their_kwargs else []
        if unaccepted or unknown:
            mismatched.append(
                f"{path}: {where(library)} passes {unaccepted or 'nothing new'}, "
                f"our {cls.__qualname__}.{name} requires {unknown or 'nothing else'}"
            )
    assert not mismatched, "\n".join(mismatched)


def test_private_names_are_imported_only_through_upstream():
    imported = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in BY_NAME:
                    for alias in node.names:
                        if alias.name.startswith("_"):
                            imported.setdefault(f"{node.module}.{alias.name}", []).append(path.relative_to(ROOT))
    wrong = {
        name: paths
        for name, paths in imported.items()
        if paths != [Path("modeling_dsv41/upstream.py")] or name not in BY_NAME[name.split(".")[0]].imported
    }
    assert not wrong, f"private names imported elsewhere than (or unlisted in) modeling_dsv41/upstream.py: {wrong}"


def test_the_declared_range_is_the_tested_one():
    """setup.cfg's bounds, the oldest versions CI installs (.ci/oldest-versions.txt), the versions upstream.py was
    checked against and README's statement name the same versions."""
    import configparser
    import re

    from packaging.requirements import Requirement
    from packaging.version import Version

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options"]["install_requires"].split("\n") + setup["options.extras_require"]["test"].split("\n")
    requirements = {r.name: r for r in map(Requirement, filter(None, lines)) if r.name in BY_NAME}
    oldest = dict(
        line.split("==")
        for line in (ROOT / ".ci/oldest-versions.txt").read_text().split("\n")
        if line and not line.startswith("#")
    )
    readme = (ROOT / "README.md").read_text()
    for name, library in BY_NAME.items():
        spec = requirements[name].specifier
        checked = [Version(v) for v in library.checked]
        assert Version(oldest[name]) == min(checked), (name, oldest[name], library.checked)
        assert all(spec.contains(v) for v in checked), (name, str(spec), library.checked)
        lower = min(s.version for s in spec if s.operator == ">=")
        upper = Version(max(s.version for s in spec if s.operator == "<"))
        assert Version(lower) == Version(".".join(oldest[name].split(".")[:2])), (name, str(spec))
        newest = max(checked)
        assert upper == Version(f"{newest.major}.{newest.minor + 1}"), (name, str(spec), "allows an untested minor")
        minors = sorted({f"{v.major}.{v.minor}" for v in checked}, key=Version)
        label = {"transformers": "transformers", "peft": "PEFT", "trl": "TRL", "accelerate": "accelerate"}[name]
        assert re.search(rf"{label} {' and '.join(map(re.escape, minors))}\b", readme), (name, minors)


def test_no_deprecated_name_in_our_code_docs_or_commands():
    """transformers 5.25 deprecates gradient checkpointing's names for activation checkpointing's (removed in v6):
    our code, examples, benchmarks, docs and printed commands use the new ones (the arguments' warning is an error in
    the test run, setup.cfg; the methods are also called by PEFT, so they are checked here by name)."""
    import re

    deprecated = re.compile(
        r"gradient_checkpointing_enable\(|is_gradient_checkpointing\b|--gradient_checkpointing\b|"
        r"\bgradient_checkpointing(_kwargs)?="
    )
    found = []
    for pattern in (
        "configuration/**/*.py",
        "processing/**/*.py",
        "modeling_dsv41/**/*.py",
        "examples/**/*.py",
        "benchmarks/*",
        "docs/*.md",
        "README.md",
        "model_card.md",
        "tests/*.py",
    ):
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file() and path.name != "test_upstream.py":
                text = path.read_text(encoding="utf-8")
                found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in deprecated.finditer(text)]
    assert not found, "\n".join(found)
