"""Ulysses and ring sequence parallelism inside a pipeline (Note [a pipelined step], Note [sequence parallelism]):
on 4 ranks, pp 2 × sp 2 under schedules 1f1b and zero bubble, every stage takes this rank's part of each
micro-batch's sequences, runs its attention over the sequence group (recomputed so under activation checkpointing),
sends on this rank's part of the hidden state, and the last stage's loss is the whole sequence's, token-weighted;
Hugging Face Llama and GPT-2 train as one process trains the whole model on the whole sequences."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from engine.pipeline.p2p import HEADER_SIZE
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import (
    FP32_RTOL,
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    token_batches,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import ADAMW, adamw
from tests.test_pipeline_engine import hf_gpt2, hf_llama

STEPS, BATCH, SEQ, MICRO_BATCHES, WIDTH = 2, 4, 32, 4, 64
MODELS = {"hf_llama": hf_llama, "hf_gpt2": hf_gpt2}
# (model, mode, schedule, ZeRO stage, activation checkpointing, padded labels)
TRAINING_CASES = [("hf_llama", "ring", "1f1b", 0, True, False), ("hf_llama", "ulysses", "1f1b", 1, True, False),
                  ("hf_gpt2", "ulysses", "1f1b", 3, False, True), ("hf_gpt2", "ring", "zero_bubble", 1, False, True)]
SAVED_CASE = TRAINING_CASES[1]  # its run ends with a checkpoint, which one process resumes


def labels_of(x: torch.Tensor, padded: bool) -> torch.Tensor:
    """Padded: positions 19 onward ignored, so that under Ulysses the sequence ranks count 16 and 2 tokens per row
    (the loss and the gradients must be weighted by those shares)."""
    labels = x.clone()
    if padded:
        labels[:, 19:] = -100
    return labels


def config(mode: str, schedule: str, stage: int, checkpointing: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // MICRO_BATCHES, "gradient_accumulation_steps": MICRO_BATCHES,
            "optimizer": {"type": "AdamW", "params": ADAMW}, "gradient_clipping": 1.0, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "chunk_size": 20_000},
            "pipeline": {"stages": 2, "schedule": schedule}, "sequence_parallel": {"size": 2, "mode": mode},
            "activation_checkpointing": {"enabled": checkpointing}}


def micro_batches(batch: torch.Tensor, padded: bool) -> list[dict]:
    return [{"input_ids": x, "labels": labels_of(x, padded)} for x in batch.chunk(MICRO_BATCHES)]


def _train(name: str, mode: str, schedule: str, stage: int, checkpointing: bool, padded: bool, save_dir: str):
    model = MODELS[name]()  # use_cache True, transformers' default: a checkpointed block runs without the cache
    engine = initialize(model, config(mode, schedule, stage, checkpointing))
    assert (engine.num_stages, engine.seq_parallel_world_size, engine.sequence.mode) == (2, 2, mode)
    losses, p2p = [], []
    for batch in token_batches(STEPS, BATCH, seq=SEQ):
        before = engine.comm.p2p_bytes
        losses.append(engine.train_batch(iter(micro_batches(batch, padded))))
        p2p.append(engine.comm.p2p_bytes - before)
    evaluated = engine.eval_batch(iter(micro_batches(token_batches(1, BATCH, seq=SEQ, seed=7)[0], padded)))
    if (name, mode, schedule, stage, checkpointing, padded) == SAVED_CASE:
        engine.save_checkpoint(save_dir)
    return losses, p2p, evaluated, engine.full_state_dict()


def _refused(what: str):
    model = hf_llama()
    try:
        initialize(model, config("ulysses", "1f1b", 0, False), loss_fn=lambda out, labels: out.logits.mean())
    except ValueError as e:
        return str(e)
    return ""


def _worker(rank, world, cases, save_dir):
    kinds = {"train": lambda *case: _train(*case, save_dir=save_dir), "refused": _refused}
    return run_cases(rank, cases, lambda kind, *args: kinds[kind](*args))


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pp2_sp2_checkpoint"))


@pytest.fixture(scope="module")
def four_ranks(save_dir) -> dict:
    """{case: [each rank's result]}: every case in one spawned group of pp 2 × sp 2."""
    cases = [("train", *case) for case in TRAINING_CASES] + [("refused", "loss_fn")]
    return results_by_case(run_distributed(_worker, 4, args=(cases, save_dir), timeout_s=300))


def reference(name: str, padded: bool):
    model = MODELS[name]()
    losses, _ = train_reference(model, token_batches(STEPS, BATCH, seq=SEQ), adamw, clip=1.0,
                                loss_fn=lambda m, x: m(input_ids=x, labels=labels_of(x, padded)).loss)
    x = token_batches(1, BATCH, seq=SEQ, seed=7)[0]
    with torch.no_grad():  # eval_batch's loss: the mean of its micro-batches'
        evaluated = sum(model(input_ids=mb["input_ids"], labels=mb["labels"]).loss.item()
                        for mb in micro_batches(x, padded)) / MICRO_BATCHES
    return losses, evaluated, param_snapshot(model)


@pytest.mark.parametrize("case", TRAINING_CASES, ids=lambda c: "-".join(map(str, c)))
def test_pp2_by_sp2_trains_as_one_process_on_the_whole_sequences(four_ranks, case):
    name, mode, _schedule, _stage, _checkpointing, padded = case
    ref_losses, ref_eval, ref_params = reference(name, padded)
    # ring attention merges blockwise partial results (another summation order than one SDPA call), which Adam's
    # normalization magnifies in small parameters (Llama: 1 of 2048 elements of a v_proj 1.1e-6 off, over the 1e-6
    # floor): its parameters are held to 1e-4 as without a pipeline (tests/test_sequence_parallel); losses to 1e-5
    params_rtol = 1e-4 if mode == "ring" else FP32_RTOL
    for rank, (losses, p2p, evaluated, full) in enumerate(four_ranks[("train", *case)]):
        try:
            assert_close_relative(losses, ref_losses)
            assert_close_relative([evaluated], [ref_eval])
            assert_params_close({n: full[n] for n in ref_params}, ref_params, rtol=params_rtol)
        except AssertionError as e:
            raise AssertionError(f"case {case}, rank {rank}: {e}") from e
        if mode == "ulysses":  # all-to-alls only: the pipeline's messages are all the point-to-point bytes
            # per micro-batch, stage 0 sends this rank's half of the hidden state forward, stage 1 its gradient back
            half = BATCH // MICRO_BATCHES * SEQ // 2 * WIDTH * 4
            assert p2p == [MICRO_BATCHES * (half + HEADER_SIZE * 8)] * STEPS, (case, rank, p2p)


def test_a_loss_fn_under_sequence_parallelism_is_refused_naming_the_fix(four_ranks):
    for message in four_ranks[("refused", "loss_fn")]:
        assert "initialize(loss_fn=...) under sequence_parallel" in message, message
        assert "pass the labels in the micro-batch" in message, message


def test_a_checkpoint_saved_at_pp2_by_sp2_resumes_in_one_process(four_ranks, save_dir):
    """SAVED_CASE's stages' and sequence ranks' shards (parameters and Adam states) load into one process, whose next
    step equals the uninterrupted reference's."""
    assert four_ranks[("train", *SAVED_CASE)]  # (its run saved the checkpoint)
    model = hf_llama()
    batches = token_batches(STEPS + 1, BATCH, seq=SEQ)
    ref_losses, _ = train_reference(model, batches, adamw, clip=1.0,
                                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "gradient_clipping": 1.0, "steps_per_print": 10**6, "zero_optimization": {"stage": 1}}
    engine = initialize(hf_llama(seed=1), cfg)
    engine.load_checkpoint(save_dir)
    loss = engine(input_ids=batches[-1], labels=batches[-1]).loss
    engine.backward(loss)
    engine.step()
    assert_close_relative([loss.item()], ref_losses[-1:])
    assert_params_close(trained_params(engine), param_snapshot(model))
