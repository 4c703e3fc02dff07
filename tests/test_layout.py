"""The package layout the README promises: one job per package, dependencies pointing one way."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a package may import from the packages of a lower layer, never of a higher one or the same
LAYER = {"decoding": 0, "env": 1, "distill": 1, "bench": 2, "agents": 3}


def imported_names(path: Path) -> set[str]:
    """Every absolute module name a module imports, at any depth in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def project_imports(path: Path) -> set[str]:
    """The project packages (`specpilot.X`) a module imports."""
    return {name.split(".")[1] for name in imported_names(path)
            if name.startswith("specpilot.") and name.split(".")[1] in LAYER}


def test_everything_is_imported_under_one_name():
    """No module imports a project package by a bare top-level name (`from decoding...`): one name, `specpilot`."""
    bare = [f"{path.relative_to(ROOT)} imports {name}" for folder in [*LAYER, "scripts", "tests", "specpilot"]
            for path in sorted((ROOT / folder).rglob("*.py")) for name in imported_names(path)
            if name.split(".")[0] in LAYER]
    assert not bare, bare


def test_dependencies_point_down():
    wrong = []
    for package, layer in LAYER.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for other in project_imports(path) - {package}:
                if LAYER[other] >= layer:
                    wrong.append(f"{path.relative_to(ROOT)} imports {other}")
    assert not wrong, wrong


def test_the_checker_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from specpilot.bench.benchmark import summarize\n")
    assert project_imports(bad) == {"bench"}
    bad.write_text("from decoding.loop import generate\n")
    assert imported_names(bad) == {"decoding.loop"} and project_imports(bad) == set()


def test_decoding_loads_nothing_above_it():
    """Importing every module of the decoder library loads no module of env, agents, bench or distill."""
    code = (
        "import importlib, json, pkgutil, sys, specpilot.decoding as decoding\n"
        "for m in pkgutil.iter_modules(decoding.__path__):\n"
        "    importlib.import_module('specpilot.decoding.' + m.name)\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[:2][-1] in ('env', 'agents', 'bench', 'distill')\n"
        "                        and n.startswith('specpilot.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert modules == []
    assert len(list((ROOT / "decoding").glob("*.py"))) > 10  # the walk did reach the library's modules


def sibling_imports(path: Path) -> set[str]:
    """The modules of its own package a module imports by a relative import (`from .x import`, at any depth; those
    under `if TYPE_CHECKING:` are never executed and left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and id(node) not in typing_only:
            found.update([node.module] if node.module else [a.name for a in node.names])
    return {name.split(".")[0] for name in found}


def import_circles(folder: Path) -> list[list[str]]:
    """Every circle of relative imports among the modules of one package folder (depth-first search)."""
    graph = {p.stem: sibling_imports(p) for p in folder.glob("*.py")}
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return circles


def test_no_import_circle_inside_a_package():
    circles = {package: import_circles(ROOT / package) for package in LAYER}
    assert not any(circles.values()), circles


def test_the_circle_finder_sees_a_circle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import y\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import f\n")
    assert import_circles(tmp_path) == []  # a type-checking import never runs
    (tmp_path / "c.py").write_text("from . import a\n")
    assert import_circles(tmp_path) == [["a", "b", "c", "a"]]


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines():
    """Outside tests and data (prompt generators under */data/), every module stays short enough to read."""
    long = {str(p.relative_to(ROOT)): n for folder in [*LAYER, "scripts", "specpilot"]
            for p in sorted((ROOT / folder).rglob("*.py")) if "data" not in p.relative_to(ROOT).parts
            and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
