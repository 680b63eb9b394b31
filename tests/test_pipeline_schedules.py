"""Pipeline schedules as data (Note [pipeline schedules as data]): every schedule is complete and deadlock-free,
its simulated bubble is the published formula, 1F1B's activations stay flat as micro-batches grow while GPipe's
grow, zero bubble's bubble is a third of 1F1B's, and a broken schedule is named before it runs."""

from __future__ import annotations

import pytest

from engine.pipeline import Action, ActionKind, Schedule, ScheduleError, build_schedule, check, simulate

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
CASES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 9, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("p,m", CASES)
def test_every_schedule_is_complete_and_runs(name, p, m):
    schedule = build_schedule(name, p, m)
    check(schedule)
    sim = simulate(schedule)
    assert len(sim.finish) == sum(len(a) for a in schedule.actions)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", CASES)
def test_gpipe_and_1f1b_bubbles_are_the_published_formula(name, p, m):
    assert simulate(build_schedule(name, p, m)).bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (2, 6, 4), (8, 16, 2)])
def test_interleaved_shrinks_the_bubble_by_the_virtual_stages(p, m, v):
    schedule = build_schedule("interleaved", p, m, v)
    assert {schedule.rank_of(a.stage) for acts in schedule.actions for a in acts} == set(range(p))
    assert simulate(schedule).bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert simulate(schedule).bubble < simulate(build_schedule("1f1b", p, m)).bubble


@pytest.mark.parametrize("p,m", [(p, m) for p, m in CASES if m >= p > 1])
def test_zero_bubble_idles_a_third_of_1f1b_at_its_peak_memory(p, m):
    one_f_one_b, zero_bubble = simulate(build_schedule("1f1b", p, m)), simulate(build_schedule("zero_bubble", p, m))
    work = 3 * m  # F + I + W per micro-batch, unit costs each
    assert one_f_one_b.makespan - work == 3 * (p - 1)
    assert zero_bubble.makespan - work == p - 1
    assert max(zero_bubble.peak_in_flight) == max(one_f_one_b.peak_in_flight) == p


def test_1f1b_holds_at_most_p_minus_r_micro_batches_whatever_m_and_gpipe_holds_all_of_them():
    p = 4
    for m in (4, 8, 16, 32):
        assert simulate(build_schedule("1f1b", p, m)).peak_in_flight == tuple(p - r for r in range(p))
        assert simulate(build_schedule("gpipe", p, m)).peak_in_flight == (m,) * p


def test_a_deadlock_is_named_before_the_first_step():
    # rank 1 runs micro-batch 1's forward first, which needs rank 0's F0.1, queued after B0.0, which needs B1.0
    actions = ((Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1)),
               (Action(F, 1, 1), Action(F, 1, 0), Action(B, 1, 0), Action(B, 1, 1)))
    with pytest.raises(ScheduleError) as error:
        simulate(Schedule("broken", 2, 1, 2, actions))
    assert str(error.value) == ("the schedule deadlocks: rank 0 is on B0.0, waiting for B1.0; "
                                "rank 1 is on F1.1, waiting for F0.1")


def test_an_incomplete_or_misplaced_schedule_is_refused():
    good = build_schedule("1f1b", 2, 2)
    missing = Schedule("x", 2, 1, 2, (good.actions[0][:-1], good.actions[1]))
    with pytest.raises(ScheduleError, match="no rank runs B0.1"):
        check(missing)
    misplaced = Schedule("x", 2, 1, 2, (good.actions[0] + (Action(F, 1, 5),), good.actions[1]))
    with pytest.raises(ScheduleError, match="rank 0 runs F1.5, but stage 1 lives on rank 1"):
        check(misplaced)
    twice = Schedule("x", 2, 1, 2, (good.actions[0] + good.actions[0][:1], good.actions[1]))
    with pytest.raises(ScheduleError, match="rank 0 runs F0.0 twice"):
        check(twice)


def test_bad_schedule_settings_name_the_fix():
    with pytest.raises(ValueError, match="'pipedream' is not one of gpipe, 1f1b, interleaved, zero_bubble"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="set gradient_accumulation_steps to a multiple of 4"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="only the \"interleaved\" schedule runs several stages per rank"):
        build_schedule("1f1b", 2, 4, 2)


def test_a_schedule_prints_one_line_per_rank():
    assert build_schedule("1f1b", 2, 3).format().splitlines() == [
        "rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2",
        "rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2",
    ]
