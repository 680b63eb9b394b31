"""The zoo (tests/hf_zoo.py): 22 Hugging Face architectures, every feature they have on, under ZeRO-3, ZeRO-3 with
CPU offload, tensor parallelism with a derived plan, a 2-stage 1F1B pipeline, Ulysses and ring sequence parallelism,
expert parallelism (MoE models), activation checkpointing and layer-major accumulation (tests/zoo_cells.py). Every
cell equals plain PyTorch in one process on the same model, data and seed (fp32 1e-5; tensor and sequence parallel
1e-4), or is refused, with the reason tests/zoo_grid.py lists for it; nothing else. Each strategy's cells run in one
spawned group (two: the 2-rank strategies and the 1-rank ones)."""

from __future__ import annotations

import functools
import re

import pytest

from tests import hf_zoo, zoo_cells
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, param_snapshot, train_reference
from tests.test_data_parallel import adamw
from tests.zoo_grid import REASONS, REFUSED

pytest.importorskip("transformers")

CELLS = zoo_cells.cells(2) + zoo_cells.cells(1)
# The absolute floor of the parameter comparison, per unit of rtol. Plain PyTorch summing each batch's gradient
# as two halves instead of one moves OLMo-2's weights by up to 8.8e-7 from the one-batch reference after the 4
# AdamW steps (eps 1e-6) on an AVX-512 CPU, where its ZeRO-3, offload, pipeline and layer-major cells all land
# 1.09e-6 beyond rtol: fp32 reordering alone reaches the small models' floor of rtol / 10 there.
ATOL_PER_RTOL = 0.2


def _worker(rank: int, world: int, cells: list[tuple[str, str]]) -> dict:
    return run_cases(rank, cells, zoo_cells.run_cell)


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return results_by_case(run_distributed(_worker, 2, args=(zoo_cells.cells(2),), timeout_s=540))


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return results_by_case(run_distributed(_worker, 1, args=(zoo_cells.cells(1),), timeout_s=300))


@functools.cache
def reference(name: str) -> tuple[list[float], dict]:
    model = hf_zoo.build(name)
    losses, _ = train_reference(model, zoo_cells.batches(), adamw, clip=1.0, loss_fn=hf_zoo.hf_loss)
    return losses, param_snapshot(model)


@pytest.mark.parametrize("name,strategy", CELLS, ids=lambda v: v)
def test_cell_trains_like_one_process_or_is_refused_for_its_reason(request, name, strategy):
    processes, _, _, rtol = zoo_cells.STRATEGIES[strategy]
    per_rank = request.getfixturevalue("two_ranks" if processes == 2 else "one_rank")[(name, strategy)]
    reason = REFUSED.get((name, strategy))
    if reason is not None:
        pattern, _ = REASONS[reason]
        for outcome in per_rank:
            assert outcome[0] == "refused" and re.search(pattern, outcome[1]), (reason, outcome[:2])
        return
    for outcome in per_rank:
        assert outcome[0] == "trained", outcome[1]
    ref_losses, ref_params = reference(name)
    held = {}
    for _, losses, params in per_rank:
        assert_close_relative(losses, ref_losses, rtol=rtol)
        held.update(params)  # under a pipeline each rank holds its stages' parameters
    assert_params_close(held, ref_params, rtol=rtol, atol=rtol * ATOL_PER_RTOL)


def test_the_grid_lists_only_cells_that_exist_and_reasons_it_defines():
    assert set(REFUSED) <= set(CELLS)
    assert set(REFUSED.values()) == set(REASONS)
    assert len(hf_zoo.names()) == 22 and len(hf_zoo.MOE_MODELS) == 4


def test_the_docs_grid_is_this_data():
    from scripts.zoo_grid import REPO, main

    docs = str(REPO / "docs" / "parallelism.md")
    assert main(["--check", docs]) == 0, "run: python scripts/zoo_grid.py --write docs/parallelism.md"
