"""ZeRO stage 3 beyond the common equivalence test (tests/test_zero.py): data-dependent control flow,
persistent small parameters, and a clear error for a parameter used outside its module."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import (
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
from tests.rss import MALLOC_ENV, build_after_warm_up, peak_rss_bytes, stage3_config
from tests.test_data_parallel import adamw
from tests.test_zero import GLOBAL_BATCH, zero_config

# per step, the blocks the forward runs: in order; block 0 skipped; reordered; block 0 twice; in order again
ROUTES = [[0, 1], [1], [1, 0], [0, 0, 1], [0, 1], [0, 1]]


class RoutedGPT(nn.Module):
    """The tiny GPT with its blocks run in a per-call order: modules skipped, repeated, reordered."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        g = self.gpt
        h = g.drop(g.wte(x) + g.wpe(torch.arange(x.shape[1])))
        for i in route:
            h = g.blocks[i](h)
        logits = g.lm_head(g.ln_f(h))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1))


def _reference_routed(batches):
    """Plain PyTorch. A skipped block's parameters get zero gradients (not None), as every data-parallel
    engine steps them (DeepSpeed too): AdamW's moments and weight decay then move them as the engine does."""
    model = RoutedGPT(tiny_gpt())
    opt = adamw(list(model.parameters()))
    losses = []
    for x, route in zip(batches, ROUTES):
        loss = model(x, route)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, param_snapshot(model)


