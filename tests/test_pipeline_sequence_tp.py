"""Megatron sequence parallelism (Note [Megatron sequence parallelism]) inside the stages of a pipeline (Note [a
pipelined step]): pp 2 × tp 2 with tensor_parallel.sequence_parallel trains as one process trains the whole model,
under every schedule, at ZeRO 1 and 3; between the stages travels this rank's part of the sequence only."""

from __future__ import annotations

import pytest

from engine import initialize
from engine.pipeline.p2p import HEADER_SIZE
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, micro_batches, token_batches
from tests.test_pipeline_engine import GLOBAL_BATCH, MODELS, STEPS, pipeline_config, reference, stage_params

RTOL = 1e-4
PP, TP, ACCUMULATION, SEQ = 2, 2, 4, 32
WORLD = PP * TP  # dp 1


def _train(rank, world, name, schedule, virtual, stage, option):
    extra = {"tensor_parallel": {"size": TP, "sequence_parallel": True}}
    if option == "checkpointing":
        extra["activation_checkpointing"] = {"enabled": True}
    cfg = pipeline_config(PP, schedule, 1, ACCUMULATION, virtual, stage, **extra)
    if option == "time":  # the blocks' forwards timed on the whole model, under sequence parallelism
        cfg["pipeline"]["partition"] = "time"
    engine = initialize(MODELS[name](), cfg)
    assert engine.tensor_parallel.sequence is not None and engine.num_stages == PP
    losses, norms, sent = [], [], []
    for step, batch in enumerate(token_batches(STEPS, GLOBAL_BATCH, seq=SEQ)):
        mbs = [{"input_ids": x, "labels": x} for x in micro_batches(batch, 0, 1, ACCUMULATION)]
        if step == 0:  # the forwards alone, before any update: the first step's loss
            evaluated = engine.eval_batch(iter(mbs))
        before = engine.comm.p2p_bytes
        losses.append(engine.train_batch(iter(mbs)))
        sent.append(engine.comm.p2p_bytes - before)
        norms.append(engine.get_global_grad_norm())
    stages = engine.pipeline.split.plan.stages_of_rank(engine.topology.pp_rank)
    result = losses, norms, stage_params(engine), sent, stages, evaluated
    engine.close()
    return result


# model, schedule, virtual stages, ZeRO stage, option (activation checkpointing, partition by time, or none)
# (at dp 1 a ZeRO shard is the whole chunk: stage 3 here checks the config path, not the gathering)
CASES = [("gpt", "1f1b", 1, 1, ""), ("gpt", "interleaved", 2, 1, ""),
         ("gpt", "gpipe", 1, 3, "checkpointing"), ("gpt", "zero_bubble", 1, 1, "time"), ("hf_llama", "1f1b", 1, 3, "")]


def _cases_worker(rank, world):
    return run_cases(rank, CASES, lambda *case: _train(rank, world, *case))


@pytest.fixture(scope="module")
def four_ranks() -> dict[tuple, list]:
    """Each case's results in rank order: one spawned group of pp 2 × tp 2 runs them all."""
    return results_by_case(run_distributed(_cases_worker, WORLD, timeout_s=600))


def hidden_size(name: str) -> int:
    model = MODELS[name]()
    return model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.n_embd


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(filter(None, (c[0], c[1], f"zero{c[3]}", c[4]))))
def test_pipeline_with_megatron_sequence_parallelism_equals_one_process(four_ranks, case):
    """eval_batch's loss before training, the step losses, global gradient norms (the layer norms' partial
    gradients summed over tp on every stage) and every stage's final parameters equal one process's; each
    micro-batch's hidden state crosses a stage boundary as this rank's half of the sequence, its gradient back
    likewise (the bytes sent: a header and b·T/tp·h fp32)."""
    name, schedule, virtual = case[:3]
    ref_losses, ref_params, ref_norms = reference(name)
    stages_total = PP * virtual
    message = HEADER_SIZE * 8 + (GLOBAL_BATCH // ACCUMULATION) * (SEQ // TP) * hidden_size(name) * 4
    held = {}
    for losses, norms, params, sent, stages, evaluated in four_ranks[case]:
        assert_close_relative([evaluated] + losses, ref_losses[:1] + ref_losses, rtol=RTOL)
        assert_close_relative(norms, ref_norms, rtol=RTOL)
        boundaries = sum((s < stages_total - 1) + (s > 0) for s in stages)  # outputs forward, gradients back
        assert sent == [ACCUMULATION * boundaries * message] * STEPS
        for key, value in params.items():
            if key in held:  # every tp rank of a stage, and a weight two stages hold (tied), hold the same values
                assert_params_close({key: value}, {key: held[key]}, rtol=RTOL)
            held[key] = value
    assert held.keys() == ref_params.keys()
    assert_params_close(held, ref_params, rtol=RTOL)
