"""engine/'s and offload/'s imports point one way: no module imports, directly or through others, one that imports
it back, and no import sits inside a function to dodge such a cycle.

The graph is read from the source (no import runs): a module depends on what it imports at module level, a
TYPE_CHECKING block's imports included (a cycle only type checkers see is still two modules that need each other).
`from pkg import name` reads pkg's namespace, so it depends on pkg even where name is a
submodule; importing pkg.mod runs the __init__ of every package above mod, so it depends on those too, except the
packages the importer itself sits in (they are mid-import already: the usual package re-exporting its modules).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(p for top in ("engine", "offload") for p in (ROOT / top).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _packages_above(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module is imported (inside try/if/with too), not in a def or class."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or _type_checking_block(node):
            continue
        found.append(node)
        for name in ("body", "orelse", "handlers", "finalbody"):
            todo.extend(getattr(node, name, None) or [])
    return found


def _type_checking_imports(tree: ast.Module) -> list[ast.stmt]:
    return [inner for node in ast.walk(tree) if _type_checking_block(node) for inner in ast.walk(node)
            if isinstance(inner, (ast.Import, ast.ImportFrom))]


def _in_type_checking(tree: ast.Module) -> set[int]:
    return {id(inner) for node in ast.walk(tree) if _type_checking_block(node) for inner in ast.walk(node)}


class ImportGraph:
    def __init__(self):
        self.files = _module_files()
        self.trees = {name: ast.parse(path.read_text(), str(path)) for name, path in self.files.items()}
        self.edges = {name: set() for name in self.files}
        for name, tree in self.trees.items():
            for node in _module_level(tree) + _type_checking_imports(tree):
                self.edges[name] |= self.targets(name, node)
            self.edges[name].discard(name)

    def targets(self, importer: str, node: ast.AST) -> set[str]:
        """The modules of ours whose import `node` runs or whose namespace it reads."""
        found, named = set(), []
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module in self.files:
                found.add(node.module)
        for target in named:
            if target in self.files:
                found.add(target)
                found |= {p for p in _packages_above(target) - _packages_above(importer) if p in self.files}
        found.discard(importer)
        return found

    def path(self, start: str, goal: str) -> list[str] | None:
        """An import chain from start to goal, or None."""
        before, todo = {start: None}, [start]
        while todo:
            node = todo.pop()
            if node == goal:
                chain = [node]
                while before[chain[-1]] is not None:
                    chain.append(before[chain[-1]])
                return chain[::-1]
            for nxt in sorted(self.edges[node]):
                if nxt not in before:
                    before[nxt] = node
                    todo.append(nxt)
        return None

    def imports_inside_functions(self, name: str):
        tree = self.trees[name]
        outside = {id(node) for node in _module_level(tree)} | _in_type_checking(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in outside:
                yield node


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph()


def test_no_module_imports_one_that_imports_it_back(graph):
    cycles = []
    for name in sorted(graph.edges):
        for target in sorted(graph.edges[name]):
            back = graph.path(target, name)
            if back is not None:
                cycles.append(" -> ".join([name] + back))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_import_inside_a_function_dodges_a_cycle(graph):
    """An import moved into a function to run later would, at module level, close a cycle: the layering is wrong
    (imports kept inside functions for start-up time, like the CLI's, close none)."""
    dodges = []
    for name in sorted(graph.files):
        for node in graph.imports_inside_functions(name):
            for target in sorted(graph.targets(name, node)):
                back = graph.path(target, name)
                if back is not None:
                    dodges.append(f"{graph.files[name].relative_to(ROOT)}:{node.lineno} imports {target}, which "
                                  f"imports it back: {' -> '.join(back)}")
    assert not dodges, "\n".join(dodges)



def test_offload_imports_nothing_from_engine(graph):
    """The memory manager knows tensors, chunks and tiers, not models, ranks or configs (docs/design.md, Layers)."""
    found = []
    for name, tree in graph.trees.items():
        if name.split(".")[0] != "offload":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{name}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] == "engine"]
    assert not found, found

def test_the_graph_sees_a_cycle_through_a_package_init(graph):
    """The check can fail: block_timing importing the estimate at module level (as it once did inside a function)
    closes initialization -> block_timing -> engine.estimate -> ... -> initialization."""
    node = ast.parse("from engine.estimate.activations import trace_activations").body[0]
    targets = graph.targets("engine.pipeline.block_timing", node)
    assert "engine.estimate" in targets
    assert graph.path("engine.estimate", "engine.pipeline.block_timing") is not None


def test_the_graph_counts_an_import_only_type_checkers_run(graph):
    """A TYPE_CHECKING import is an edge: the pipeline driver annotating something with the registry's features
    would close feature_registry -> pipeline.feature -> driver -> feature_registry."""
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from engine.feature_registry import FEATURES")
    (node,) = _type_checking_imports(tree)
    assert "engine.feature_registry" in graph.targets("engine.pipeline.driver", node)
    assert graph.path("engine.feature_registry", "engine.pipeline.driver") is not None


FORMER_CYCLE_MEMBERS = ["engine.pipeline.block_timing", "engine.estimate.activations",
                        "engine.tensor_parallel.derive.propagate", "engine.compat.deepspeed.runtime.engine",
                        "engine.pipeline.driver", "engine.config_checks"]


def test_modules_once_in_cycles_import_first_in_a_fresh_interpreter():
    """Each imported before anything else of engine's: the order a cycle breaks in."""
    runs = [subprocess.Popen([sys.executable, "-c", f"import {name}"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
            for name in FORMER_CYCLE_MEMBERS]
    failed = {}
    for name, run in zip(FORMER_CYCLE_MEMBERS, runs):
        _, err = run.communicate(timeout=120)
        if run.returncode:
            failed[name] = err.strip().splitlines()[-1]
    assert not failed, failed
