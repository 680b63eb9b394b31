"""ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules): an MoE block whose ranks run different experts
gathers the same chunks on every rank when it is a leaf, and trains as plain PyTorch; without the mark the
ranks' gather orders differ (the hang DeepSpeed's leaf modules exist for)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine import initialize
from engine.compat import deepspeed
from engine.zero.training_phase import TrainingPhase
from tests.distributed import run_distributed
from tests.reference import assert_close_relative, assert_params_close, param_snapshot, trained_params
from tests.test_data_parallel import adamw
from tests.test_zero import zero_config

DIM, HIDDEN, EXPERTS, MICRO, STEPS = 8, 16, 3, 4, 4
# 300 elements: the input layer, the router and the first expert share chunk 0, and chunks straddle experts
CHUNK = 300


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, h):
        return self.fc2(torch.tanh(self.fc1(h)))


class TopOneMoE(nn.Module):
    """Each token runs only the expert its router scores highest: which experts run depends on the data."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.ran: list[int] = []  # the experts the last forward ran

    def forward(self, h):
        probs = torch.softmax(self.router(h), dim=-1)
        choice = probs.argmax(dim=-1)
        out = torch.zeros_like(h)
        self.ran = []
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                self.ran.append(e)
                out = out.index_add(0, rows, expert(h[rows]) * probs[rows, e:e + 1])
        return h + out


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.moe, self.head = nn.Linear(DIM, DIM), TopOneMoE(), nn.Linear(DIM, 1)
        with torch.no_grad():  # routing by features 0 and 1, by wide margins (it stays put while training)
            self.inp.weight.copy_(torch.eye(DIM) + 0.01 * self.inp.weight)
            self.moe.router.weight.zero_()
            self.moe.router.weight[0, 0], self.moe.router.weight[1, 0], self.moe.router.weight[2, 1] = 4, -4, 4
            self.moe.router.bias.zero_()

    def forward(self, x, y):
        return F.mse_loss(self.head(self.moe(self.inp(x))).squeeze(-1), y)


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's tokens go to expert 0; rank 1's to experts 1 and 2."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = 0.3 * torch.randn(MICRO, DIM, generator=g)
    if rank == 0:
        x[:, 0] += 2
    else:
        x[:, 0] -= 2
        x[:, 1] += torch.tensor([6.0, -6.0, 6.0, -6.0])
    return x, torch.randn(MICRO, generator=g)


