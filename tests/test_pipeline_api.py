"""train_batch / eval_batch as users call them (Note [a pipelined step]): a user model that computes its loss inside
forward from its input, DeepSpeed's (inputs, labels) micro-batches with a loss_fn, evaluation, the bubble in
TensorBoard, fp16 overflow agreed across stages, and the errors for calls and configs that cannot work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from engine import initialize
from engine.config import ConfigError, load_config
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, param_snapshot, token_batches
from tests.test_data_parallel import adamw
from tests.test_pipeline_engine import example_gpt, pipeline_config

VOCAB, WIDTH, STEPS, M = 64, 32, 3, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class UserLM(nn.Module):
    """Loss inside forward, from its own input (next-token prediction over `ids`); logits without one."""

    def __init__(self, with_loss: bool = True):
        super().__init__()
        self.embed, self.layers, self.head = nn.Embedding(VOCAB, WIDTH), nn.ModuleList(Block() for _ in range(4)), \
            nn.Linear(WIDTH, VOCAB)
        self.with_loss = with_loss

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return next_token_loss(logits, ids) if self.with_loss else logits


def next_token_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def user_lm(with_loss: bool = True) -> UserLM:
    torch.manual_seed(0)
    return UserLM(with_loss)


def batches():
    return token_batches(STEPS, 8, seq=16, vocab=VOCAB)


def _user_worker(rank, world, style):
    cfg = pipeline_config(2, "1f1b", 1, M)
    if style == "loss_in_forward":  # one tensor per micro-batch; the model's own loss
        engine = initialize(user_lm(), cfg)
        feed = lambda x: list(x.chunk(M))  # noqa: E731
    else:  # DeepSpeed's pipeline convention: (inputs, labels), loss_fn(outputs, labels)
        engine = initialize(user_lm(with_loss=False), cfg, loss_fn=next_token_loss)
        feed = lambda x: [(mb, mb) for mb in x.chunk(M)]  # noqa: E731
    losses = [engine.train_batch(iter(feed(x))) for x in batches()]
    evaluated = engine.eval_batch(iter(feed(batches()[0])))
    names = engine.pipeline.split.names
    params = {names[id(p)]: p.detach().clone() for p in engine.module.parameters()}
    engine.close()
    return losses, evaluated, params


@pytest.mark.parametrize("style", ["loss_in_forward", "loss_fn"])
def test_a_user_model_trains_and_evaluates_as_in_one_process(two_ranks, style):
    model = user_lm()
    optimizer = adamw(list(model.parameters()))
    ref_losses = []
    for x in batches():
        loss = model(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    with torch.no_grad():
        ref_eval = sum(model(mb).item() for mb in batches()[0].chunk(M)) / M
    results = two_ranks[("user", style)]
    held = {}
    for losses, evaluated, params in results:
        assert_close_relative(losses, ref_losses)
        assert_close_relative([evaluated], [ref_eval])
        held.update(params)
    assert_params_close(held, param_snapshot(model))


def _telemetry_worker(rank, world, log_dir):
    cfg = pipeline_config(2, "gpipe", 1, M, tensorboard={"enabled": True, "output_path": log_dir, "job_name": "pp"})
    engine = initialize(example_gpt(), cfg)
    sent = []
    for x in token_batches(2, 8):
        before = engine.comm.p2p_bytes
        engine.train_batch(iter([{"input_ids": mb, "labels": mb} for mb in x.chunk(M)]))
        sent.append(engine.comm.p2p_bytes - before)
    engine.close()
    return engine.pipeline.formula_bubble, sent


def test_the_bubble_goes_to_tensorboard_next_to_the_formula(two_ranks, two_ranks_log_dir):
    (formula, sent), (_, sent_back) = two_ranks[("telemetry",)]
    tmp_path = two_ranks_log_dir
    assert formula == pytest.approx((2 - 1) / (M + 2 - 1))
    # each micro-batch's hidden state [2, 32, 64] fp32 goes forward and its gradient back, each with a 64-byte header
    assert sent == sent_back == [M * (2 * 32 * 64 * 4 + 64)] * 2
    events = EventAccumulator(str(tmp_path / "pp"))
    events.Reload()
    measured = [e.value for e in events.Scalars("Pipeline/bubble_fraction")]
    assert len(measured) == 2 and all(0.0 < b < 1.0 for b in measured)
    assert [e.value for e in events.Scalars("Pipeline/bubble_fraction_formula")] == pytest.approx([formula] * 2)
    assert len(events.Scalars("Train/loss")) == 2


def _overflow_worker(rank, world):
    cfg = pipeline_config(2, "1f1b", 1, M, fp16={"enabled": True, "initial_scale_power": 100})
    engine = initialize(example_gpt(), cfg)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    x = token_batches(1, 8)[0]
    engine.train_batch(iter([{"input_ids": mb, "labels": mb} for mb in x.chunk(M)]))
    unchanged = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    result = engine.skipped_steps, engine.get_loss_scale(), unchanged
    engine.close()
    return result


def test_an_fp16_overflow_skips_the_step_on_every_stage(two_ranks):
    """A 2^100 loss scale overflows fp16; the global norm over the stages is inf on both, so both skip the update
    (the scale stays for one more overflow: DeepSpeed's hysteresis of 2)."""
    results = two_ranks[("overflow",)]
    assert results[0] == results[1] == (1, 2.0 ** 100, True)


def _errors_worker(rank, world):
    errors = {}
    engine = initialize(example_gpt(), pipeline_config(2, "1f1b", 1, M))
    x = token_batches(1, 8)[0]
    for call in (lambda: engine(x, x), lambda: engine.backward(torch.zeros(())), engine.step):
        try:
            call()
        except RuntimeError as e:
            errors.setdefault("per_micro_batch", []).append(str(e))
    try:
        engine.train_batch(iter([{"input_ids": x, "labels": x}] * (M - 1)))
    except ValueError as e:
        errors["ran_out"] = str(e)
    try:
        initialize(example_gpt(), pipeline_config(2, "1f1b", 1, M, pipeline={"stages": 2, "virtual_stages": 1,
                                                                               "schedule": "interleaved"}))
    except ConfigError as e:
        errors["interleaved_v1"] = str(e)
    try:
        initialize(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), pipeline_config(2, "1f1b", 1, M))
    except ValueError as e:
        errors["no_blocks"] = str(e)
    try:
        initialize(example_gpt(), pipeline_config(2, "interleaved", 1, M, v=4))  # 8 stages, 4 blocks
    except ValueError as e:
        errors["too_many_stages"] = str(e)
    return errors


