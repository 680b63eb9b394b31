"""Note [hybrid sharding]: `zero_optimization.mics_shard_size` 2 on 4 ranks (two copies of the ZeRO states, each
sharded over 2 ranks) trains like single-process PyTorch at stages 1-3, holds the states a 2-way shard holds, and
its checkpoint loads under plain ZeRO-3 on the same ranks and in one process. Composed with offload, zero_init,
Ulysses and activation checkpointing (4 ranks) and with 1D / 2D tensor parallelism, Megatron SP and a pipeline (8
ranks), it trains like one process too (the README's composition grid)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from safetensors.torch import load_file

from engine import initialize, zero_init
from engine.config import load_config
from engine.config_schema import ConfigError
from tests.distributed import run_distributed
from tests.reference import (
    FP32_RTOL,
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import ADAMW, adamw
from tests.test_zero import FORMULA, model_state_bytes, zero_config

WORLD, SHARD, STEPS, GLOBAL_BATCH, SAVED_AT = 4, 2, 4, 8, 2
CASES = [(1, 2, True), (2, 2, True), (3, 2, True), (3, 1, False)]  # (stage, accumulation, reduce_scatter)
# a pair of the composition grid: (config additions, processes, mics_shard_size, built under zero_init)
PAIRS = {
    "offload": ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
                4, 2, False),
    "zero_init": ({}, 4, 2, True),
    "ulysses_ring": ({"sequence_parallel": {"size": 2}}, 4, 2, False),  # 2 copies of a shard group of dp 1 × sp 2
    "checkpointing": ({"activation_checkpointing": {"enabled": True}}, 4, 2, False),
    "tp1d": ({"tensor_parallel": {"size": 2}}, 8, 2, False),
    "megatron_sp": ({"tensor_parallel": {"size": 2, "sequence_parallel": True}}, 8, 2, False),
    "pipeline": ({"pipeline": {"stages": 2, "schedule": "1f1b"}}, 8, 2, False),
    "tp2d": ({"tensor_parallel": {"size": 4, "mode": "2d"}}, 8, 1, False),  # dp 2: two copies of one-rank shards
}


def _config(stage: int, accumulation: int, reduce_scatter: bool = True, shard: int = SHARD) -> dict:
    return zero_config(stage, GLOBAL_BATCH // WORLD // accumulation, accumulation, reduce_scatter=reduce_scatter,
                       mics_shard_size=shard)


def _train_case(rank: int, stage: int, accumulation: int, reduce_scatter: bool, root: str) -> dict:
    engine = initialize(tiny_gpt(seed=rank), _config(stage, accumulation, reduce_scatter))
    assert (engine.topology.replica_size, engine.chunked.shard_count) == (WORLD // SHARD, SHARD)
    batches = token_batches(STEPS, GLOBAL_BATCH)
    losses, norms = train_engine(engine, batches[:SAVED_AT], rank, WORLD, accumulation)
    out = {"bytes": model_state_bytes(engine)}
    if (stage, reduce_scatter) == (3, True):
        engine.save_checkpoint(os.path.join(root, "hsdp"))
        out["saved"] = engine.full_state_dict()
    more = train_engine(engine, batches[SAVED_AT:], rank, WORLD, accumulation)
    out.update(losses=losses + more[0], norms=norms + more[1], params=trained_params(engine))
    engine.close()
    return out


def _second_backward(rank: int, reduce_scatter: bool, second_local: bool) -> dict:
    """Note [several synchronized backward passes] under hybrid sharding: each sum counted once over all ranks."""
    cfg = {**_config(1, 1, reduce_scatter), "gradient_clipping": 0.0, "optimizer": {"type": "SGD",
                                                                                     "params": {"lr": 0.5}}}
    engine = initialize(tiny_gpt(), cfg)
    rows = token_batches(1, GLOBAL_BATCH)[0][rank * 2:(rank + 1) * 2]
    for _ in range(2):
        engine.backward(engine(rows[:1], rows[:1]))
        with engine.no_sync() if second_local else contextlib.nullcontext():
            engine.backward(engine(rows[1:], rows[1:]))
        engine.step()
    params = trained_params(engine)
    engine.close()
    return params


def _load_as_plain_zero3(rank: int, root: str) -> dict:
    engine = initialize(tiny_gpt(), zero_config(3, GLOBAL_BATCH // WORLD, 1))
    engine.load_checkpoint(os.path.join(root, "hsdp"))
    loaded = engine.full_state_dict()
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[SAVED_AT:], rank, WORLD, 1)
    out = {"loaded": loaded, "losses": losses, "params": trained_params(engine)}
    engine.close()
    return out


def _pair_case(name: str) -> tuple[list[float], dict]:
    """This rank's step losses and the whole trained model's state dict of pair `name` under hybrid sharding."""
    additions, _, shard, under_zero_init = PAIRS[name]
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": ADAMW}, "steps_per_print": 10**6, **additions,
           "zero_optimization": {"stage": 3, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0,
                                 "mics_shard_size": shard, **additions.get("zero_optimization", {})}}
    with zero_init() if under_zero_init else contextlib.nullcontext():
        model = tiny_gpt()
    engine = initialize(model, cfg)
    assert engine.topology.replica_size == 2
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        micros = micro_batches(batch, engine.dp_rank, engine.dp_world_size, 2)
        if "pipeline" in additions:
            losses.append(engine.train_batch(iter([{"input_ids": x, "labels": x} for x in micros])))
            continue
        step = []
        for x in micros:
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            step.append(loss.item())
        losses.append(sum(step) / len(step))
    whole = engine.full_state_dict()  # (a pipeline stage's module names only its own parameters)
    engine.close()
    return losses, whole


def _pairs_worker(rank: int, world: int) -> dict:
    return {name: _pair_case(name) for name, (_, processes, _, _) in PAIRS.items() if processes == world}


def _worker(rank: int, world: int, root: str) -> dict:
    out = {case: _train_case(rank, *case, root) for case in CASES}
    out.update(_pairs_worker(rank, world))
    out["second_backward"] = [_second_backward(rank, scatter, local) for scatter in (True, False)
                              for local in (False, True)]
    out["plain_zero3"] = _load_as_plain_zero3(rank, root)
    return out


@pytest.fixture(scope="module")
def reference():
    model = tiny_gpt()
    losses, norms = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, norms, param_snapshot(model)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hsdp"))
    return root, run_distributed(_worker, WORLD, args=(root,), timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-accumulation{c[1]}{'' if c[2] else '-allreduce'}")
def test_hybrid_sharding_matches_one_process_and_shards_the_states_over_one_copy(run, reference, case):
    ref_losses, ref_norms, ref_params = reference
    results = [per_rank[case] for per_rank in run[1]]
    assert_close_relative([sum(r["losses"][i] for r in results) / WORLD for i in range(STEPS)], ref_losses)
    assert_close_relative(results[0]["norms"], ref_norms)  # squares summed over one copy's shards only
    psi = sum(p.numel() for p in ref_params.values())
    for r in results:
        assert_params_close(r["params"], ref_params)
        for kind, (replicated, sharded) in FORMULA[case[0]].items():  # sharded over SHARD ranks, not WORLD
            expected = replicated * psi + sharded * psi / SHARD
            assert abs(r["bytes"][kind] - expected) <= 0.05 * expected + 20_000 * 4, (kind, r["bytes"][kind])


def test_several_backward_passes_before_a_step_add_up_once_over_every_rank(run):
    model = tiny_gpt()
    batch = token_batches(1, GLOBAL_BATCH)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        (2 * model(batch, batch)).backward()  # each rank's two losses are means over one row each of its two
        opt.step()
        opt.zero_grad()
    for per_rank in run[1]:
        for params in per_rank["second_backward"]:
            assert_params_close(params, param_snapshot(model))


def test_a_hybrid_checkpoint_loads_as_plain_zero3_on_the_same_ranks(run, reference):
    root, per_rank = run
    saved = per_rank[0][(3, 2, True)]["saved"]
    results = [r["plain_zero3"] for r in per_rank]
    for r in results:
        assert all(torch.equal(r["loaded"][k], saved[k]) for k in saved)
        assert_params_close(r["params"], reference[2])
    assert_close_relative([sum(r["losses"][i] for r in results) / WORLD for i in range(STEPS - SAVED_AT)],
                          reference[0][SAVED_AT:])


def test_a_hybrid_checkpoint_holds_one_copy_of_the_shards(run):
    """The first copy's ranks (ZeRO ranks 0, 1) write the shards; the second copy's hold the same and write none."""
    (tag,) = [d for d in os.listdir(os.path.join(run[0], "hsdp")) if d.startswith("global_step")]
    directory = os.path.join(run[0], "hsdp", tag)
    files = {rank: load_file(os.path.join(directory, f"rank{rank:05d}.safetensors")) for rank in range(WORLD)}
    chunks = {rank: [key for key in tensors if key.startswith("chunk.")] for rank, tensors in files.items()}
    assert chunks[0] and chunks[1] and not chunks[2] and not chunks[3], {r: len(k) for r, k in chunks.items()}


def test_a_hybrid_checkpoint_loads_in_one_process(run, reference):
    root, per_rank = run
    engine = initialize(tiny_gpt(), zero_config(3, GLOBAL_BATCH, 1))
    engine.load_checkpoint(os.path.join(root, "hsdp"))
    saved = per_rank[0][(3, 2, True)]["saved"]
    loaded = engine.full_state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[SAVED_AT:], 0, 1, 1)
    assert_close_relative(losses, reference[0][SAVED_AT:])
    assert_params_close(trained_params(engine), reference[2])
    engine.close()


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict]:
    return run_distributed(_pairs_worker, 8, timeout_s=420)


@pytest.mark.parametrize("name", list(PAIRS))
def test_hybrid_sharding_composes(name, run, reference, request):
    """The mean over ranks: data-parallel ranks see equal parts of each batch, the others the same part."""
    per_rank = run[1] if PAIRS[name][1] == WORLD else request.getfixturevalue("eight_ranks")
    results = [r[name] for r in per_rank]
    ref_losses, _, ref_params = reference
    # tensor and sequence parallelism sum in another order; Adam magnifies that in small parameters
    rtol = FP32_RTOL if name in ("offload", "zero_init", "checkpointing") else 1e-4
    assert_close_relative([sum(r[0][i] for r in results) / len(results) for i in range(STEPS)], ref_losses, rtol)
    for _, whole in results:
        assert_params_close({k: whole[k] for k in ref_params}, ref_params, rtol=rtol)


@pytest.mark.parametrize("zero, message", [
    ({"stage": 0, "mics_shard_size": 2}, "mics_shard_size: 2 — sets how far ZeRO shards the model states, and stage 0"),
    ({"stage": 3, "mics_shard_size": 0}, "mics_shard_size: 0 — a shard group of no ranks"),
])
def test_a_shard_size_that_shards_nothing_is_refused_naming_the_key(zero, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW"}, "zero_optimization": zero})
