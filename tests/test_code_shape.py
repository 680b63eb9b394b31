"""The shape the code keeps so that one training step stays readable: small classes, a short engine, small files.

A method "holds logic" when its body has more than three statements (nested statements counted)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LOGIC_METHODS = 20
MAX_ENGINE_STATEMENTS = 15
MAX_FILE_LINES = 600


def _statements(node: ast.AST) -> int:
    return sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1  # the def itself is not counted


def _classes():
    for top in ("engine", "offload"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    yield path.relative_to(ROOT), node


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_class_has_more_than_20_methods_holding_logic():
    large = {f"{path}:{cls.name}": n for path, cls in _classes()
             if (n := sum(_statements(m) > 3 for m in _methods(cls))) > MAX_LOGIC_METHODS}
    assert not large, f"split by responsibility: {large}"


def test_the_engines_init_backward_and_step_are_short():
    (engine,) = [cls for path, cls in _classes() if str(path) == "engine/engine.py" and cls.name == "Engine"]
    counts = {m.name: _statements(m) for m in _methods(engine) if m.name in ("__init__", "backward", "step")}
    assert set(counts) == {"__init__", "backward", "step"}
    assert max(counts.values()) <= MAX_ENGINE_STATEMENTS, counts


def test_no_source_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for top in ("engine", "offload", "scripts") for p in (ROOT / top).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not long, long
