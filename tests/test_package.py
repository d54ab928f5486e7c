"""The package as a whole: every module imports on its own, and no two modules import each other, directly or
through others (an import inside a function counts: deferring an import hides a circle, it does not remove it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.glob("torchkern*/**/*.py")) + sorted(SRC.glob("torchkern*.py"))}


class _Imports(ast.NodeVisitor):
    """The modules of MODULES that one module's source imports, anywhere in it, except under ``if TYPE_CHECKING``
    (annotations only); ``importlib.import_module("literal")`` counts as an import."""

    def __init__(self, name: str, is_package: bool):
        self.package = name if is_package else name.rpartition(".")[0]
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
            # `from pkg import mod` imports the module pkg.mod; `from pkg import name` runs pkg
            self.found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)

    def visit_Call(self, node: ast.Call) -> None:
        if (ast.unparse(node.func) in ("importlib.import_module", "import_module") and node.args
                and isinstance(node.args[0], ast.Constant)):
            self.found.add(node.args[0].value)
        self.generic_visit(node)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    graph = {}
    for name, path in MODULES.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = {m for m in visitor.found if m in MODULES and m != name}
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A shortest import cycle from ``start`` back to it (breadth first), or None."""
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


GRAPH = import_graph()


@pytest.mark.parametrize("name", list(GRAPH))
def test_no_import_cycle_through(name):
    cycle = cycle_through(GRAPH, name)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert cycle_through(graph, "d") is None


def test_imports_are_read_as_python_resolves_them():
    visitor = _Imports("torchkern.optim.soap", is_package=False)
    visitor.visit(ast.parse("from .shampoo import x\nfrom .. import linalg\nfrom .._checks import c\n"
                            "import importlib\ndef f():\n    from . import kfac\n    importlib.import_module('m.n')\n"
                            "if TYPE_CHECKING:\n    from .twins import t\n"))
    assert visitor.found == {"torchkern.optim.shampoo", "torchkern.linalg", "torchkern._checks", "importlib",
                             "torchkern.optim.kfac", "m.n"}


# Each module imported by a fresh process that has imported torch and nothing of torchkern: a fork of one
# interpreter, so torch's import (seconds) is paid once.
_IMPORT_EACH = """
import importlib, os, sys, traceback
import torch  # noqa: F401
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            print(f"=== {name}\\n{traceback.format_exc()}", flush=True)
            os._exit(1)
        os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        print(f"=== {name} failed", flush=True)
"""


@pytest.fixture(scope="module")
def import_failures() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *MODULES], capture_output=True, text=True, env=env,
                         timeout=600).stdout
    failures: dict[str, str] = {}
    for block in out.split("=== ")[1:]:
        name, _, text = block.partition("\n")
        failures.setdefault(name.removesuffix(" failed"), text)
    return failures


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="imports each module in a fork")
@pytest.mark.parametrize("name", list(MODULES))
def test_module_imports_on_its_own(name, import_failures):
    assert name not in import_failures, f"import {name} in a fresh process failed:\n{import_failures[name]}"
