"""The package's layers: every import inside ``dpmp/`` points down, never up.

The layers, bottom to top: precision < accounting < noise < clipping < audit
< data < models < step < app, with ``dpmp/__init__.py`` and ``dpmp/cli.py``
on top and ``dpmp/_registry.py`` (the one registry type every extension
point uses; it imports nothing of dpmp) below them all. A module may import
its own layer and any layer below it; nothing outside ``dpmp/app/`` imports
the application (its config above all), and nothing imports the command
line. Imports inside functions count too: a lazy import is still a
dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dpmp"
LAYERS = ("precision", "accounting", "noise", "clipping", "audit", "data", "models", "step", "app")
TOP = len(LAYERS)  # dpmp/__init__.py, dpmp/cli.py and anything else at the top
BASE = {"dpmp._registry": -1}  # modules below every layer


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    """The layer of ``dpmp.<layer>...``; below them all for a ``BASE`` module; the top
    for ``dpmp`` itself and its other modules."""
    if module in BASE:
        return BASE[module]
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def _imports(source: str, module: str, *, package: bool = False) -> set[str]:
    """The dpmp modules the ``source`` of ``module`` imports anywhere in it (in
    functions too; relative imports resolved; ``package``: it is an ``__init__``)."""
    package_name = module if package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package_name.split(".")
                base = parts[: len(parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            # ``from dpmp import app`` imports the module dpmp.app
            found.update(f"{name}.{alias.name}" for alias in node.names if name == "dpmp")
    return {name for name in found if name == "dpmp" or name.startswith("dpmp.")}


def _edges() -> list[tuple[str, str]]:
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = path.read_text(encoding="utf-8")
        imported = _imports(source, module, package=path.name == "__init__.py")
        edges += [(module, name) for name in sorted(imported)]
    return edges


def _upward() -> set[tuple[str, str]]:
    return {(a, b) for a, b in _edges() if _layer(b) > _layer(a)}


def test_the_scan_sees_imports_in_functions_and_relative_ones():
    source = (
        "from . import _x\n"
        "from ..app.config import Config\n"
        "def f():\n"
        "    import dpmp.app.run_dir\n"
        "    from dpmp import cli\n"
    )
    found = _imports(source, "dpmp.data._probe")
    assert found == {"dpmp.data", "dpmp.app.config", "dpmp.app.run_dir", "dpmp", "dpmp.cli"}
    assert _imports(source, "dpmp.data", package=True) >= {"dpmp.data", "dpmp.app.config"}
    assert _layer("dpmp.app.config") > _layer("dpmp.models") > _layer("dpmp.data._probe")
    assert _layer("dpmp") == _layer("dpmp.cli") == TOP
    assert _layer("dpmp._registry") < _layer("dpmp.precision._policy")


def test_the_scan_finds_the_package_imports():
    edges = _edges()
    assert ("dpmp.app.config", "dpmp.precision._policy") in edges
    assert ("dpmp.data._sampling", "dpmp.noise._entropy") in edges


def test_every_layer_is_a_folder():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(LAYERS), folders


@pytest.mark.slow  # ~6 s on 2 cores
def test_the_base_imports_nothing_of_dpmp():
    """``dpmp._registry`` sits below every layer: it may import no layer at all."""
    wrong = [(a, b) for a, b in _edges() if a in BASE and b != "dpmp"]
    assert not wrong, wrong
    assert ("dpmp.noise._registry", "dpmp._registry") in _edges()


def test_imports_point_down():
    wrong = _upward()
    assert not wrong, "imports of a layer above the importer's own:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(wrong)
    )


def test_nothing_below_the_application_imports_it():
    wrong = {(a, b) for a, b in _edges() if _layer(b) == LAYERS.index("app") > _layer(a)}
    assert not wrong, sorted(wrong)


def test_nothing_imports_the_command_line():
    cli = [(a, b) for a, b in _edges() if b == "dpmp.cli" or b.startswith("dpmp.cli.")]
    assert not [edge for edge in cli if edge[0] != "dpmp.cli"], cli
