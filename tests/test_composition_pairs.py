"""Pairs of features the config checks accept and no other test trains together (scripts/composition_grid.py
lists them): offload with zero_init, 1D and 2D tensor parallelism, Megatron SP, Ulysses and activation
checkpointing; zero_init with ring attention and activation checkpointing. Each trains the example GPT like plain
single-process PyTorch on the same data and seed."""

from __future__ import annotations

import pytest

from engine import initialize, zero_init
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import (
    FP32_RTOL,
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import ADAMW, adamw

STEPS, GLOBAL_BATCH = 3, 8
# ZeRO-3 with every parameter sharded (threshold 0), its shards and optimizer states offloaded to CPU
OFFLOAD = {"zero_optimization": {"stage": 3, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
ZERO3 = {"zero_optimization": {"stage": 3, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0}}
CHECKPOINTING = {"activation_checkpointing": {"enabled": True}}
# name: (config additions, processes, built under zero_init)
CASES = {
    "offload-zero_init": (OFFLOAD, 2, True),
    "offload-tp1d": ({**OFFLOAD, "tensor_parallel": {"size": 2}}, 2, False),
    "offload-megatron_sp": ({**OFFLOAD, "tensor_parallel": {"size": 2, "sequence_parallel": True}}, 2, False),
    "offload-ulysses": ({**OFFLOAD, "sequence_parallel": {"size": 2, "mode": "ulysses"}}, 2, False),
    "zero_init-ring": ({**ZERO3, "sequence_parallel": {"size": 2, "mode": "ring"}}, 2, True),
    "offload-checkpointing": ({**OFFLOAD, **CHECKPOINTING}, 1, False),
    "zero_init-checkpointing": ({**ZERO3, **CHECKPOINTING}, 1, True),
    "offload-tp2d": ({**OFFLOAD, "tensor_parallel": {"size": 4, "mode": "2d"}}, 4, False),
}


def _train(rank: int, world: int, name: str) -> tuple[list[float], dict]:
    """This rank's losses and the whole trained parameters of case `name`."""
    additions, _, under_zero_init = CASES[name]
    cfg = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "gradient_clipping": 1.0, "steps_per_print": 10**6, **additions}
    if under_zero_init:
        with zero_init():
            model = tiny_gpt()
    else:
        model = tiny_gpt()
    engine = initialize(model, cfg)
    losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        (micro,) = micro_batches(x, engine.dp_rank, engine.dp_world_size, 1)
        loss = engine(micro, micro)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    check_in_effect(engine, additions)
    params = trained_params(engine)
    engine.close()
    return losses, params


def check_in_effect(engine, additions: dict) -> None:
    """Each feature of the pair is on in the engine, not skipped."""
    if "offload_param" in additions["zero_optimization"]:  # between steps: every shard and state in the manager
        held = engine.model_state_bytes()
        assert held["param"] == 0 and held["optim"] == 0, held
        assert engine.optimizer.manager.stats.resident_bytes["cpu"] > 0
    assert ("tensor_parallel" in additions) == (engine.tensor_parallel is not None)
    assert ("sequence_parallel" in additions) == (engine.sequence is not None)
    assert ("activation_checkpointing" in additions) == bool(engine.activation_checkpointing.wrapped)


def _cases_worker(rank: int, world: int, names: list[str]) -> dict:
    return run_cases(rank, [(name,) for name in names], lambda name: _train(rank, world, name))


@pytest.fixture(scope="module")
def two_rank_results() -> dict:
    """Every two-rank case in one spawned group."""
    names = [name for name, (_, processes, _) in CASES.items() if processes == 2]
    return results_by_case(run_distributed(_cases_worker, 2, args=(names,), timeout_s=300))


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    model = tiny_gpt()
    losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, param_snapshot(model)


@pytest.mark.parametrize("name", list(CASES))
def test_pair_trains_like_one_process(name, reference, request):
    additions, processes, _ = CASES[name]
    if processes == 1:
        results = [_train(0, 1, name)]
    elif processes == 2:
        results = request.getfixturevalue("two_rank_results")[(name,)]
    else:
        results = run_distributed(_train, processes, args=(name,), timeout_s=300)
    # the mean over ranks: data-parallel ranks see equal halves, tensor- and sequence-parallel ranks one batch
    losses = [sum(r[0][step] for r in results) / len(results) for step in range(STEPS)]
    # tensor parallelism and ring attention sum in another order; Adam magnifies that in small parameters
    split = "tensor_parallel" in additions or "sequence_parallel" in additions
    rtol = 1e-4 if split else FP32_RTOL
    ref_losses, ref_params = reference
    assert_close_relative(losses, ref_losses, rtol=rtol)
    for _, params in results:
        assert_params_close(params, ref_params, rtol=rtol)
