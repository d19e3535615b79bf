"""The package's modules import one another without circles: each name has one home, which the others import.

The imports are read from the source, every one of them: at the top, inside functions (imported on use), and under
``TYPE_CHECKING``. ``from package import name`` points at the submodule ``package.name`` where there is one, else at
the package's ``__init__`` (a name it defines or re-exports). The parent packages that Python initialises before a
submodule are not counted: the root package imports nearly everything, and Python allows a submodule to import while
its parent is still being initialised.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import lightning_mgpu

PACKAGE = Path(lightning_mgpu.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` by its dotted name; a package by its own name (its ``__init__``)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """For each module of the package at ``root``, the modules of the same package it imports anywhere in its code."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {target for target in _imported(ast.parse(path.read_text()), package, modules) if target != name}
    return graph


def _imported(tree: ast.Module, package: str, modules: dict[str, Path]) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    yield submodule
                elif source in modules:
                    yield source


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import one another, as ``[a, b, ..., a]``; none when acyclic."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return found


def test_the_package_imports_without_circles() -> None:
    found = circles(import_graph(PACKAGE))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_the_reader_sees_imports_on_use_under_type_checking_and_of_submodules(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("A = 1\n\ndef f():\n    from pkg.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n"
    )
    (package / "c.py").write_text("from pkg import a\nC = 2\n")
    graph = import_graph(package)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
    }
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    (package / "c.py").write_text("import pkg\nfrom pkg.sub import b\nC = 2\n")
    assert import_graph(package)["pkg.c"] == {"pkg", "pkg.sub.b"}
