"""Stage 0 data parallelism over chunks equals single-process PyTorch on the same global batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from engine import initialize
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

STEPS = 4
GLOBAL_BATCH = 8


# eps 1e-6, not 1e-8: attention key biases have an exactly-zero true gradient (softmax is
# shift-invariant), so theirs is rounding noise (~1e-11) that Adam with a tiny eps would turn into
# full-size updates of random sign; any change of summation order would then move them apart.
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}


def adamw(params):
    return torch.optim.AdamW(params, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                             weight_decay=ADAMW["weight_decay"])


def dp_config(micro: int, accumulation: int, clip: float = 1.0, chunk_size: int = 20_000) -> dict:
    # a small chunk size so the tiny model spans several chunks and the ordering logic is exercised
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 0, "chunk_size": chunk_size},
        "steps_per_print": 10**6,
    }


def _dp_worker(rank, world, accumulation, chunk_size, overlap=True):
    micro = GLOBAL_BATCH // world // accumulation
    cfg = dp_config(micro, accumulation, chunk_size=chunk_size)
    cfg["zero_optimization"]["overlap_comm"] = overlap
    # each rank builds a differently initialized model: the engine must start all from rank 0's
    engine = initialize(tiny_gpt(seed=rank), cfg)
    assert len(engine.chunked.grad_payloads()) > 1 or chunk_size > 10**6
    losses, norms = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), engine.dp_rank,
                                 engine.dp_world_size, accumulation)  # Note [data-parallel coordinates]
    result = losses, norms, param_snapshot(engine.module), engine.comm.all_reduce_bytes
    engine.close()
    return result


@pytest.fixture(scope="module")
def reference():
    model = tiny_gpt()
    losses, norms = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, norms, param_snapshot(model)


@pytest.mark.parametrize("world,accumulation,overlap", [(2, 1, True), (2, 2, True), (4, 1, True), (2, 1, False)])
def test_data_parallel_matches_single_process(reference, two_ranks, world, accumulation, overlap):
    ref_losses, ref_norms, ref_params = reference
    # the world-2 cases ran in the module's shared group; pytest's case id names the failing one
    results = (two_ranks[("dp", accumulation, overlap)] if world == 2
               else run_distributed(_dp_worker, world, args=(accumulation, 20_000, overlap)))
    mean_losses = [sum(r[0][i] for r in results) / world for i in range(STEPS)]
    assert_close_relative(mean_losses, ref_losses)
    assert_close_relative(results[0][1], ref_norms)  # global grad norm before clipping
    for r in results:
        assert_params_close(r[2], ref_params)
    n = sum(p.numel() for p in ref_params.values())  # named_parameters lists the tied lm_head once
    assert results[0][3] == STEPS * n * 4  # one all-reduce of every gradient byte per step


def test_accumulation_equals_larger_micro_batch():
    """micro 2 × accumulation 2 gives the same training as micro 4 × accumulation 1 (plain SGD, no clipping:
    an update proportional to the gradient, so a wrong accumulation scale would show)."""
    runs = []
    for micro, accumulation in [(2, 2), (4, 1)]:
        cfg = {**dp_config(micro, accumulation, clip=0.0), "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
        engine = initialize(tiny_gpt(), cfg)
        runs.append((train_engine(engine, token_batches(STEPS, 4), 0, 1, accumulation)[0],
                     param_snapshot(engine.module)))
    assert_close_relative(runs[0][0], runs[1][0])
    assert_params_close(runs[0][1], runs[1][1])


def test_single_process_matches_reference(reference):
    engine = initialize(tiny_gpt(), dp_config(GLOBAL_BATCH, 1))
    losses, norms = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), 0, 1, 1)
    assert_close_relative(losses, reference[0])
    assert_close_relative(norms, reference[1])
    assert_params_close(param_snapshot(engine.module), reference[2])


class PartlyUsed(nn.Module):
    """A branch that is used only on even steps: its chunk must still be reduced, in the same order on every rank."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.unused_sometimes = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.a(x))
        if use_branch:
            h = h + self.unused_sometimes(h)
        return self.b(h).pow(2).mean()


