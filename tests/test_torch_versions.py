"""torch 2.11 names the tensor collectives all_gather_into_tensor / reduce_scatter_tensor only (2.12 added
all_gather_single / reduce_scatter_single): Tiers looks them up once (engine.comm.collectives_of), and ZeRO-2 and
ZeRO-3 train the same on the 2.11 names, handed to initialize as a namespace without the 2.12 ones (torch itself
is left as it is)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from engine import initialize
from engine.comm import ALL_GATHER_NAMES, REDUCE_SCATTER_NAMES, CommCounter, collectives_of
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import adamw
from tests.test_tensor_parallel import tp_config
from tests.test_zero import GLOBAL_BATCH, STEPS, zero_config

NEW_NAMES = ("all_gather_single", "reduce_scatter_single")


def torch_211_distributed(calls: dict[str, int] | None = None) -> types.SimpleNamespace:
    """Every public name of torch.distributed except the 2.12+ collectives; the 2.11 ones count their calls."""
    names = {n: getattr(dist, n) for n in dir(dist) if not n.startswith("__") and n not in NEW_NAMES}
    if calls is not None:
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            names[name] = _counted(names[name], name, calls)
    return types.SimpleNamespace(**names)


def _counted(op, name: str, calls: dict[str, int]):
    def call(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return op(*args, **kwargs)
    return call


def test_the_lookup_takes_the_2_12_names_where_present_else_the_2_11_ones():
    old = torch_211_distributed()
    assert not hasattr(old, "all_gather_single") and hasattr(old, "all_reduce")
    picked = collectives_of(old)
    assert picked.all_gather is dist.all_gather_into_tensor
    assert picked.reduce_scatter is dist.reduce_scatter_tensor
    default = CommCounter().collectives  # torch.distributed's, under whichever names this torch has
    assert default.all_gather is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert default.reduce_scatter is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    assert collectives_of(types.SimpleNamespace(all_gather_single=len, reduce_scatter_single=abs,
                                                all_gather_into_tensor=min, reduce_scatter_tensor=max)) \
        == collectives_of(types.SimpleNamespace(all_gather_single=len, reduce_scatter_single=abs))


@pytest.mark.parametrize("missing", [ALL_GATHER_NAMES, REDUCE_SCATTER_NAMES])
def test_a_torch_with_neither_name_is_refused_naming_the_version_needed(missing):
    names = {n: print for n in ALL_GATHER_NAMES + REDUCE_SCATTER_NAMES if n not in missing}  # any callable
    with pytest.raises(RuntimeError, match=rf"neither {missing[0]} nor {missing[1]} .*torch 2\.11 or newer"):
        collectives_of(types.SimpleNamespace(**names))


def _stages_on_211_names(rank, world):
    calls: dict[str, int] = {}
    old = collectives_of(torch_211_distributed(calls))
    runs = {}
    for stage in (2, 3):
        engine = initialize(tiny_gpt(seed=rank), zero_config(stage, GLOBAL_BATCH // world, 1), collectives=old)
        losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 1)
        runs[stage] = losses, trained_params(engine), engine.comm.collectives is old
    tp = initialize(tiny_gpt(), tp_config(2, 1), collectives=old).tensor_parallel.tp  # a counter of its own
    runs["tp"] = tp.counter.collectives is old
    # gloo reduce-scatters by all_to_all (Note [reduce-scatter on gloo]): the 2.11 reduce-scatter called as
    # engine.comm calls it on nccl
    whole = torch.arange(4.0) + 10 * rank
    mine = torch.empty(2)
    old.reduce_scatter(mine, whole, op=dist.ReduceOp.SUM, group=None, async_op=False)
    return runs, dict(calls), mine


def test_zero_2_and_3_train_as_single_process_pytorch_on_the_2_11_names():
    model = tiny_gpt()
    ref_losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    ref_params = param_snapshot(model)
    results = run_distributed(_stages_on_211_names, 2, timeout_s=120)
    for stage in (2, 3):
        assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0][stage][0], results[1][0][stage][0])],
                              ref_losses)
        for r in results:
            assert_params_close(r[0][stage][1], ref_params)
            assert r[0][stage][2], "the engine's counter holds the collectives initialize was given"
    assert all(r[0]["tp"] for r in results), "the tensor-parallel counter holds the collectives initialize was given"
    for rank, (_, calls, mine) in enumerate(results):
        assert calls.get("all_gather_into_tensor", 0) > 0, calls  # the engine gathered through the 2.11 name
        assert calls["reduce_scatter_tensor"] == 1, calls
        torch.testing.assert_close(mine, torch.tensor([10.0, 12.0]) + 4 * rank)  # i + (i + 10), i in its half
