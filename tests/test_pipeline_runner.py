"""Running a pipeline schedule across processes (Note [running a pipeline schedule]): each schedule's losses and
accumulated gradients equal one process running the whole model over the same micro-batches (fp32 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.pipeline import PipelineRunner, PipelineTimeout, build_schedule
from tests.distributed import run_distributed
from tests.reference import FP32_RTOL
from tests.saved_bytes import SavedBytes

WIDTH, LAYERS, BATCH = 16, 8, 4


def model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS - 1)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 3))


def data(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return ([torch.randn(BATCH, WIDTH, generator=g) for _ in range(m)],
            [torch.randn(BATCH, 3, generator=g) for _ in range(m)])


def stage_modules(net: nn.Sequential, stages: int) -> list[nn.Sequential]:
    per = LAYERS // stages
    return [net[s * per:(s + 1) * per] for s in range(stages)]


def _worker(rank, world, name, m, v):
    schedule = build_schedule(name, world, m, v)
    net = model()
    parts = stage_modules(net, schedule.stages)
    mine = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == rank}
    runner = PipelineRunner.over_modules(schedule, rank, mine, F.mse_loss)
    inputs, targets = data(m)
    result = runner.run(list(zip(inputs, targets)))
    grads = {f"{s}.{n}": p.grad.clone() for s, part in mine.items() for n, p in part.named_parameters()}
    return result.losses, grads


@pytest.mark.parametrize("name,world,m,v", [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("zero_bubble", 2, 5, 1),
                                            ("interleaved", 2, 4, 2), ("1f1b", 4, 6, 1), ("zero_bubble", 4, 6, 1)])
def test_a_pipelined_step_equals_one_process(name, world, m, v):
    net = model()
    inputs, targets = data(m)
    ref_losses = []
    for x, y in zip(inputs, targets):
        loss = F.mse_loss(net(x), y)
        (loss / m).backward()
        ref_losses.append(loss.item())
    parts = stage_modules(net, world * v)
    expected = {f"{s}.{n}": p.grad for s, part in enumerate(parts) for n, p in part.named_parameters()}

    results = run_distributed(_worker, world, args=(name, m, v))
    last = build_schedule(name, world, m, v).rank_of(world * v - 1)
    assert results[last][0] == pytest.approx(ref_losses, rel=FP32_RTOL)
    assert all(not losses for r, (losses, _) in enumerate(results) if r != last)
    got = {k: g for _, grads in results for k, g in grads.items()}
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=FP32_RTOL, atol=FP32_RTOL * 0.1, msg=key)


def test_a_rank_given_the_wrong_stages_is_told_which_it_holds():
    schedule = build_schedule("interleaved", 2, 2, 2)
    with pytest.raises(ValueError, match=r"rank 1 holds pipeline stage\(s\) \[1, 3\] but was given modules for \[1\]"):
        PipelineRunner.over_modules(schedule, 1, {1: nn.Linear(2, 2)}, F.mse_loss)


def _memory_worker(rank, world, name, m):
    schedule = build_schedule(name, world, m)
    parts = stage_modules(model(), schedule.stages)
    runner = PipelineRunner.over_modules(schedule, rank, {rank: parts[rank]}, F.mse_loss)
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, SavedBytes.unpack):
        runner.run(list(zip(*data(m))))
    return saved.peak


def test_1f1b_keeps_saved_activations_flat_as_micro_batches_grow_and_gpipe_does_not():
    peaks = {(name, m): run_distributed(_memory_worker, 2, args=(name, m))[0]
             for name in ("1f1b", "gpipe") for m in (2, 4, 8)}
    assert peaks[("1f1b", 2)] == peaks[("1f1b", 4)] == peaks[("1f1b", 8)] > 0  # at most p micro-batches on rank 0
    assert peaks[("gpipe", 8)] == 2 * peaks[("gpipe", 4)] == 4 * peaks[("gpipe", 2)]  # every micro-batch's
    assert peaks[("gpipe", 2)] == peaks[("1f1b", 2)]  # the same two micro-batches in flight at m = p


class _Failing(nn.Module):
    def forward(self, x):
        raise RuntimeError("injected failure in stage 1")


def _timeout_worker(rank, world):
    schedule = build_schedule("1f1b", world, 2)
    parts = stage_modules(model(), 2)
    stage = parts[0] if rank == 0 else nn.Sequential(_Failing(), nn.Linear(1, 1))  # rank 1 fails at once
    runner = PipelineRunner.over_modules(schedule, rank, {rank: stage}, F.mse_loss, timeout_s=2.0)
    try:
        runner.run(list(zip(*data(2))))
    except PipelineTimeout as e:
        return "timeout", str(e)
    except RuntimeError as e:
        return "failed", str(e)
    return "finished", ""


def test_a_rank_waiting_on_a_failed_peer_says_what_it_waits_for():
    (kind0, message0), (kind1, message1) = run_distributed(_timeout_worker, 2, timeout_s=60)
    assert kind1 == "failed" and "injected failure in stage 1" in message1
    assert kind0 == "timeout"
    assert message0.startswith("pipeline rank 0 is on B0.0, waiting for the input gradient of stage 1, micro-batch 0, "
                               "from rank 1; nothing came in 2 s"), message0
