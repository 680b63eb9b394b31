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


# Note [feature objects]: the names by which code could ask which parallelism is on
PARALLELISM_NAMES = {"tensor_parallel", "pipeline", "sequence", "experts", "split", "tp_size", "pp_size", "sp_size",
                     "ep_size", "tp_mode", "ep_group", "pp_group", "sp_group", "tp_group", "num_stages",
                     "seq_parallel_world_size", "ep_world_size", "tp_world_size",
                     "tp", "sp", "tp_row", "tp_col", "pp", "ep", "edp",  # the mesh's axes (Note [one mesh])
                     "ep_rank", "edp_rank", "pp_rank", "is_expert", "ep_members", "expert"}  # per-rank records
# Engine and initialize, which fold over the features, and the checkpoint code, which reads and writes tensors by
# their placements (Note [placements])
FEATURE_BLIND_FILES = ["engine/engine.py", "engine/initialization.py",
                       *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engine/checkpoint").rglob("*.py"))]


def _names_in(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def test_the_engine_never_branches_on_a_parallelism():
    """Engine iterates over feature objects (Note [feature objects]) and the checkpoint code over placements; no `if`,
    conditional expression, `while` or comprehension filter in them tests which parallelism is on."""
    found = []
    for name in FEATURE_BLIND_FILES:
        for node in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8"))):
            tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
            tests += node.ifs if isinstance(node, ast.comprehension) else []
            found += [f"{name}:{t.lineno}: {ast.unparse(t)}" for t in tests if _names_in(t) & PARALLELISM_NAMES]
    assert not found, found


CHECKPOINT_FILES = sorted((ROOT / "engine/checkpoint").rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_the_checkpoint_code_names_no_parallelism():
    """Note [reading a checkpoint anywhere]: saving and reading work from placements only, so no name, attribute,
    argument or string of engine/checkpoint/ (docstrings aside) is a mesh axis or a parallelism's per-rank record;
    checkpoints of earlier versions, which had them, are translated in engine/compat/checkpoint_formats.py."""
    found = []
    for path in CHECKPOINT_FILES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            words = _names_in(node) if isinstance(node, (ast.Name, ast.Attribute)) else set()
            words |= {node.arg} if isinstance(node, ast.arg) else set()
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                words.add(node.value)
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {w}" for w in sorted(words & PARALLELISM_NAMES)]
    assert not found, found


def test_the_engine_constructor_takes_at_most_five_parameters():
    (engine,) = [cls for path, cls in _classes() if str(path) == "engine/engine.py" and cls.name == "Engine"]
    (init,) = [m for m in _methods(engine) if m.name == "__init__"]
    assert len(init.args.args) - 1 + len(init.args.kwonlyargs) <= 5, ast.unparse(init.args)


GROUP_BUILDERS = {"new_group", "init_device_mesh", "DeviceMesh", "split_group", "new_subgroups"}


def test_every_process_group_comes_from_the_mesh():
    """Note [one mesh]: engine/mesh.py builds every process group (DeepSpeed's comm API, which hands a user's own
    ranks to torch, is the one other caller)."""
    allowed = {"engine/mesh.py", "engine/compat/deepspeed/comm.py"}
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if str(path.relative_to(ROOT)) in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _names_in(node.func) & GROUP_BUILDERS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not found, found


MAX_PARAMETERS, MAX_FUNCTION_STATEMENTS = 8, 60
# signatures that mirror another framework's public API keep its parameters
MIRRORED_APIS = ("engine/compat/", "engine/optimizers/", "engine/lr_schedules.py", "engine/moe/layer.py")
MIRRORED_FUNCTIONS = {
    "engine/activation_checkpointing/checkpointer.py:checkpoint",  # torch.utils.checkpoint.checkpoint's
    "engine/sequence_parallel/hf_attention.py:__call__",  # transformers' attention functions'
}


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
    return len(names) - (bool(a.args) and a.args[0].arg in ("self", "cls"))  # a method's own object aside


def test_no_function_takes_more_than_8_parameters_or_runs_more_than_60_statements():
    over = set()
    for top in ("engine", "offload"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name.startswith(MIRRORED_APIS):
                continue
            for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        _parameters(fn) > MAX_PARAMETERS or _statements(fn) > MAX_FUNCTION_STATEMENTS):
                    over.add(f"{name}:{fn.name}")
    over -= MIRRORED_FUNCTIONS
    assert not over, f"group settings into an object, or split the function: {sorted(over)}"
