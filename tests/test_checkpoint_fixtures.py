"""Checkpoints an earlier Tiers wrote (tests/fixtures/checkpoints/, made by tests/checkpoint_fixtures.py, each with
the whole weights it saved) load in this one: consolidated by `tiers convert`'s reader, and into one process's engine
with the step count and weights they were saved with, which then trains on."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine import initialize
from engine.checkpoint.export import consolidate
from tests.checkpoint_fixtures import LAYOUTS, ROOT, STEPS, TAG, config, train

pytestmark = pytest.mark.parametrize("name", sorted(LAYOUTS))


def _expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(ROOT / name / "expected.safetensors")


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    assert set(got) == set(expected)
    return [k for k in expected if not torch.equal(got[k].cpu(), expected[k])]


def test_a_committed_checkpoint_consolidates_to_the_weights_it_saved(name, tmp_path):
    consolidate(str(ROOT / name / TAG), str(tmp_path))
    got = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        got.update(load_file(f))
    assert _equal(got, _expected(name)) == []


def test_a_committed_checkpoint_loads_in_one_process_and_trains_on(name):
    build, _ = LAYOUTS[name]
    engine = initialize(build(), config(0))
    engine.load_checkpoint(str(ROOT / name), TAG)
    assert engine.global_step == STEPS
    assert _equal(engine.full_state_dict(), _expected(name)) == []
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    train(engine, name)  # the loaded optimizer states step on
    assert engine.global_step == 2 * STEPS
    assert any(not torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    engine.close()