def _reference():
    """Plain PyTorch on both ranks' tokens; experts no token ran get zero gradients, as the engine steps them."""
    model = MoENet()
    opt = adamw(list(model.parameters()))
    losses = []
    for step in range(STEPS):
        batches = [rank_batch(step, r) for r in range(2)]
        loss = model(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, param_snapshot(model)


def _traces(engine) -> dict[str, list[int]]:
    passes = (TrainingPhase.FORWARD, TrainingPhase.BACKWARD)
    return {phase.value: engine.gatherer.traces[phase].recorded for phase in passes}


def _leaf_worker(rank, world):
    model = MoENet()
    marked = deepspeed.utils.set_z3_leaf_modules(model, [TopOneMoE])
    assert marked == [model.moe]
    engine = initialize(model, zero_config(3, MICRO, 1, chunk_size=CHUNK))
    hooked_inside = [n for n, m in model.moe.named_modules() if n and (m._forward_pre_hooks or m._forward_hooks)]
    gatherer = engine.gatherer
    leaf_only = [c for c, state in enumerate(gatherer.states) if state.owners == {model.moe}]
    released_after_leaf = []  # in the input layer's backward, which runs once the leaf's has finished
    model.inp.weight.register_hook(
        lambda grad: released_after_leaf.append(all(gatherer.shards.is_released(c) for c in leaf_only)))
    losses, ran = [], []
    for step in range(STEPS):
        loss = engine(*rank_batch(step, rank))
        ran.append(list(model.moe.ran))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    mean_losses = torch.tensor(losses)
    dist.all_reduce(mean_losses)  # each rank's loss is its own tokens' mean; the reference's is both ranks'
    return (mean_losses / world).tolist(), trained_params(engine), ran, _traces(engine), hooked_inside, \
        gatherer.prefetched, (len(leaf_only), released_after_leaf)


def test_an_moe_leaf_runs_different_experts_per_rank_and_trains_as_plain_pytorch():
    ref_losses, ref_params = _reference()
    results = run_distributed(_leaf_worker, 2)
    (losses0, params0, ran0, traces0, hooked0, prefetched0, released0), (losses1, params1, ran1, traces1, *_) = results
    assert ran0 == [[0]] * STEPS and ran1 == [[1, 2]] * STEPS  # the ranks ran disjoint experts every step
    assert traces0 == traces1  # ... and gathered the same chunks in the same order
    assert hooked0 == []  # no gather hooks inside the leaf
    assert prefetched0 > 0  # later passes gathered ahead along the (shared) trace
    assert released0 == (2, [True] * STEPS)  # the chunks only the leaf owns are freed once its backward is done
    assert_close_relative(losses0, ref_losses)
    assert losses0 == losses1
    assert_params_close(params0, ref_params)
    assert_params_close(params1, ref_params)


def _one_rank_traces(rank: int, leaf: bool) -> dict[str, list[int]]:
    """One process running rank `rank`'s tokens: the chunks, in order, that rank would gather. Its parameters
    are offloaded so that one process runs the same gatherer, paging chunks in (Note [paging in one process])."""
    model = MoENet()
    if leaf:
        deepspeed.utils.set_z3_leaf_modules(model, ["TopOneMoE"])
    offload = {"device": "cpu", "pin_memory": False}
    engine = initialize(model, zero_config(3, MICRO, 1, chunk_size=CHUNK, offload_param=offload,
                                           offload_optimizer=offload))
    engine.backward(engine(*rank_batch(0, rank)))
    return _traces(engine)


def test_without_the_leaf_mark_the_ranks_would_gather_different_chunks():
    """Per-expert hooks gather what each rank's routing ran: two ranks issue different all-gathers (a hang or
    wrong parameters); as a leaf the MoE block gathers the same chunks for every routing."""
    unmarked = [_one_rank_traces(rank, leaf=False) for rank in range(2)]
    assert unmarked[0]["forward"] != unmarked[1]["forward"]
    assert unmarked[0]["backward"] != unmarked[1]["backward"]
    marked = [_one_rank_traces(rank, leaf=True) for rank in range(2)]
    assert marked[0] == marked[1]


def test_leaf_marks_follow_deepspeed():
    model = MoENet()
    assert deepspeed.utils.get_z3_leaf_modules(model) == []
    assert deepspeed.utils.set_z3_leaf_modules(model, [TopOneMoE]) == [model.moe]
    assert deepspeed.utils.z3_leaf_module(model.moe) and not deepspeed.utils.z3_leaf_module(model.inp)
    assert deepspeed.utils.z3_leaf_parameter(model.moe.experts[1].fc1.weight)
    assert not deepspeed.utils.z3_leaf_parameter(model.inp.weight)
    assert deepspeed.utils.get_z3_leaf_modules(model) == [model.moe]
    assert deepspeed.utils.unset_z3_leaf_modules(model, [TopOneMoE]) == [model.moe]
    assert deepspeed.utils.get_z3_leaf_modules(model) == []
    assert not deepspeed.utils.z3_leaf_parameter(model.moe.router.weight)
    with pytest.raises(ValueError, match="no module of the classes"):
        deepspeed.utils.set_z3_leaf_modules(model, [nn.Conv1d])  # exact classes, as DeepSpeed matches
    with pytest.raises(TypeError, match="module classes or class names"):
        deepspeed.utils.set_z3_leaf_modules(model, [model.moe])
