"""The memory estimate (engine/estimate): model-state bytes equal what the engine allocates, exactly, for every
ZeRO stage at 2 and 4 ranks; the peak estimate is within 15% of a real run's peak RSS."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from engine.config import load_config
from engine.estimate import EstimateSettings, Strategy, estimate, model_states
from engine.estimate.estimator import trace_strategy
from engine.estimate.runtime import peak_rss_bytes as process_peak_rss
from engine.estimate.runtime import reset_peak_rss
from engine.models import gpt_bench30m
from offload.chunk import Location
from tests.distributed import run_distributed
from tests.reference import tiny_gpt, token_batches, train_engine
from tests.rss import MALLOC_ENV
from tests.test_frozen_chunks import frozen_gpt, stage_config
from tests.test_zero import GLOBAL_BATCH, model_state_bytes, zero_config

ON_CPU = EstimateSettings(compute_on_cpu=True)  # the estimate for the CPU this runs on

# (stage, chunk_size (None: the engine's default layout), extra config); tp > 1 is in the world-4 list
CASES = [(0, None, {}), (1, None, {}), (2, None, {}), (3, None, {}), (1, 20_000, {}), (2, 20_000, {}),
         (3, 20_000, {}), (3, None, {"stage3_param_persistence_threshold": "auto"}), (2, None, {"bf16": True}),
         (3, 20_000, {"bf16": True}), (1, None, {"tp": 2}), (3, 20_000, {"frozen": True}),
         (2, None, {"frozen": True, "bf16": True}),  # frozen: Note [frozen chunks]
         (1, None, {"bf16": "masters"}), (3, 20_000, {"bf16": "masters"}),  # Note [bf16 master weights]
         (2, None, {"optimizer": "AdamW8bit", "bf16": True}),  # Note [block-wise optimizer states]
         (3, 20_000, {"optimizer": "AdamW4bit", "bf16": "masters"})]


def case_config(stage: int, chunk_size: int | None, extra: dict) -> dict:
    cfg = zero_config(stage, 2, 1, chunk_size=chunk_size)
    if "stage3_param_persistence_threshold" in extra:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = extra["stage3_param_persistence_threshold"]
    if extra.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if extra.get("bf16") == "masters":
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if extra.get("optimizer"):
        cfg["optimizer"] = {"type": extra["optimizer"], "params": {"lr": 1e-3}}
    if extra.get("tp"):
        cfg["tensor_parallel"] = {"size": extra["tp"]}
    if chunk_size is None:
        cfg["zero_optimization"].pop("chunk_size")
    return cfg


def case_model(extra: dict):
    return frozen_gpt if extra.get("frozen") else tiny_gpt


def cases_at(world: int) -> list[tuple]:
    return [c for c in CASES if world % c[2].get("tp", 1) == 0]


def _measure_worker(rank, world):
    """Every case's engine trained one step (optimizer states exist after it); its bytes counted from the tensors."""
    measured = []
    for stage, chunk_size, extra in cases_at(world):
        engine = initialize(case_model(extra)(), case_config(stage, chunk_size, extra))
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
        trace = trace_strategy(case_model(case[2]), cfg, None, activations=False)
        estimated = model_states(trace.params, cfg, world // tp, trace.frozen).by_kind()
        assert estimated == counted, (case, estimated, counted)
    for counted in measured[1:]:  # every rank holds the same bytes (chunks are padded to whole shards)
        assert counted == measured[0]



# ---- int8 frozen chunks (Note [int8 frozen chunks]) -----------------------------------------------------------------

INT8_OFFLOADS = (None, "cpu")  # stage 3, bf16: shards in memory (one rank: paged anyway), or homed on the CPU


def int8_config(world: int, offload: str | None, quantize: str = "int8") -> dict:
    cfg = stage_config(3, world, torch.bfloat16, offload)
    cfg["zero_optimization"]["quantize_frozen"] = quantize
    return cfg


def _int8_worker(rank, world):
    """Each offload case's engine after a step and a backward (gradient shards held): its bytes on the device and
    in the manager, by tier, and by kind counted from the tensors (the int8 chunks' scales with the parameters)."""
    measured = []
    for offload in INT8_OFFLOADS:
        engine = initialize(frozen_gpt(), int8_config(world, offload))
        train_engine(engine, token_batches(1, GLOBAL_BATCH), rank, world, 1)
        x = token_batches(1, GLOBAL_BATCH)[0][rank::world]
        engine.backward(engine(x, x))
        int8 = [s.int8 for s in engine.chunked.frozen_states if s.int8 is not None]
        counted = model_state_bytes(engine)
        counted["param"] += sum(q.scales.untyped_storage().nbytes() for q in int8)
        manager = getattr(engine.optimizer, "manager", None)
        measured.append({"int8_chunks": len(int8), "by_kind": counted, "engine": engine.model_state_bytes(),
                         "device": sum(engine.device_state_bytes().values()),
                         "cpu": sum(manager.used_bytes_by_kind(Location.CPU).values()) if manager else 0})
        engine.close()
    return measured


@pytest.mark.parametrize("world", [1, 2])
def test_int8_frozen_chunks_are_estimated_as_the_engine_holds_them(world):
    """quantize_frozen "int8" at stage 3, bf16: the frozen linear weights' shards at 1 byte per element and their
    per-row scales on the device; the estimate's device and CPU tiers (and, without offload, its bytes by kind) are
    the engine's exactly, below the same model's estimate with bf16 frozen chunks."""
    measured = run_distributed(_int8_worker, world)
    for offload, counted in zip(INT8_OFFLOADS, measured[0]):
        cfg, plain = load_config(int8_config(world, offload)), load_config(int8_config(world, offload, "none"))
        trace = trace_strategy(frozen_gpt, cfg, None, activations=False)
        assert sum(p.linear_weight for p in trace.frozen) == 3  # the first attention's two, the head tied to wte
        states = model_states(trace.params, cfg, world, trace.frozen)
        assert counted["int8_chunks"] == sum(c.int8 for c in states.chunks) > 0, (offload, counted)
        assert (states.tiers.device, states.tiers.cpu) == (counted["device"], counted["cpu"]), (offload, counted)
        if offload is None:
            assert states.by_kind() == counted["by_kind"] == counted["engine"], (offload, states, counted)
        unquantized = model_states(trace.params, plain, world, trace.frozen)
        assert states.frozen < unquantized.frozen and states.param < unquantized.param
        assert states.tiers.device + states.tiers.cpu < unquantized.tiers.device + unquantized.tiers.cpu
    for counted in measured[1:]:
        assert counted == measured[0]


def test_the_estimate_leaves_out_strategies_that_refuse_quantize_frozen():
    """quantize_frozen needs stage 3 and data parallelism only: other strategies are named as not estimated."""
    est = estimate(frozen_gpt, int8_config(2, None), 2, strategies=[Strategy(1), Strategy(3), Strategy(3, tp=2)],
                   settings=ON_CPU)
    (row,) = est.rows
    assert row.strategy == Strategy(3) and any(c.int8 for c in row.states.chunks)
    assert len(est.skipped) == 2 and "needs ZeRO stage 3 (this run: stage 1)" in est.skipped[0]
    assert "not built yet with tensor parallelism" in est.skipped[1]


def test_the_estimate_names_the_strategies_a_low_precision_layout_rules_out():
    """bf16 master weights need stage 1-3 and block-wise states no tensor parallelism (Note [bf16 master weights],
    [block-wise optimizer states]): DDP and TP2 are named as not estimated, the others estimated."""
    cfg = case_config(3, None, {"bf16": "masters", "optimizer": "AdamW8bit"})
    est = estimate(tiny_gpt, cfg, 2, strategies=[Strategy(0), Strategy(2), Strategy(3, tp=2)], settings=ON_CPU)
    assert [row.strategy for row in est.rows] == [Strategy(2)]
    assert "needs ZeRO stage 1-3" in est.skipped[0] and "tensor-parallel" in est.skipped[1]

def test_layer_major_accumulation_keeps_every_micro_batchs_activations():
    """Note [layer-major accumulation]: the step holds what each of the 8 micro-batches' forwards leaves for its
    backward at once; a strategy without offload_param drops the section, layer_major with it."""
    cfg = zero_config(3, 2, 8, offload_param={"device": "cpu", "layer_major": True},
                      offload_optimizer={"device": "cpu"})
    offloaded = Strategy(3, offload_optimizer="cpu", offload_param="cpu")
    est = estimate(tiny_gpt, cfg, 1, strategies=[offloaded, Strategy(3)], settings=ON_CPU)
    layered, plain = est.rows
    trace = trace_strategy(tiny_gpt, load_config(cfg), est.seq_len).activations
    held = sum(trace.held_at(2))
    assert held > 0 and plain.activations == trace.peak_at(2)
    assert layered.activations == plain.activations + 7 * held


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
    est = estimate(gpt_bench30m, peak_config(stage, micro), world, strategies=[Strategy(stage)], settings=ON_CPU)
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


# ---- pipelines (Note [estimating a pipeline]) ----------------------------------------------------------------------

def pipeline_config(microbatches: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": microbatches,
            "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def test_a_pipeline_rank_holds_its_stages_parameters_and_the_heaviest_rank_is_reported():
    from engine.models import gpt_small

    est = estimate(gpt_small, pipeline_config(8), 4, strategies=[Strategy(0), Strategy(0, pp=2), Strategy(0, pp=4)],
                   settings=ON_CPU)
    whole, two, four = est.rows
    assert two.strategy.name == "PP2-1f1b DDP" and whole.pipeline is None
    assert 0.45 <= two.states.param / whole.states.param <= 0.56  # about half of the model per rank
    assert 0.2 <= four.states.param / whole.states.param <= 0.32
    tied = gpt_small().wte.weight.numel()  # the embedding is the output head too: both end stages hold it
    for row in (two, four):
        assert sum(row.pipeline.stage_params) == est.params + tied
        assert abs(row.pipeline.stage_params[0] - row.pipeline.stage_params[-1]) <= 0.1 * row.pipeline.stage_params[0]
    # 4 layers on 4 ranks: [embeddings + layer 0], [layer 1], [layer 2], [layer 3 + final norm + head]; rank 0 holds
    # the most micro-batches (4) and as many parameters as any, so its peak is the highest
    assert four.pipeline.in_flight == (4, 3, 2, 1) and four.pipeline.rank == 0
    assert four.pipeline.stage_params[0] == max(four.pipeline.stage_params)
    assert 4 * four.pipeline.stage_params[0] <= four.states.param <= 1.05 * 4 * four.pipeline.stage_params[0]


def test_1f1b_holds_fewer_micro_batches_activations_than_gpipe():
    from engine.models import gpt_small

    est = estimate(gpt_small, pipeline_config(8), 2, settings=ON_CPU,
                   strategies=[Strategy(0), Strategy(0, pp=2, schedule="gpipe"), Strategy(0, pp=2)])
    whole, gpipe, one_f_one_b = est.rows
    assert gpipe.pipeline.in_flight == (8, 8) and one_f_one_b.pipeline.in_flight == (2, 1)
    assert gpipe.activations > 3 * one_f_one_b.activations  # 8 micro-batches of a stage against 2
    # 1F1B's rank 0 holds 2 micro-batches of half the layers: about what one micro-batch of the whole model holds
    assert 0.8 * whole.activations <= one_f_one_b.activations <= 1.2 * whole.activations
    assert gpipe.pipeline.bubble == pytest.approx(one_f_one_b.pipeline.bubble)  # the same bubble, more memory


@pytest.mark.parametrize("stages,microbatches", [(2, 8), (4, 8), (4, 2)])
def test_the_printed_bubble_is_1f1bs_formula(stages, microbatches):
    from engine.estimate import format_estimate
    from engine.models import gpt_small

    est = estimate(gpt_small, pipeline_config(microbatches), 4, strategies=[Strategy(1, pp=stages)],
                   settings=ON_CPU)
    bubble = (stages - 1) / (microbatches + stages - 1)
    (row,) = est.rows
    assert row.pipeline.bubble == pytest.approx(bubble) and row.pipeline.microbatches == microbatches
    printed = format_estimate(est)
    assert f"{bubble:.1%} (m={microbatches}" in printed and f"bubble {bubble:.1%}" in printed
    starved = microbatches < stages  # fewer micro-batches than stages is called out, with the setting to change
    assert (f"only {microbatches} < {stages} stages!" in printed) == starved
    assert ("set it to 16 or more" in printed) == starved
    # the step's compute: the busiest rank's share of the work, stretched by the bubble
    assert row.pipeline.compute_factor == pytest.approx(1 / stages / (1 - bubble), rel=0.3)


def test_a_pipeline_split_follows_the_partition_and_one_that_cannot_be_made_is_named():
    from engine.estimate import format_estimate
    from engine.models import gpt_small

    config = pipeline_config(4)
    config["pipeline"] = {"partition": ["blocks.1"]}  # stage 1 starts at the second layer
    est = estimate(gpt_small, config, 2, settings=ON_CPU,
                   strategies=[Strategy(0, pp=2), Strategy(0, pp=2, schedule="interleaved", virtual_stages=4)])
    (row,) = est.rows
    assert row.strategy.config({}, None)["pipeline"] == {"stages": 2, "schedule": "1f1b"}
    assert row.config["pipeline"]["partition"] == ["blocks.1"]
    model = gpt_small()
    layer = sum(p.numel() for p in model.blocks[0].parameters())
    embeddings = model.wte.weight.numel() + model.wpe.weight.numel()
    final_norm = sum(p.numel() for p in model.ln_f.parameters())
    # stage 0: the embeddings and the first layer; stage 1: three layers, the final norm and the (tied) head
    assert row.pipeline.stage_params == (embeddings + layer, 3 * layer + final_norm + model.wte.weight.numel())
    assert est.skipped == ["PP2-interleaved-v4 DDP: pipeline.partition: the names ['blocks.1'] start 2 stages, but "
                           "the pipeline has 8; name the module that starts each stage"]
    assert "Not estimated: PP2-interleaved-v4 DDP" in format_estimate(est)


def test_under_hybrid_sharding_the_estimate_shards_over_one_shard_group():
    """Note [hybrid sharding]: 4 ranks in shard groups of 2 hold what 2 ranks of plain ZeRO-3 hold."""
    plain, hybrid = load_config(zero_config(3, 2, 1)), load_config(zero_config(3, 2, 1, mics_shard_size=2))
    params = trace_strategy(tiny_gpt, plain, None, activations=False).params
    assert model_states(params, hybrid, 4).by_kind() == model_states(params, plain, 2).by_kind()
    assert model_states(params, hybrid, 4).by_kind() != model_states(params, plain, 4).by_kind()
