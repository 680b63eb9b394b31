"""Pipeline point-to-point that pairs the way NCCL pairs (Note [ordered point-to-point]): no tags, a rank's n-th
send to a peer meets the peer's n-th receive from it, a batch runs only with its partners. The plans the runner
follows send each pair of ranks, round by round, exactly what the other receives; and the runner itself, over a
network that keeps NCCL's rules (tests/rendezvous.py), trains every schedule to the single-process result with
micro-batches of different lengths in flight, where the posting order tags used to hide deadlocks."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F

from engine.pipeline import ActionKind, PipelineRunner, ScheduleError, build_schedule
from engine.pipeline.p2p import Exchange, check_pairing, plans
from tests.reference import FP32_RTOL
from tests.rendezvous import RendezvousNetwork
from tests.test_pipeline_runner import WIDTH, model, stage_modules

SHAPES = [("gpipe", 2, 4, 1), ("1f1b", 3, 5, 1), ("zero_bubble", 4, 6, 1), ("interleaved", 2, 4, 2),
          ("interleaved", 4, 8, 2), ("interleaved", 3, 6, 4), ("interleaved", 2, 2, 2), ("1f1b", 8, 3, 1)]


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("name,p,m,v", SHAPES + [(n, p, m, 1) for n in ("gpipe", "1f1b", "zero_bubble")
                                                  for p in (2, 4, 8) for m in (1, 2, 7, 16)])
def test_every_rank_pair_sends_in_each_round_what_the_other_receives(name, p, m, v, forward_only):
    schedule = build_schedule(name, p, m, v)
    rank_plans = plans(schedule, forward_only)
    check_pairing(schedule, rank_plans)
    sent = [m_ for steps in rank_plans for e in steps if isinstance(e, Exchange) for _, m_ in e.sends]
    last = schedule.stages - 1
    between_ranks = [a for acts in schedule.actions for a in acts if p > 1 and (
        a.kind is ActionKind.FORWARD and a.stage < last
        or not forward_only and a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and a.stage > 0)]
    assert len(sent) == len(between_ranks)  # every output and input gradient crosses once


def test_a_plan_whose_send_and_receive_sit_in_different_rounds_is_refused():
    schedule = build_schedule("1f1b", 2, 2)
    rank_plans = [list(steps) for steps in plans(schedule)]
    first, later = (i for i, e in enumerate(rank_plans[0]) if isinstance(e, Exchange) and e.sends)
    moved = rank_plans[0][first].sends
    rank_plans[0][later] = dataclasses.replace(rank_plans[0][later], sends=moved + rank_plans[0][later].sends)
    del rank_plans[0][first]  # rank 0 holds micro-batch 0's output back a round
    with pytest.raises(ScheduleError, match=r"in round 1 rank 0 sends rank 1 nothing but rank 1 receives the "
                                            r"output of stage 0, micro-batch 0: NCCL pairs"):
        check_pairing(schedule, rank_plans)


def _data(m: int):
    """Micro-batches of different lengths: the headers must describe each message, not each stage."""
    g = torch.Generator().manual_seed(1)
    sizes = [2 + j % 3 for j in range(m)]
    return [(torch.randn(n, WIDTH, generator=g), torch.randn(n, 3, generator=g)) for n in sizes]


def _on_threads(ranks: int, worker) -> tuple[list, RendezvousNetwork]:
    network = RendezvousNetwork(ranks)
    results, errors = [None] * ranks, [None] * ranks

    def body(rank):
        try:
            results[rank] = worker(rank, network.endpoint(rank))
        except BaseException as e:  # handed to the test below
            errors[rank] = e
        finally:
            network.leave(rank)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a rank thread is still running after 300 s"
    assert network.error is None, network.error
    for e in errors:
        if e is not None:
            raise e
    return results, network


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 6, 1), ("zero_bubble", 4, 6, 1),
                                        ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2),
                                        ("interleaved", 1, 2, 2)])
def test_the_runner_under_nccl_pairing_equals_one_process(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    microbatches = _data(m)
    net = model()
    ref_losses = []
    for x, y in microbatches:
        loss = F.mse_loss(net(x), y)
        (loss / m).backward()
        ref_losses.append(loss.item())
    with torch.no_grad():
        ref_eval = [F.mse_loss(net(x), y).item() for x, y in microbatches]
    parts = stage_modules(net, schedule.stages)
    expected = {f"{s}.{n}": q.grad for s, part in enumerate(parts) for n, q in part.named_parameters()}

    copies = [stage_modules(model(), schedule.stages) for _ in range(p)]  # here: model() seeds the global RNG

    def worker(rank, endpoint):
        mine = {s: copies[rank][s] for s in range(schedule.stages) if schedule.rank_of(s) == rank}
        runner = PipelineRunner.over_modules(schedule, rank, mine, F.mse_loss, timeout_s=60, transport=endpoint)
        losses = runner.run(microbatches).losses
        grads = {f"{s}.{n}": q.grad.clone() for s, part in mine.items() for n, q in part.named_parameters()}
        return losses, grads, runner.run(microbatches, train=False).losses

    results, network = _on_threads(p, worker)
    last = schedule.rank_of(schedule.stages - 1)
    assert results[last][0] == pytest.approx(ref_losses, rel=FP32_RTOL)
    assert results[last][2] == pytest.approx(ref_eval, rel=FP32_RTOL)
    got = {k: g for _, grads, _ in results for k, g in grads.items()}
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=FP32_RTOL, atol=FP32_RTOL * 0.1, msg=key)
    assert (network.batches_posted > 0) == (p > 1)


def test_the_network_catches_the_1f1b_deadlock_that_ungrouped_sends_make():
    """Each send posted as its output is made and each receive when it is needed, one batch each (how the runner
    posted before it followed a plan): on 1F1B's two ranks, micro-batch 1's activation and micro-batch 0's
    gradient are each sent while the receive that would take them is queued behind the other send."""
    def worker(rank, endpoint):
        t = torch.zeros(4)
        if rank == 0:  # F0.0 F0.1 B0.0 B0.1
            sends = [endpoint.post([(1, t)], []), endpoint.post([(1, t)], [])]
            for _ in range(2):
                endpoint.post([], [(1, torch.empty(4))])[0].wait()
            for works in sends:
                works[0].wait()
        else:  # F1.0 B1.0 F1.1 B1.1
            for _ in range(2):
                endpoint.post([], [(0, torch.empty(4))])[0].wait()
                endpoint.post([(0, t)], [])

    with pytest.raises(AssertionError, match=r"deadlock: rank 0 runs \[send to 1 \(4,\) torch.float32\]; "
                                             r"rank 1 runs \[send to 0 \(4,\) torch.float32\]"):
        _on_threads(2, worker)


def test_the_network_catches_a_header_paired_with_a_payload():
    def worker(rank, endpoint):
        if rank == 0:
            endpoint.post([(1, torch.zeros(8, dtype=torch.int64))], [])
            endpoint.post([(1, torch.zeros(3, 5))], [])[0].wait()
        else:  # receives the payload first, as a tag would have allowed
            endpoint.post([], [(0, torch.empty(3, 5))])[0].wait()

    with pytest.raises(AssertionError, match=r"rank 0's send #0 to rank 1 \(\(8,\), torch.int64\) met a receive of "
                                             r"\(\(3, 5\), torch.float32\)"):
        _on_threads(2, worker)
