"""The memory estimate (engine/estimate): model-state bytes equal what the engine allocates, exactly, for every
ZeRO stage at 2 and 4 ranks; the peak estimate is within 15% of a real run's peak RSS."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from engine.config import load_config
from engine.estimate import Strategy, estimate, model_states
from engine.estimate.estimator import trace_strategy
from engine.estimate.runtime import peak_rss_bytes as process_peak_rss
from engine.estimate.runtime import reset_peak_rss
from engine.models import gpt_bench30m
from tests.distributed import run_distributed
from tests.reference import tiny_gpt, token_batches, train_engine
from tests.rss import MALLOC_ENV
from tests.test_zero import model_state_bytes, zero_config

# (stage, chunk_size (None: the engine's default layout), extra config); tp > 1 is in the world-4 list
CASES = [(0, None, {}), (1, None, {}), (2, None, {}), (3, None, {}), (1, 20_000, {}), (2, 20_000, {}),
         (3, 20_000, {}), (3, None, {"stage3_param_persistence_threshold": "auto"}), (2, None, {"bf16": True}),
         (3, 20_000, {"bf16": True}), (1, None, {"tp": 2})]


def case_config(stage: int, chunk_size: int | None, extra: dict) -> dict:
    cfg = zero_config(stage, 2, 1, chunk_size=chunk_size)
    if "stage3_param_persistence_threshold" in extra:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = extra["stage3_param_persistence_threshold"]
    if extra.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if extra.get("tp"):
        cfg["tensor_parallel"] = {"size": extra["tp"]}
    if chunk_size is None:
        cfg["zero_optimization"].pop("chunk_size")
    return cfg


def cases_at(world: int) -> list[tuple]:
    return [c for c in CASES if world % c[2].get("tp", 1) == 0]


def _measure_worker(rank, world):
    """Every case's engine trained one step (optimizer states exist after it); its bytes counted from the tensors."""
    measured = []
    for stage, chunk_size, extra in cases_at(world):
        engine = initialize(tiny_gpt(), case_config(stage, chunk_size, extra))
        train_engine(engine, token_batches(1, 2 * engine.dp_world_size), engine.dp_rank, engine.dp_world_size, 1)
        counted = model_state_bytes(engine)
        assert counted == engine.model_state_bytes(), (counted, engine.model_state_bytes())
        measured.append(counted)
        engine.close()
    return measured


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_equal_the_engines_chunks_exactly(world):
    measured = run_distributed(_measure_worker, world)
    for case, counted in zip(cases_at(world), measured[0]):
        cfg = load_config(case_config(*case))
        tp = cfg.tensor_parallel.size
        params = trace_strategy(tiny_gpt, cfg, None, activations=False).params
        estimated = model_states(params, cfg, world // tp).by_kind()
        assert estimated == counted, (case, estimated, counted)
    for counted in measured[1:]:  # every rank holds the same bytes (chunks are padded to whole shards)
        assert counted == measured[0]


def peak_config(stage: int, micro: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def _peak_worker(rank, world, stage, micro):
    """The example GPT (bench30m) trained 3 steps as scripts/train.py trains it; this rank's peak RSS."""
    reset_peak_rss()  # its own peak, not the forked parent's
    torch.manual_seed(0)
    engine = initialize(gpt_bench30m(), peak_config(stage, micro))
    seq = engine.module.config.block_size
    for batch in token_batches(3, micro * world, seq=seq):
        ids = batch[rank * micro:(rank + 1) * micro]
        engine.backward(engine(ids, ids))
        engine.step()
    return process_peak_rss()


@pytest.mark.parametrize("stage,world,micro", [(0, 1, 4), (3, 2, 2)])
def test_peak_estimate_is_within_15_percent_of_measured_peak_rss(monkeypatch, stage, world, micro):
    monkeypatch.setenv(*MALLOC_ENV)  # freed memory goes back to the OS (tests/rss.py), here and in the probe
    measured = max(run_distributed(_peak_worker, world, args=(stage, micro)))
    est = estimate(gpt_bench30m, peak_config(stage, micro), world, strategies=[Strategy(stage)],
                   compute_on_cpu=True)
    predicted = est.rows[0].host_peak
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_a_hugging_face_config_file_is_a_model_spec_that_spawned_trials_can_receive(tmp_path):
    import json
    import pickle

    from engine.estimate import build_model, model_factory

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 100, "max_position_embeddings": 64}))
    factory = pickle.loads(pickle.dumps(model_factory(str(path))))  # as multiprocessing's spawn sends it
    model = build_model(factory, "meta")
    assert type(model).__name__ == "LlamaForCausalLM" and all(p.is_meta for p in model.parameters())


def test_the_estimate_places_one_process_16_bit_offload_where_the_engine_puts_it(tmp_path):
    """bf16, stage 3, everything on NVMe in one process (Notes [paging in one process], [offloaded master
    weights]): 2 + 2 + 12 bytes per element, all of it on NVMe, and the manager holds exactly those payloads."""
    cfg = zero_config(3, 2, 1)
    cfg["bf16"] = {"enabled": True}
    for kind in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][kind] = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = load_config(cfg)
    states = model_states(trace_strategy(tiny_gpt, config, None, activations=False).params, config, 1)
    padded = sum(c.numel for c in states.chunks)
    assert states.by_kind() == {"param": 2 * padded, "grad": 2 * padded, "optim": 12 * padded}
    assert states.tiers.device == 0 and states.tiers.nvme == 16 * padded
    assert states.update_extra == 4 * max(c.numel for c in states.chunks)  # one fp32 gradient at a time
    engine = initialize(tiny_gpt(), cfg)
    x = token_batches(1, 2)[0]
    engine.backward(engine(x, x))
    engine.step()  # the states exist from the first step on
    engine.backward(engine(x, x))  # the gradient shards too, until the next step frees them
    manager = engine.optimizer.manager
    held = sum(manager.chunk(c).nbytes for kind in ("param", "grad", "master", "optim")
               for c in manager.chunks_of(kind))
    assert held == 16 * padded
    assert engine.model_state_bytes() == {"param": 0, "grad": 0, "optim": 0}  # nothing outside the manager
    engine.close()