def test_calls_and_configs_that_cannot_work_say_why(two_ranks):
    errors = two_ranks[("errors",)][0]
    assert len(errors["per_micro_batch"]) == 3
    assert all("engine.train_batch(data_iter)" in e for e in errors["per_micro_batch"])
    assert "ran out after 3 of the step's 4 micro-batches" in errors["ran_out"]
    assert "virtual_stages to 2 or more" in errors["interleaved_v1"]
    assert "no nn.ModuleList of same-class blocks" in errors["no_blocks"]
    assert "8 pipeline stages need at least 8 blocks, and the model has 4" in errors["too_many_stages"]


def test_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="only schedule \"interleaved\" runs several stages per rank"):
        load_config({"pipeline": {"stages": 2, "virtual_stages": 2}})
    with pytest.raises(ConfigError, match="pipeline.partition"):
        load_config({"pipeline": {"stages": 2, "partition": "balanced"}})
    with pytest.raises(ConfigError, match="pipeline.schedule"):
        load_config({"pipeline": {"stages": 2, "schedule": "dualpipe"}})
    with pytest.raises(ConfigError, match="2D tensor parallelism inside a pipeline stage is not built yet"):
        load_config({"pipeline": {"stages": 2}, "tensor_parallel": {"size": 4, "mode": "2d"}})
    with pytest.raises(ValueError, match="initialize\\(loss_fn=...\\) is the loss train_batch uses"):
        initialize(example_gpt(), {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}},
                   loss_fn=F.cross_entropy)
    with pytest.raises(ValueError, match="pipeline.stages 2 needs 2 processes"):
        initialize(example_gpt(), pipeline_config(2, "1f1b", 1, M))
    with pytest.raises(ValueError, match="loss_fn=...\\) under sequence_parallel would take this rank's part"):
        initialize(example_gpt(), {**pipeline_config(2, "1f1b", 1, M), "sequence_parallel": {"size": 2}},
                   loss_fn=F.cross_entropy)  # refused before any process group is needed
    engine = initialize(example_gpt(), {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})
    with pytest.raises(RuntimeError, match="engine.train_batch runs a step.s micro-batches through a schedule"):
        engine.train_batch(iter([]))


