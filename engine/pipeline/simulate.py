"""Checking and simulating a pipeline schedule before it runs (Note [pipeline schedules as data])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.pipeline.schedules import Action, ActionKind, Schedule

# unit costs: a full backward is twice a forward (its input and weight gradients, one forward's cost each)
DEFAULT_COSTS = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0, ActionKind.BACKWARD_INPUT: 1.0,
                 ActionKind.BACKWARD_WEIGHT: 1.0}


class ScheduleError(ValueError):
    """A schedule that would not run: an action missing, repeated or on the wrong rank, or a deadlock."""


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: tuple[float, ...]  # per rank
    finish: dict[Action, float]
    peak_in_flight: tuple[int, ...]  # per rank: micro-batch stages forwarded whose backward has not finished

    @property
    def bubble(self) -> float:
        """The idle fraction of the ranks' time between the first action and the last."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def check(schedule: Schedule) -> None:
    """Every stage runs the forward and the backward (whole, or I then W) of every micro-batch exactly once, on the
    rank holding it; raises ScheduleError naming what is wrong."""
    seen: dict[Action, int] = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            home = schedule.rank_of(a.stage)
            if home != rank:
                raise ScheduleError(f"rank {rank} runs {a}, but stage {a.stage} lives on rank {home}")
            if a in seen:
                raise ScheduleError(f"rank {rank} runs {a} twice")
            seen[a] = rank
    for stage in range(schedule.stages):
        for j in range(schedule.microbatches):
            for needed in _needed(stage, j, seen):
                if needed not in seen:
                    raise ScheduleError(f"no rank runs {needed}")


def _needed(stage: int, j: int, seen: dict[Action, int]) -> list[Action]:
    split = Action(ActionKind.BACKWARD_INPUT, stage, j) in seen or Action(ActionKind.BACKWARD_WEIGHT, stage, j) in seen
    backward = ([Action(ActionKind.BACKWARD_INPUT, stage, j), Action(ActionKind.BACKWARD_WEIGHT, stage, j)] if split
                else [Action(ActionKind.BACKWARD, stage, j)])
    return [Action(ActionKind.FORWARD, stage, j), *backward]


def dependencies(action: Action, stages: int) -> list[tuple[Action, ...]]:
    """What must have finished before `action` starts: each entry is satisfied by any one of its actions (the next
    stage's input gradient comes from its whole backward or from its I pass)."""
    s, j = action.stage, action.microbatch
    if action.kind is ActionKind.FORWARD:
        return [(Action(ActionKind.FORWARD, s - 1, j),)] if s > 0 else []
    if action.kind is ActionKind.BACKWARD_WEIGHT:
        return [(Action(ActionKind.BACKWARD_INPUT, s, j),)]
    deps = [(Action(ActionKind.FORWARD, s, j),)]
    if s < stages - 1:
        deps.append((Action(ActionKind.BACKWARD, s + 1, j), Action(ActionKind.BACKWARD_INPUT, s + 1, j)))
    return deps


def simulate(schedule: Schedule, costs: dict[ActionKind, float] | None = None) -> Simulation:
    """Runs each rank's list in order, an action starting once its rank is free and its dependencies have finished
    (communication free); raises ScheduleError on a deadlock, naming each stuck rank's action and what it waits
    for. Costs are per virtual stage: a rank's v stages share its work (each costs 1/v of the defaults)."""
    check(schedule)
    costs = costs or {k: c / schedule.virtual_stages for k, c in DEFAULT_COSTS.items()}
    finish = timeline(schedule.actions, schedule.stages, costs)
    busy = tuple(sum(costs[a.kind] for a in acts) for acts in schedule.actions)
    makespan = max((finish[acts[-1]] for acts in schedule.actions if acts), default=0.0)
    return Simulation(makespan, busy, finish, tuple(_peak_in_flight(acts) for acts in schedule.actions))


def timeline(actions: Sequence[Sequence[Action]], stages: int, costs: dict[ActionKind, float]) -> dict[Action, float]:
    """Each action's finish time when every rank runs its list (`actions[rank]`, any subset of a schedule's, e.g. its
    forwards) in order, an action starting once its rank is free and its dependencies have finished; raises
    ScheduleError on a deadlock, naming each stuck rank's action and what it waits for."""
    cursor = [0] * len(actions)
    free = [0.0] * len(actions)
    finish: dict[Action, float] = {}
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in enumerate(actions):
            while cursor[rank] < len(acts):
                action = acts[cursor[rank]]
                ready = [_finished(alternatives, finish) for alternatives in dependencies(action, stages)]
                if any(t is None for t in ready):
                    break
                finish[action] = max([free[rank], *ready]) + costs[action.kind]
                free[rank] = finish[action]
                cursor[rank] += 1
                progressed = True
    stuck = [(r, acts[cursor[r]]) for r, acts in enumerate(actions) if cursor[r] < len(acts)]
    if stuck:
        listed = {a for acts in actions for a in acts}
        raise ScheduleError("the schedule deadlocks: " + "; ".join(
            f"rank {r} is on {a}, waiting for {_waiting_for(a, stages, finish, listed)}" for r, a in stuck))
    return finish


def _finished(alternatives: tuple[Action, ...], finish: dict[Action, float]) -> float | None:
    done = [finish[a] for a in alternatives if a in finish]
    return min(done) if done else None


def _waiting_for(action: Action, stages: int, finish: dict[Action, float], scheduled: set[Action]) -> str:
    """The unfinished dependencies of `action`, each named as the schedule runs it (B or I)."""
    missing = [next((a for a in alternatives if a in scheduled), alternatives[0])
               for alternatives in dependencies(action, stages) if _finished(alternatives, finish) is None]
    return " and ".join(str(a) for a in missing)


def _peak_in_flight(actions: tuple[Action, ...]) -> int:
    """The most (stage, micro-batch) forwards whose activations a rank holds at once: from the forward until the
    backward that frees them (the whole backward, or W: the weight gradient still reads the layer inputs)."""
    held, peak = 0, 0
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            held -= 1
    return peak