def _partly_used_worker(rank, world, stage):
    torch.manual_seed(0)
    model = PartlyUsed()
    engine = initialize(model, {"train_micro_batch_size_per_gpu": 4,
                                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                "gradient_clipping": 10.0, "zero_optimization": {"stage": stage, "chunk_size": 80},
                                "steps_per_print": 10**6})
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(8, 8, generator=g)[rank * 4:(rank + 1) * 4]
        engine.module.zero_grad(set_to_none=True)  # user code dropping .grad: the chunks must adopt the new ones
        engine.backward(engine(x, use_branch=(rank + step) % 2 == 0))
        engine.step()
    params = param_snapshot(engine.module)
    engine.close()
    return params


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unused_parameters_neither_hang_nor_diverge(two_ranks, stage):
    """The branch runs on one rank and not the other, so ranks complete chunks in different orders."""
    torch.manual_seed(0)
    model = PartlyUsed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(8, 8, generator=g)
        # the mean over both ranks' halves of the batch: average of the two half-batch losses
        loss = (model(x[:4], step % 2 == 0) + model(x[4:], (step + 1) % 2 == 0)) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # the engine keeps zeroed gradients, never None
    results = two_ranks[("partly_used", stage)]
    for r in results:
        assert_params_close(r, param_snapshot(model))


def _no_sync_worker(rank, world):
    engine = initialize(tiny_gpt(), dp_config(2, 1))
    batch = token_batches(1, 8)[0]
    rows = batch[rank * 4:(rank + 1) * 4]
    with engine.no_sync():
        loss = engine(rows[:2], rows[:2])
        engine.backward(loss)
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.step()
        local_grad = engine.module.wte.weight.grad.clone()
    engine.backward(engine(rows[2:], rows[2:]))
    engine.step()
    result = param_snapshot(engine.module), local_grad, engine.comm.all_reduce_bytes
    engine.close()
    return result


def test_no_sync_accumulates_locally_then_reduces_once(two_ranks):
    model = tiny_gpt()
    batch = token_batches(1, 8)[0]
    # two half-micro-batches per rank, summed (no_sync accumulation has no 1/accumulation factor)
    loss = sum(model(batch[i:i + 2], batch[i:i + 2]) for i in range(0, 8, 2)) / 2
    opt = adamw(model.parameters())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    results = two_ranks[("no_sync",)]
    assert not torch.equal(results[0][1], results[1][1])  # inside no_sync, ranks hold different gradients
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    for params, _, reduced_bytes in results:
        assert_params_close(params, param_snapshot(model))
        assert reduced_bytes == grad_bytes  # one all-reduce of the gradients, not two


def test_user_optimizer_and_scheduler_objects():
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = initialize(model, {"train_batch_size": 4, "steps_per_print": 10**6}, optimizer=opt, lr_scheduler=sched)
    assert engine.optimizer is opt and engine.lr_scheduler is sched
    ref = tiny_gpt()
    ref_losses, _ = train_reference(ref, token_batches(3, 4), lambda ps: _sgd_with_halving(ps))
    losses, _ = train_engine(engine, token_batches(3, 4), 0, 1, 1)
    assert_close_relative(losses, ref_losses)
    assert_params_close(param_snapshot(engine.module), param_snapshot(ref))
    assert engine.get_lr() == [0.05 * 0.5**3]