def _time_partition_worker(rank, world):
    engine = initialize(example_gpt(), pipeline_config(2, "1f1b", 1, M, pipeline={"stages": 2, "partition": "time"}))
    plan = engine.pipeline.split.plan
    losses = [engine.train_batch(iter([{"input_ids": mb, "labels": mb} for mb in x.chunk(M)]))
              for x in token_batches(2, 8)]
    engine.close()
    return plan.starts, losses


def test_a_partition_by_measured_time_cuts_every_rank_at_the_same_block_and_trains(two_ranks):
    (starts, losses), (other_starts, other_losses) = two_ranks[("time_partition",)]
    assert starts == other_starts and starts[0] == 0 and 0 < starts[1] < 4
    assert losses == other_losses and losses[1] < losses[0]


def varying_length_steps() -> list[list[torch.Tensor]]:
    """Two steps of M micro-batches whose sequence lengths differ within and between steps."""
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 256, (2, 8 + 4 * ((j + step) % 3)), generator=g) for j in range(M)] for step in range(2)]


def _varying_length_worker(rank, world):
    engine = initialize(example_gpt(), pipeline_config(2, "zero_bubble", 1, M))
    losses = [engine.train_batch(iter([{"input_ids": x, "labels": x} for x in step]))
              for step in varying_length_steps()]
    names = engine.pipeline.split.names
    params = {names[id(p)]: p.detach().clone() for p in engine.module.parameters()}
    engine.close()
    return losses, params


def test_micro_batches_of_different_sequence_lengths(two_ranks):
    """Each message's shape travels in its header, so stages take whatever length each micro-batch has."""
    model = example_gpt()
    optimizer = adamw(list(model.parameters()))
    ref_losses = []
    for step in varying_length_steps():
        total = 0.0
        for x in step:
            loss = model(x, x)
            (loss / M).backward()
            total += loss.item() / M
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(total)
    held = {}
    for losses, params in two_ranks[("varying_length",)]:
        assert_close_relative(losses, ref_losses)
        held.update(params)
    assert_params_close(held, param_snapshot(model))


# --- every two-rank case above in one spawned group: start-up, not the cases, dominates their time ------------

TWO_RANK_CASES = [("user", "loss_in_forward"), ("user", "loss_fn"), ("telemetry",), ("overflow",),
                  ("time_partition",), ("varying_length",), ("errors",)]  # last: it ends with refused calls


def _two_rank_cases_worker(rank, world, log_dir):
    workers = {"user": _user_worker, "telemetry": lambda r, w: _telemetry_worker(r, w, log_dir),
               "overflow": _overflow_worker, "time_partition": _time_partition_worker,
               "varying_length": _varying_length_worker, "errors": _errors_worker}
    return run_cases(rank, TWO_RANK_CASES, lambda kind, *args: workers[kind](rank, world, *args))


@pytest.fixture(scope="module")
def two_ranks_log_dir(tmp_path_factory):
    """The telemetry case's TensorBoard folder."""
    return tmp_path_factory.mktemp("pipeline_api_tensorboard")


@pytest.fixture(scope="module")
def two_ranks(two_ranks_log_dir) -> dict[tuple, list]:
    """Each two-rank case's results in rank order, keyed by the case."""
    per_rank = run_distributed(_two_rank_cases_worker, 2, args=(str(two_ranks_log_dir),), timeout_s=600)
    return results_by_case(per_rank)
