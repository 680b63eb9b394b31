"""The composition grid of the README's "What is supported": every pair of features, each cell computed from the
config checks and from TESTS below, never typed.

A pair's cell: its two config fragments merged and asked of engine.refusals.refused (load_config's check_config and
check_run against a mesh layout of the world the degrees need, no process group). A refusal prints "✗" and the
error; an accepted pair prints "✓" and the tests in TESTS that train it against one process. An accepted pair
without a test, a test id whose file does not define the function, and a refused pair with a test all fail the
script.

    python scripts/composition_grid.py                  # the grid and its notes, to stdout
    python scripts/composition_grid.py --write README.md  # rewrites the grid in README.md, the notes in docs/
    python scripts/composition_grid.py --check README.md  # exits 1 when either differs
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the engine package is the repo root's
    sys.path.insert(0, str(REPO))


from engine.refusals import merged, refused  # noqa: E402
from scripts.readme_markers import MarkerError, replaced  # noqa: E402

# pair of feature names (either order) → the pytest node ids that train the pair against one process
PAIRS = "tests/test_composition_pairs.py::test_pair_trains_like_one_process"
SEQUENCE = "tests/test_sequence_parallel.py::"
MOE_COMPOSITION = "tests/test_moe_composition.py::test_expert_parallel_composition_matches_plain_pytorch"
HYBRID = "tests/test_hybrid_sharding.py::"
TESTS: dict[tuple[str, str], list[str]] = {
    ("zero3", "offload"): ["tests/test_zero.py::test_offload_matches_single_process[3-cpu-cpu-2]"],
    ("zero3", "zero_init"): ["tests/test_zero_init.py::test_a_zero_init_model_trains_like_plain_pytorch[3-gpt]"],
    ("zero3", "tp1d"): ["tests/test_tensor_parallel.py::test_tensor_parallel_matches_single_process[dp2xtp2-zero3]"],
    ("zero3", "tp2d"): ["tests/test_tensor_parallel.py::test_2d_under_zero_3_over_two_data_parallel_groups"],
    ("zero3", "megatron_sp"): ["tests/test_tensor_sequence_parallel.py::test_sequence_parallel_inside_tp_equals_tp_"
                               "without_it_and_pytorch[dp2xtp2-zero3-checkpointing]"],
    ("zero3", "pipeline"): ["tests/test_pipeline_engine.py::test_dp2_by_pp2_under_zero[3-1f1b-1]"],
    ("zero3", "ulysses_ring"): [SEQUENCE + "test_dp2_by_sp2_under_zero3_and_sp2_by_tp2_under_zero2"],
    ("zero3", "experts"): ["tests/test_moe.py::test_mixtral_expert_parallel_matches_plain_pytorch[3]",
                           "tests/test_moe.py::test_mixtral_dp4_ep2_zero3"],
    ("zero3", "checkpointing"): ["tests/test_activation_checkpointing.py::test_checkpointing_changes_no_loss_or_"
                                "gradient_with_dropout[gpt-zero3]"],
    ("offload", "zero_init"): [PAIRS + "[offload-zero_init]"],
    ("offload", "tp1d"): [PAIRS + "[offload-tp1d]"],
    ("offload", "tp2d"): [PAIRS + "[offload-tp2d]"],
    ("offload", "megatron_sp"): [PAIRS + "[offload-megatron_sp]"],
    ("offload", "ulysses_ring"): [PAIRS + "[offload-ulysses]"],
    ("offload", "experts"): ["tests/test_moe.py::test_mixtral_experts_offloaded"],
    ("offload", "checkpointing"): [PAIRS + "[offload-checkpointing]"],
    ("zero_init", "ulysses_ring"): [PAIRS + "[zero_init-ring]"],
    ("zero_init", "checkpointing"): [PAIRS + "[zero_init-checkpointing]"],
    ("tp1d", "pipeline"): ["tests/test_pipeline_engine.py::test_pp2_by_tp2"],
    ("tp1d", "experts"): [MOE_COMPOSITION + "[tp-0]", MOE_COMPOSITION + "[tp-3]"],
    ("ulysses_ring", "experts"): [MOE_COMPOSITION + "[sp-1]", MOE_COMPOSITION + "[sp-3]"],
    ("pipeline", "experts"): [MOE_COMPOSITION + "[pp-1]", MOE_COMPOSITION + "[pp-3]"],
    ("pipeline", "ulysses_ring"): ["tests/test_pipeline_sequence_parallel.py::"
                                   "test_pp2_by_sp2_trains_as_one_process_on_the_whole_sequences"],
    ("offload", "pipeline"): ["tests/test_pipeline_offload.py::test_trains_as_one_process[cpu]",
                              "tests/test_pipeline_offload.py::test_trains_as_one_process[nvme]"],
    ("zero_init", "pipeline"): ["tests/test_pipeline_offload.py::test_zero_init_builds_only_each_stages_parameters"],
    ("megatron_sp", "pipeline"): ["tests/test_pipeline_sequence_tp.py::"
                                  "test_pipeline_with_megatron_sequence_parallelism_equals_one_process",
                                  "tests/test_composition.py::test_a_composition_trains_as_one_process"],
    ("tp1d", "ulysses_ring"): [SEQUENCE + "test_dp2_by_sp2_under_zero3_and_sp2_by_tp2_under_zero2"],
    ("tp1d", "checkpointing"): ["tests/test_activation_checkpointing.py::test_checkpointing_changes_no_loss_or_"
                                "gradient_with_dropout[gpt-tp1d]"],
    ("tp2d", "checkpointing"): ["tests/test_activation_checkpointing.py::test_checkpointing_changes_no_loss_or_"
                                "gradient_under_2d_tensor_parallelism"],
    ("megatron_sp", "checkpointing"): ["tests/test_tensor_sequence_parallel.py::test_sequence_parallel_inside_tp_"
                                       "equals_tp_without_it_and_pytorch[dp2xtp2-zero3-checkpointing]"],
    ("pipeline", "checkpointing"): ["tests/test_pipeline_engine.py::test_with_activation_checkpointing"],
    ("ulysses_ring", "checkpointing"): [SEQUENCE + "test_with_activation_checkpointing_and_a_checkpoint_resumed_"
                                        "without_sequence_parallelism"],
    ("experts", "checkpointing"): ["tests/test_moe.py::test_moe_layer_under_activation_checkpointing"],
    ("hsdp", "zero3"): [HYBRID + "test_hybrid_sharding_matches_one_process_and_shards_the_states_over_one_copy"
                                 "[stage3-accumulation2]"],
    **{("hsdp", name): [HYBRID + f"test_hybrid_sharding_composes[{name}]"]
       for name in ("offload", "zero_init", "tp1d", "tp2d", "megatron_sp", "pipeline", "ulysses_ring",
                    "checkpointing")},
}

README_MARKERS = ("<!-- composition grid -->", "<!-- end composition grid -->")
NOTES_MARKERS = ("<!-- composition grid notes -->", "<!-- end composition grid notes -->")
NOTES_FILE = "docs/parallelism.md"


@dataclass(frozen=True)
class Feature:
    name: str  # as in TESTS
    label: str  # the grid's header
    fragment: dict  # its config keys
    zero_init: bool = False  # the model is built under engine.zero_init() (no config key)
    setting: str | None = None  # features that are values of one setting (a run has one) share it: "—"


FEATURES = [
    Feature("zero3", "ZeRO-3", {"zero_optimization": {"stage": 3}}),
    Feature("offload", "offload", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                         "offload_param": {"device": "cpu"}}}),
    Feature("zero_init", "zero_init", {}, zero_init=True),
    Feature("tp1d", "1D TP", {"tensor_parallel": {"size": 2}}, setting="tensor_parallel"),
    Feature("tp2d", "2D TP", {"tensor_parallel": {"size": 4, "mode": "2d"}}, setting="tensor_parallel"),
    Feature("megatron_sp", "Megatron SP", {"tensor_parallel": {"size": 2, "sequence_parallel": True}},
            setting="tensor_parallel"),
    Feature("pipeline", "pipeline", {"pipeline": {"stages": 2}}),
    Feature("ulysses_ring", "Ulysses/ring", {"sequence_parallel": {"size": 2}}),
    Feature("experts", "experts", {"moe": {"expert_parallel_size": 2}}),
    Feature("checkpointing", "act. ckpt", {"activation_checkpointing": {"enabled": True}}),
    Feature("hsdp", "HSDP", {"zero_optimization": {"stage": 3, "mics_shard_size": 2}}),
]


class GridError(Exception):
    """The grid cannot be drawn honestly: a pair accepted without a test, a test id that does not exist."""


@dataclass(frozen=True)
class Cell:
    tests: tuple[str, ...] = ()  # accepted: the node ids that train it
    refusal: str | None = None  # refused: the error
    same_setting: bool = False

    @property
    def accepted(self) -> bool:
        return not self.same_setting and self.refusal is None


def refusal(a: Feature, b: Feature) -> str | None:
    """The error initialize() would raise for the pair (a feature alone: a is b) before building anything, or
    None."""
    return refused(merged(a.fragment, b.fragment), zero_init=a.zero_init or b.zero_init)


def tests_of(a: Feature, b: Feature, tests: dict[tuple[str, str], list[str]]) -> list[str]:
    return tests.get((a.name, b.name), []) + tests.get((b.name, a.name), [])


def missing_test(node_id: str) -> str | None:
    """Why `node_id` names no test (its file missing, or not defining the function), or None."""
    path, _, rest = node_id.partition("::")
    function = rest.split("[")[0].split("::")[-1]
    file = REPO / path
    if not rest or not file.is_file():
        return f"{node_id}: no file {path}"
    return None if function in functions_in(file) else f"{node_id}: {path} defines no {function}"


@functools.lru_cache(maxsize=None)
def functions_in(file: Path) -> frozenset[str]:
    tree = ast.parse(file.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def compute_grid(tests: dict[tuple[str, str], list[str]] = TESTS) -> dict[tuple[str, str], Cell]:
    """Every unordered pair's cell, keyed both ways; raises GridError listing every inconsistency of `tests`
    (a mapping like TESTS) with the checks."""
    names = {f.name for f in FEATURES}
    problems = [f"TESTS names an unknown feature: {pair}" for pair in tests if not set(pair) <= names]
    problems += [why for ids in tests.values() for why in map(missing_test, ids) if why]
    # a feature refused alone has a wrong fragment (a typo would otherwise refuse all its pairs)
    problems += [f"{f.label} alone is refused: {refusal(f, f)}" for f in FEATURES if refusal(f, f) is not None]
    cells = {}
    for a, b in combinations(FEATURES, 2):
        ids = tuple(tests_of(a, b, tests))
        if a.setting is not None and a.setting == b.setting:
            cell = Cell(same_setting=True)
            if ids:
                problems.append(f"{a.label} × {b.label}: one setting ({a.setting}), and TESTS maps it")
        else:
            cell = Cell(ids, refusal(a, b))
            if cell.accepted and not ids:
                problems.append(f"accepted but untested: {a.label} × {b.label} (add its test to TESTS, or refuse it)")
            if not cell.accepted and ids:
                problems.append(f"refused but mapped to tests: {a.label} × {b.label}: {cell.refusal}")
        cells[a.name, b.name] = cells[b.name, a.name] = cell
    if problems:
        raise GridError("composition grid:\n  " + "\n  ".join(problems))
    return cells


def render(cells: dict[tuple[str, str], Cell]) -> tuple[str, str]:
    """(the grid for the README, the notes for NOTES_FILE): refusals numbered R1.. in order of appearance."""
    reasons: dict[str, int] = {}
    for a, b in combinations(FEATURES, 2):
        cell = cells[a.name, b.name]
        if cell.refusal is not None and not cell.same_setting:
            reasons.setdefault(cell.refusal, len(reasons) + 1)

    def text(a: Feature, b: Feature) -> str:
        if a is b:
            return "·"
        cell = cells[a.name, b.name]
        if cell.same_setting:
            return "—"
        if cell.refusal is not None:
            return f"✗ R{reasons[cell.refusal]}"
        return "✓"

    rows = ["| | " + " | ".join(f.label for f in FEATURES) + " |", "|---" * (len(FEATURES) + 1) + "|"]
    rows += [f"| **{a.label}** | " + " | ".join(text(a, b) for b in FEATURES) + " |" for a in FEATURES]
    pairs_of = {r: [f"{a.label} × {b.label}" for a, b in combinations(FEATURES, 2)
                    if cells[a.name, b.name].refusal == r and not cells[a.name, b.name].same_setting] for r in reasons}
    notes = ["Refusals (the error initialize() raises, naming the key and the fix):", ""]
    notes += [f"- R{n} ({', '.join(pairs_of[r])}): {r}" for r, n in reasons.items()]
    notes += ["", "Tests (each trains the pair against one process):", ""]
    notes += [f"- {a.label} × {b.label}: " + ", ".join(f"`{t}`" for t in cells[a.name, b.name].tests)
              for a, b in combinations(FEATURES, 2) if cells[a.name, b.name].accepted]
    return "\n".join(rows), "\n".join(notes)


def targets(readme: Path) -> list[tuple[Path, tuple[str, str], int]]:
    """(file, markers, index into render()'s result) for the README and the notes file beside it."""
    return [(readme, README_MARKERS, 0), (readme.parent / NOTES_FILE, NOTES_MARKERS, 1)]


def stale_files(readme: Path) -> list[Path]:
    """The files whose grid or notes differ from what the checks and TESTS give now."""
    rendered = render(compute_grid())
    return [path for path, markers, i in targets(readme)
            if replaced(path.read_text(), markers, rendered[i], path) != path.read_text()]


def write(readme: Path) -> None:
    rendered = render(compute_grid())
    for path, markers, i in targets(readme):
        path.write_text(replaced(path.read_text(), markers, rendered[i], path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="README", help="rewrite the grid there and the notes in docs/")
    action.add_argument("--check", type=Path, metavar="README", help="exit 1 when the grid or the notes are stale")
    args = parser.parse_args(argv)
    try:
        if args.write:
            write(args.write)
        elif args.check:
            stale = stale_files(args.check)
            if stale:
                print(f"stale: {', '.join(map(str, stale))}; run scripts/composition_grid.py --write {args.check}",
                      file=sys.stderr)
                return 1
        else:
            grid, notes = render(compute_grid())
            print(f"{grid}\n\n{notes}")
    except (GridError, MarkerError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
