"""The package boundaries: `models/` imports neither `controller/` nor `adapters/`, and no
project modules import each other in a cycle, `importlib` look-ups by name included."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "controller", "adapters")
FORBIDDEN_FROM_MODELS = ("borrowd.controller", "borrowd.adapters")
# A string that is exactly a module path (optionally `module:attribute`) of the project.
MODULE_STRING = re.compile(r"^borrowd\.(models|controller|adapters)(\.\w+)*(:\w+)?$")
DYNAMIC_IMPORTS = {"import_module", "find_spec", "__import__", "import_string"}


def module_name(path: Path) -> str:
    """Dotted module name of a source file under the repository root (installed under
    the `borrowd` namespace)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["borrowd", *parts])


def project_modules() -> dict[str, Path]:
    """Every module of the project packages, by dotted name."""
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def imported_names(path: Path, name: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file: statements anywhere in it (functions
    included), names passed to `importlib` look-ups, and module-path string literals."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and _call_name(node) in DYNAMIC_IMPORTS:
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value.split(":")[0]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and MODULE_STRING.match(node.value)):
            yield node.lineno, node.value.split(":")[0]


def import_graph() -> dict[str, set[str]]:
    """Project module -> project modules it imports (a package import counts as its
    `__init__`)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, target in imported_names(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _is_package_child(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


@pytest.mark.parametrize(
    "path", sorted((ROOT / "models").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_models_import_neither_controller_nor_adapters(path: Path) -> None:
    """No module under models/ imports controller/ or adapters/, statically or by name."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for line, target in imported_names(path, module_name(path))
        if any(_is_package_child(target, p) for p in FORBIDDEN_FROM_MODELS)
    ]
    assert bad == []


def test_no_import_cycle_between_project_modules() -> None:
    """No two project modules import each other, directly or through others."""
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_packages() -> None:
    """The packages form a DAG: adapters and controller may use models, never the reverse,
    and adapters never import borrowd.controller."""
    graph = import_graph()
    edges = {
        (src.split(".")[1], dst.split(".")[1])
        for src, targets in graph.items()
        for dst in targets
        if src.split(".")[1] != dst.split(".")[1]
    }
    assert edges <= {("controller", "models"), ("controller", "adapters"), ("adapters", "models")}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import borrowd.controller.policy\n", "borrowd.controller.policy"),
        ("from borrowd.adapters import gate\n", "borrowd.adapters.gate"),
        ("import importlib\nimportlib.import_module('borrowd.controller.closed_loop')\n",
         "borrowd.controller.closed_loop"),
        ("X = {'a': 'borrowd.adapters.vllm_plugin:Plugin'}\n", "borrowd.adapters.vllm_plugin"),
    ],
    ids=["import", "from-import", "import-module", "module-string"],
)
def test_the_checker_sees_every_kind_of_import(tmp_path: Path, source: str,
                                               expected: str) -> None:
    """The checker finds static imports, importlib look-ups and module-path strings."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert expected in {target for _, target in imported_names(path, "models.probe")}


def test_cycle_finder_finds_a_cycle() -> None:
    """A three-module cycle is reported as one component."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
