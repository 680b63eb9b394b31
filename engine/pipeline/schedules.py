"""Pipeline schedules as data: for each rank, the list of compute actions it runs, in order.

Note [pipeline schedules as data]
A schedule is, per pipeline rank, a list of actions — (kind, stage, micro-batch) — that the rank
runs one after another; what is sent and received follows from the actions (a forward of stage s
sends its output to stage s + 1, a backward of stage s sends the input gradient to stage s - 1),
as in torch.distributed.pipelining's schedule IR. Because it is data it can be printed, checked
(every stage's forward and backward of every micro-batch exactly once, on the rank that holds the
stage) and simulated before the first step: `simulate` runs the lists with unit costs and reports
a deadlock — the action each rank is on and what it waits for — instead of hanging, and measures
the bubble. Stage s (of p·v virtual stages) lives on rank s mod p, so with v > 1 each rank holds v
stages p apart (Megatron's interleaved placement). The schedules:
  gpipe        every forward, then every backward: each rank holds all m micro-batches' activations
  1f1b         p - 1 - r forwards of warm-up, then one forward / one backward (PipeDream-flush): at
               most p - r micro-batches in flight on rank r; bubble (p-1)/(m+p-1) like GPipe
  interleaved  1F1B over v virtual stages per rank (Megatron's order; m a multiple of p): the
               bubble shrinks by v
  zero_bubble  ZB-H1 (Qi et al. 2023): backward split into the input-gradient pass (I), which the
               previous stage waits for, and the weight-gradient pass (W), which nobody waits for;
               rank r defers its W's by r micro-batches, so no W delays the I chain of the cool-down:
               with F = I = W the bubble is (p-1)·F, a third of 1F1B's (p-1)·(F+B), and no rank holds
               more than p micro-batches' activations, 1F1B's peak
With unit costs (F = 1, B = 2) `simulate` gives GPipe's and 1F1B's bubble as (p-1)/(m+p-1) and the
interleaved one as (p-1)/(v·m+p-1), the published formulas; tests/test_pipeline_schedules.py checks it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"          # input and weight gradients together
    BACKWARD_INPUT = "I"    # the input gradient only (zero bubble)
    BACKWARD_WEIGHT = "W"   # the weight gradient only (zero bubble)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


@dataclass(frozen=True)
class Schedule:
    """Per rank, the actions it runs in order, over `stages` = ranks × virtual stages."""

    name: str
    ranks: int
    virtual_stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def format(self) -> str:
        """One line per rank: its actions in order (F/B/I/W, stage, micro-batch)."""
        width = max(len(str(a)) for acts in self.actions for a in acts)
        return "\n".join(f"rank {r}: " + " ".join(str(a).ljust(width) for a in acts)
                         for r, acts in enumerate(self.actions))


def build_schedule(name: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule `name` for `ranks` pipeline ranks and `microbatches` micro-batches per step."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: {name!r} is not one of {', '.join(SCHEDULES)}")
    if ranks < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"a pipeline needs at least 1 rank, micro-batch and virtual stage (got {ranks}, "
                         f"{microbatches}, {virtual_stages})")
    if virtual_stages > 1 and name != "interleaved":
        raise ValueError(f"pipeline.virtual_stages: {virtual_stages} — only the \"interleaved\" schedule runs "
                         "several stages per rank; set schedule to \"interleaved\" or virtual_stages to 1")
    if name == "interleaved" and microbatches % ranks:
        raise ValueError(f"the interleaved schedule runs micro-batches in groups of the {ranks} pipeline ranks, and "
                         f"{microbatches} is not a multiple of {ranks}; set gradient_accumulation_steps to a "
                         f"multiple of {ranks}")
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zero_bubble": _zero_bubble}[name]
    actions = tuple(tuple(make(r, ranks, microbatches, virtual_stages)) for r in range(ranks))
    return Schedule(name, ranks, virtual_stages, microbatches, actions)


def _gpipe(rank: int, p: int, m: int, v: int) -> list[Action]:
    return ([Action(ActionKind.FORWARD, rank, j) for j in range(m)]
            + [Action(ActionKind.BACKWARD, rank, j) for j in range(m)])


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> list[Action]:
    warm = min(p - 1 - rank, m)
    out = [Action(ActionKind.FORWARD, rank, j) for j in range(warm)]
    for j in range(m - warm):  # steady state: one forward, one backward
        out += [Action(ActionKind.FORWARD, rank, warm + j), Action(ActionKind.BACKWARD, rank, j)]
    out += [Action(ActionKind.BACKWARD, rank, j) for j in range(m - warm, m)]
    return out


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: the k-th forward of a rank runs virtual stage (k // p) mod v of micro-batch
    (k // (p·v))·p + k mod p; backwards walk the virtual stages in reverse."""
    total = m * v

    def action(k: int, kind: ActionKind) -> Action:
        chunk = (k // p) % v
        if kind is ActionKind.BACKWARD:
            chunk = v - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p)

    warm = min((p - 1 - rank) * 2 + (v - 1) * p, total)
    out = [action(k, ActionKind.FORWARD) for k in range(warm)]
    for k in range(total - warm):
        out += [action(warm + k, ActionKind.FORWARD), action(k, ActionKind.BACKWARD)]
    out += [action(k, ActionKind.BACKWARD) for k in range(total - warm, total)]
    return out


def _zero_bubble(rank: int, p: int, m: int, v: int) -> list[Action]:
    """ZB-H1: 1F1B with each backward split into I then W, rank r's W's deferred by r micro-batches (and the last
    ones run after its last I): the I chain the earlier stages wait for is never held up by a W."""
    warm = min(p - 1 - rank, m)
    out = [Action(ActionKind.FORWARD, rank, j) for j in range(warm)]
    waiting: deque[int] = deque()
    for j in range(m):
        if warm + j < m:
            out.append(Action(ActionKind.FORWARD, rank, warm + j))
        out.append(Action(ActionKind.BACKWARD_INPUT, rank, j))
        waiting.append(j)
        if len(waiting) > rank:
            out.append(Action(ActionKind.BACKWARD_WEIGHT, rank, waiting.popleft()))
    out += [Action(ActionKind.BACKWARD_WEIGHT, rank, j) for j in waiting]
    return out
