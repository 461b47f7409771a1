"""No import cycles inside a package, counting every import: module level, function level, TYPE_CHECKING.

Each package of ``pyproject.toml``'s ``[tool.setuptools.package-dir]`` (``stitchboard.proto`` ->
``proto/``, ...) is parsed with :mod:`ast`, never imported. Relative imports and absolute
``stitchboard.*`` imports are resolved to modules (``from pkg import name`` is the submodule
``pkg.name`` when that file exists, else ``pkg`` itself); an edge joins two modules of the same
top-level package (subpackages included). The implicit import of a parent package's
``__init__`` is not an edge: a package that re-exports its modules is not a cycle.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
TOP_PACKAGES = sorted(name for name in PACKAGE_DIRS if name.count(".") == 1)


def modules_of(package: str) -> dict[str, Path]:
    """Module name -> file for every ``.py`` file under the package's folder (``__init__`` is the package)."""
    folder = ROOT / PACKAGE_DIRS[package]
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = modules_of(package)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """``module -> the modules of the component it imports`` for each member."""
    members = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in component)


@pytest.mark.parametrize("package", TOP_PACKAGES)
def test_no_import_cycle_inside_the_package(package: str) -> None:
    graph = import_graph(package)
    found = cycles(graph)
    assert not found, (
        f"import cycles in {package}: "
        + " | ".join(describe(graph, c) for c in found)
        + "; move what both sides need into a module they both import"
    )


def test_the_resolver_sees_every_kind_of_import(tmp_path: Path) -> None:
    # A fake package laid out like ours: relative, absolute, function-level and TYPE_CHECKING imports.
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "def f():\n    from . import b\n    return b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stitchboard.fake.sub.c import C\n",
        "sub/__init__.py": "",
        "sub/c.py": "import stitchboard.fake.a\nfrom .. import b\nfrom ..sub import c\n",
    }
    paths = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = list(Path(rel).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        paths[".".join(["stitchboard.fake", *parts])] = path
    known = set(paths)
    graph = {name: imports_of(name, path, known) for name, path in paths.items()}
    assert graph == {
        "stitchboard.fake": {"stitchboard.fake.a"},
        "stitchboard.fake.a": {"stitchboard.fake.b"},
        "stitchboard.fake.b": {"stitchboard.fake.sub.c"},
        "stitchboard.fake.sub": set(),
        "stitchboard.fake.sub.c": {"stitchboard.fake.a", "stitchboard.fake.b"},
    }
    assert cycles(graph) == [["stitchboard.fake.a", "stitchboard.fake.b", "stitchboard.fake.sub.c"]]