class _SGDHalving(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        for g in self.param_groups:
            g["lr"] *= 0.5


def _sgd_with_halving(params):
    return _SGDHalving(params, lr=0.05, momentum=0.9)


def test_user_zero_grad_set_to_none_is_adopted():
    """A user who sets .grad to None before a backward still trains correctly (the chunk adopts the new grad)."""
    engine = initialize(tiny_gpt(), dp_config(4, 1, clip=0.0))
    ref = tiny_gpt()
    opt = adamw(ref.parameters())
    for x in token_batches(2, 4):
        engine.module.zero_grad(set_to_none=True)
        engine.backward(engine(x, x))
        engine.step()
        ref(x, x).backward()
        opt.step()
        opt.zero_grad()
    assert_params_close(param_snapshot(engine.module), param_snapshot(ref))


def _boundary_inside_no_sync_worker(rank, world):
    """Accumulation 2 with both backward calls inside no_sync(): step() must still reduce."""
    engine = initialize(tiny_gpt(), {**dp_config(2, 2), "gradient_clipping": 0.0})
    rows = token_batches(1, 8)[0][rank * 4:(rank + 1) * 4]
    for micro in (rows[:2], rows[2:]):
        with engine.no_sync():
            engine.backward(engine(micro, micro))
        engine.step()
    params = param_snapshot(engine.module)
    engine.close()
    return params


def test_step_reduces_when_the_boundary_backward_was_inside_no_sync(two_ranks):
    model = tiny_gpt()
    batch = token_batches(1, 8)[0]
    opt = adamw(model.parameters())
    model(batch, batch).backward()
    opt.step()
    results = two_ranks[("boundary_inside_no_sync",)]
    for params in results:
        assert_params_close(params, param_snapshot(model))


SECOND_BACKWARD_STAGES = [(0, True), (1, True), (1, False)]  # (stage, reduce_scatter)


def _second_backward_worker(rank, world):
    """Two backward passes before one step (DeepSpeed's GAN does this), at stages 0 and 1 (with and without
    reduce-scatter), with SGD (any sum counted once per rank would show): both synchronized, or the second one
    local (inside no_sync)."""
    results = []
    for stage, reduce_scatter in SECOND_BACKWARD_STAGES:
        for second_local in (False, True):
            cfg = {**dp_config(4, 1, clip=0.0), "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
            cfg["zero_optimization"] = {"stage": stage, "chunk_size": 20_000, "reduce_scatter": reduce_scatter}
            engine = initialize(tiny_gpt(), cfg)
            rows = token_batches(1, 8)[0][rank * 4:(rank + 1) * 4]
            for _ in range(2):
                engine.backward(engine(rows[:2], rows[:2]))
                with engine.no_sync() if second_local else contextlib.nullcontext():
                    engine.backward(engine(rows[2:], rows[2:]))
                engine.step()
            results.append(trained_params(engine))
            engine.close()
    return results


def _failed_backward_worker(rank, world):
    """A synchronized backward that fails once some chunks were reduced: step() is refused until zero_grad(), then
    training goes on as if the batch had not been."""
    engine = initialize(tiny_gpt(), {**dp_config(4, 1, clip=0.0), "optimizer": {"type": "SGD", "params": {"lr": 0.5}}})
    rows = token_batches(1, 8)[0][rank * 4:(rank + 1) * 4]
    handle = engine.module.wte.weight.register_hook(_raise)  # the first parameter: its gradient comes last
    with pytest.raises(RuntimeError, match="injected"):
        engine.backward(engine(rows, rows))
    handle.remove()
    with pytest.raises(RuntimeError, match=r"call engine.zero_grad\(\) to drop this step's gradients"):
        engine.step()
    engine.zero_grad()
    engine.backward(engine(rows, rows))
    engine.step()
    return trained_params(engine)


def _raise(grad):
    raise RuntimeError("injected backward failure")


def test_several_synchronized_backward_passes_before_a_step_add_up(two_ranks):
    """Note [several synchronized backward passes]: rank r's two losses are means over two rows each, so the step's
    gradient is that of twice the mean over all eight rows."""
    model = tiny_gpt()
    batch = token_batches(1, 8)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        (2 * model(batch, batch)).backward()
        opt.step()
        opt.zero_grad()
    for rank_results in two_ranks[("second_backward",)]:
        for params in rank_results:
            assert_params_close(params, param_snapshot(model))


def test_a_step_after_a_partly_reduced_failed_backward_is_refused_until_zero_grad(two_ranks):
    model = tiny_gpt()
    batch = token_batches(1, 8)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(batch, batch).backward()
    opt.step()
    for params in two_ranks[("failed_backward",)]:
        assert_params_close(params, param_snapshot(model))


class SharedAcrossCheckpoint(nn.Module):
    """`shared` is used inside a reentrant checkpoint and outside it: its gradient arrives twice."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.other = nn.Linear(4, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.shared, x, use_reentrant=True)
        return self.other(self.shared(torch.tanh(h))).pow(2).mean()


def _reentrant_worker(rank, world):
    torch.manual_seed(0)
    engine = initialize(SharedAcrossCheckpoint(), {"train_batch_size": 4, "optimizer": {"type": "SGD"},
                                                   "steps_per_print": 10**6})
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"'shared\.(weight|bias)'.*use_reentrant=False"):
        engine.backward(engine(x))
    return True


def test_gradient_arriving_twice_in_one_backward_is_an_error_naming_the_parameter(two_ranks):
    assert two_ranks[("reentrant",)] == [True, True]


def test_model_converted_after_initialize_is_an_error():
    engine = initialize(tiny_gpt(), dp_config(4, 1))
    engine.module.double()
    x = token_batches(1, 4)[0]
    engine.backward(engine(x, x))
    with pytest.raises(RuntimeError, match="no longer lives in its chunk.*before initialize"):
        engine.step()


def decay_groups(model: nn.Module) -> list[dict]:
    """The usual split: weight decay on matrices, none on biases and norms (chunks of the two interleave)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _param_groups_worker(rank, world):
    model = tiny_gpt()
    cfg = dp_config(GLOBAL_BATCH // world, 1, chunk_size=12_000)
    engine = initialize(model, cfg, model_parameters=decay_groups(model))
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, 1)
    result = (losses, param_snapshot(engine.module), engine.reducer.grads_before_first_launch,
              len(engine.chunked.params), engine.reducer.launched_during_backward, len(engine.reducer.sequence))
    engine.close()
    return result


def test_param_groups_train_correctly_and_overlap_backward(two_ranks):
    model = tiny_gpt()
    opt = torch.optim.AdamW(decay_groups(model), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"])
    ref_losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    results = two_ranks[("param_groups",)]
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params, grads_first, n_params, during, chunks in results:
        assert_params_close(params, param_snapshot(model))
        # Note [reduction order]: with two groups the reductions still start early in backward
        assert chunks >= 6 and during >= chunks - 2, (during, chunks)
        assert grads_first <= n_params // 2, f"first reduction only after {grads_first} of {n_params} gradients"


def _two_rank_case(rank, world, name):
    """Runs one named two-rank case of this file; each builds its own engine."""
    kind, *args = name
    workers = {"dp": lambda accumulation, overlap: _dp_worker(rank, world, accumulation, 20_000, overlap),
               "partly_used": lambda stage: _partly_used_worker(rank, world, stage),
               "no_sync": lambda: _no_sync_worker(rank, world),
               "boundary_inside_no_sync": lambda: _boundary_inside_no_sync_worker(rank, world),
               "param_groups": lambda: _param_groups_worker(rank, world),
               "second_backward": lambda: _second_backward_worker(rank, world),
               "failed_backward": lambda: _failed_backward_worker(rank, world),
               "reentrant": lambda: _reentrant_worker(rank, world)}
    return workers[kind](*args)


def _two_rank_cases_worker(rank, world, names):
    """Every two-rank case in one spawned group (a spawn costs seconds), in order. The global RNG restarts from a
    fresh process's seed before each case; the refused backward calls come last, after every training case."""
    fresh_seed = torch.initial_seed()
    results = []
    for name in names:
        torch.manual_seed(fresh_seed)
        try:
            results.append(_two_rank_case(rank, world, name))
        except Exception as e:
            raise RuntimeError(f"case {name} failed on rank {rank}") from e
    return results


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """{case name: [rank 0's result, rank 1's result]} for every two-rank case of this file."""
    names = [("dp", 1, True), ("dp", 2, True), ("dp", 1, False), ("partly_used", 0), ("partly_used", 1),
             ("partly_used", 2), ("no_sync",), ("boundary_inside_no_sync",), ("param_groups",),
             ("second_backward",), ("failed_backward",), ("reentrant",)]
    per_rank = run_distributed(_two_rank_cases_worker, 2, args=(names,), timeout_s=600)
    return {name: [results[i] for results in per_rank] for i, name in enumerate(names)}