def _routed_worker(rank, world):
    engine = initialize(RoutedGPT(tiny_gpt(seed=rank)), zero_config(3, GLOBAL_BATCH // world, 1, chunk_size=6_000))
    losses = []
    for x, route in zip(token_batches(len(ROUTES), GLOBAL_BATCH), ROUTES):
        (micro,) = micro_batches(x, rank, world, 1)
        loss = engine(micro, route)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    divergences = {phase.value: trace.divergences for phase, trace in engine.gatherer.traces.items()}
    result = losses, trained_params(engine), divergences, engine.gatherer.prefetched
    engine.close()
    return result


def test_skipped_repeated_and_reordered_modules_train_as_in_plain_pytorch(two_ranks):
    ref_losses, ref_params = _reference_routed(token_batches(len(ROUTES), GLOBAL_BATCH))
    results = two_ranks["routed"]
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params, divergences, prefetched in results:
        assert_params_close(params, ref_params)
        # every change of route left the forward trace (and re-traced); the last, repeated route followed it.
        # Backward demands block 0's chunk once even when it ran twice (it stays gathered until all its
        # gradients are in), so [0, 0, 1] and [0, 1] look alike there: one change fewer
        assert divergences == {"forward": 4, "backward": 3}, divergences
        assert prefetched > 0


def _persistent_worker(rank, world):
    cfg = zero_config(3, GLOBAL_BATCH // world, 1, stage3_param_persistence_threshold=1_000)
    engine = initialize(tiny_gpt(seed=rank), cfg)
    losses, _ = train_engine(engine, token_batches(3, GLOBAL_BATCH), rank, world, 1)
    small = [p for p in engine.module.parameters() if p.numel() < 1_000]
    large = [p for p in engine.module.parameters() if p.numel() >= 1_000]
    # between steps the small parameters are readable (whole on every rank), the large ones are released
    small_whole = all(p.untyped_storage().nbytes() > 0 for p in small)
    large_released = all(p.untyped_storage().nbytes() == 0 for p in large)
    result = losses, trained_params(engine), small_whole, large_released, len(small)
    engine.close()
    return result


def test_parameters_below_the_persistence_threshold_stay_gathered(two_ranks):
    model = tiny_gpt()
    ref_losses, _ = train_reference(model, token_batches(3, GLOBAL_BATCH), adamw, clip=1.0)
    results = two_ranks["persistent"]
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params, small_whole, large_released, n_small in results:
        assert_params_close(params, param_snapshot(model))
        assert n_small > 0 and small_whole and large_released


class OutsideUse(nn.Module):
    """Reads `inner.weight` in its own forward instead of calling `inner`."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(64, 64)
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        return self.head(F.linear(x, self.inner.weight)).square().mean()


def _outside_use_worker(rank, world):
    torch.manual_seed(0)
    engine = initialize(OutsideUse(), zero_config(3, 2, 1, chunk_size=1_000))
    try:
        engine(torch.randn(2, 64))
    except RuntimeError as e:
        return str(e)
    return None


def test_a_parameter_used_outside_its_module_fails_with_a_fix(two_ranks):
    for message in two_ranks["outside_use"]:
        assert message is not None
        assert "used while its ZeRO stage 3 chunk was released" in message and "gathered_parameters" in message


def test_parameter_offload_needs_the_offloaded_optimizer(tmp_path):
    cfg = zero_config(3, 2, 1)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    with pytest.raises(Exception, match="also set zero_optimization.offload_optimizer.device"):
        initialize(tiny_gpt(), cfg)


def _cpu_budget_worker(rank, world, nvme_dir, budget):
    cfg = zero_config(3, GLOBAL_BATCH // world, 1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    cfg["aio"] = {"block_size": 4096}
    cfg["memory"] = {"cpu_budget": budget}
    engine = initialize(tiny_gpt(seed=rank), cfg)
    losses, _ = train_engine(engine, token_batches(3, GLOBAL_BATCH), rank, world, 1)
    stats = engine.optimizer.manager.stats
    states = 8 * sum(s.numel() for s in engine.chunked.sharded_params.shards)  # exp_avg + exp_avg_sq, fp32
    params = trained_params(engine)
    engine.close()
    return losses, params, stats.peak_bytes["cpu"], stats.moved_bytes["nvme->cpu"], states


def test_stage_3_trains_through_nvme_with_states_twice_the_cpu_budget(two_ranks):
    """The manager's CPU tier (parameter shards, gradient shards, optimizer states) never exceeds
    memory.cpu_budget while this rank's Adam states alone are more than twice it, and training matches
    plain PyTorch. (The process's peak RSS: test_stage_3_through_nvme_keeps_peak_rss_within_the_cpu_budget.)"""
    budget = CPU_BUDGET
    model = tiny_gpt()
    ref_losses, _ = train_reference(model, token_batches(3, GLOBAL_BATCH), adamw, clip=1.0)
    results = two_ranks["cpu_budget"]
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params, peak_cpu, read, states in results:
        assert_params_close(params, param_snapshot(model))
        assert states >= 2 * budget and peak_cpu <= budget and read > 3 * states  # streamed every step


class GainBlock(nn.Module):
    """A module with a parameter of its own and a child sharing its chunk."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.full((16,), 1.5))

    def forward(self, x):
        return self.lin(x) * self.gain


class SharedTwice(nn.Module):
    """The same block applied twice in one forward (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.block = GainBlock()

    def forward(self, x):
        return self.block(self.block(x)).square().mean()


def _shared_twice_worker(rank, world):
    torch.manual_seed(0)
    engine = initialize(SharedTwice(), zero_config(3, 2, 1, chunk_size=1_000))
    losses = []
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))[rank * 2:(rank + 1) * 2]
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = losses, trained_params(engine)
    engine.close()
    return result


def test_a_module_called_twice_keeps_its_chunk_while_it_runs(two_ranks):
    """A second call of a module re-opens its chunk: a child finishing inside it must not release the
    parameters the running parent still needs (that crashed: released storage read by a CPU kernel)."""
    torch.manual_seed(0)
    model = SharedTwice()
    opt = adamw(list(model.parameters()))
    ref_losses = []
    for step in range(3):
        loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    results = two_ranks["shared_twice"]
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params in results:
        assert_params_close(params, param_snapshot(model))


def _forward_inside_gathered_worker(rank, world):
    engine = initialize(tiny_gpt(), zero_config(3, 2, 1))
    weight = engine.module.lm_head.weight
    x = token_batches(1, 4)[0][rank * 2:(rank + 1) * 2]
    with engine.gathered_parameters([weight], modifier_rank=0):
        with torch.no_grad():
            engine(x, x)  # a pass inside the block must not release what the block holds
        held = weight.untyped_storage().nbytes()
        if rank == 0:
            with torch.no_grad():
                weight.mul_(0.5)
    with engine.gathered_parameters([weight]):
        after = weight.detach().clone()
    engine.close()
    return held, after


def test_a_forward_inside_gathered_parameters_keeps_them_gathered(two_ranks):
    reference = tiny_gpt().lm_head.weight.detach() * 0.5
    for held, after in two_ranks["forward_inside_gathered"]:
        assert held > 0
        torch.testing.assert_close(after, reference)


CPU_BUDGET = 200 * 1024  # bytes: test_stage_3_trains_through_nvme_with_states_twice_the_cpu_budget


def _two_rank_cases_worker(rank, world, nvme_dir):
    """The two-rank cases of this file in one spawned group (a spawn costs seconds), each on its own engine.
    The refused forward runs last, so no engine after it meets what a failed forward leaves behind. The peak-RSS
    test keeps a process of its own: it measures the whole process and sets glibc's allocator environment."""
    cases = {"routed": lambda: _routed_worker(rank, world),
             "persistent": lambda: _persistent_worker(rank, world),
             "cpu_budget": lambda: _cpu_budget_worker(rank, world, nvme_dir, CPU_BUDGET),
             "shared_twice": lambda: _shared_twice_worker(rank, world),
             "forward_inside_gathered": lambda: _forward_inside_gathered_worker(rank, world),
             "outside_use": lambda: _outside_use_worker(rank, world)}
    results = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as e:
            raise RuntimeError(f"case {name} failed on rank {rank}") from e
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """{case name: [rank 0's result, rank 1's result]} for each case of _two_rank_cases_worker."""
    nvme_dir = str(tmp_path_factory.mktemp("stage3_nvme"))
    per_rank = run_distributed(_two_rank_cases_worker, 2, args=(nvme_dir,), timeout_s=300)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


NVME_MODEL = dict(n_layer=12, n_head=8, n_embd=512, block_size=64)  # 38M parameters
NVME_WORKING_SET = 96 * 2**20


def _nvme_rss_worker(rank, world, nvme_dir, budget):
    model, before = build_after_warm_up(**NVME_MODEL)
    psi = sum(p.numel() for p in model.parameters())
    cfg = stage3_config(2**20)
    for kind in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][kind] = {"device": "nvme", "nvme_path": nvme_dir}
    cfg["memory"] = {"cpu_budget": budget}
    engine = initialize(model, cfg)
    losses = []
    for step in range(3):
        x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(step * world + rank))
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    growth = peak_rss_bytes() - before
    peak_cpu_tier = engine.optimizer.manager.stats.peak_bytes["cpu"]
    engine.close()
    return psi, growth, peak_cpu_tier, losses


def test_stage_3_through_nvme_keeps_peak_rss_within_the_cpu_budget(tmp_path, monkeypatch):
    """A 38M-parameter GPT built with zero_init, everything offloaded to NVMe, memory.cpu_budget 32 MiB:
    this rank's Adam states (8Ψ/N = 152 MB) are more than four times the budget, its model state (16Ψ/N)
    more than nine times. Peak RSS grows by at most the budget plus a working set of 96 MiB that does not
    depend on the model's size (measured: the same within 7 MiB for a model half as large): gathered
    1M-element chunks and 2M elements gathered ahead (16 MiB), a gradient chunk and its reduce-scatter
    buffer (8 MiB), the NVMe store's aligned staging buffers, activations, the allocator's slack. glibc's
    mmap threshold is fixed at 1 MiB in the ranks so that RSS counts memory in use."""
    budget = 32 * 2**20
    monkeypatch.setenv(*MALLOC_ENV)
    for psi, growth, peak_cpu_tier, losses in run_distributed(_nvme_rss_worker, 2, args=(str(tmp_path), budget),
                                                              timeout_s=300):
        assert 8 * psi / 2 >= 4 * budget
        assert peak_cpu_tier <= budget
        assert growth <= budget + NVME_WORKING_SET, (growth / 2**20, (budget + NVME_WORKING_SET) / 2**20)
        assert all(math.isfinite(v) for v in losses)
