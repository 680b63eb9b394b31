"""The README's composition grid and its notes in docs/parallelism.md are what scripts/composition_grid.py computes
from the config checks and its TESTS mapping now; a pair the checks accept without a test, a test id naming no
test function and a refused pair mapped to a test each fail it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts.composition_grid import (
    FEATURES,
    NOTES_FILE,
    TESTS,
    Feature,
    GridError,
    compute_grid,
    main,
    missing_test,
    refusal,
    render,
    stale_files,
)

REPO = Path(__file__).resolve().parent.parent


def test_the_readme_grid_and_its_notes_are_current():
    assert stale_files(REPO / "README.md") == [], "run: python scripts/composition_grid.py --write README.md"


def test_each_cell_follows_the_checks_and_the_tests():
    cells = compute_grid()
    assert cells["pipeline", "tp1d"].tests == ("tests/test_pipeline_engine.py::test_pp2_by_tp2",)
    assert cells["tp1d", "tp2d"].same_setting and cells["tp2d", "megatron_sp"].same_setting
    assert "zero_init" in cells["zero_init", "tp1d"].refusal  # check_run's refusal, from built_under_zero_init
    grid, notes = render(cells)
    assert grid.count("\n") == len(FEATURES) + 1  # a header, its rule and one row per feature
    assert "tests/test_pipeline_engine.py::test_pp2_by_tp2" in notes


def test_an_accepted_pair_without_a_test_fails_naming_it():
    without = {pair: ids for pair, ids in TESTS.items() if pair != ("tp1d", "pipeline")}
    with pytest.raises(GridError, match="accepted but untested: 1D TP × pipeline"):
        compute_grid(without)


def test_a_test_id_naming_no_test_function_fails():
    assert missing_test("tests/test_pipeline_engine.py::test_pp2_by_tp2") is None
    assert "defines no test_pp3_by_tp2" in missing_test("tests/test_pipeline_engine.py::test_pp3_by_tp2[x]")
    assert "no file" in missing_test("tests/test_no_such_file.py::test_pp2_by_tp2")
    renamed = {**TESTS, ("tp1d", "pipeline"): ["tests/test_pipeline_engine.py::test_pp3_by_tp2"]}
    with pytest.raises(GridError, match="defines no test_pp3_by_tp2"):
        compute_grid(renamed)


def test_each_feature_alone_is_accepted():
    """A typo in a feature's fragment would refuse every pair of it; compute_grid refuses that instead."""
    assert all(refusal(f, f) is None for f in FEATURES)
    assert "tensor_parallel.sise" in refusal(*[Feature("typo", "typo", {"tensor_parallel": {"sise": 2}})] * 2)


def test_a_refused_pair_mapped_to_a_test_fails():
    mapped = {**TESTS, ("tp2d", "pipeline"): ["tests/test_pipeline_engine.py::test_pp2_by_tp2"]}
    with pytest.raises(GridError, match="refused but mapped to tests: 2D TP × pipeline"):
        compute_grid(mapped)


def test_check_finds_a_stale_copy_and_write_makes_it_current(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text().replace("| **ZeRO-3** | · |", "| **ZeRO-3** | ✓ |"))
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / NOTES_FILE, tmp_path / NOTES_FILE)
    assert main(["--check", str(readme)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["--write", str(readme)]) == 0
    assert main(["--check", str(readme)]) == 0
    assert readme.read_text() == (REPO / "README.md").read_text()
