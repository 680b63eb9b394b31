"""Point-to-point between pipeline ranks in an order both sides of every message follow, so it pairs the same way
on NCCL, which ignores tags, as on gloo.

Note [ordered point-to-point]
NCCL pairs a rank's n-th send to a peer with the peer's n-th receive from that rank: it ignores tags. A batch of
sends and receives (batch_isend_irecv: one NCCL group) runs as one kernel on the group communicator's one stream,
so a rank's batches run one after another, and a batch finishes only once every peer it exchanges with runs the
matching batch. Sends and receives posted in different orders on the two sides (each send as its output is made,
each receive when its input is needed) would then put one message's bytes in another's buffer, or hang: under
1F1B, rank 0's send of micro-batch 1's activation and rank 1's send of micro-batch 0's gradient would each wait
for a receive queued behind the other. So nothing here relies on a tag (every message goes with tag 0, and gloo,
which pairs by order per tag, runs the CPU tests with the pairing NCCL uses):
- Rounds. The schedule's lists run with every action costing one step (`timeline`) give each action a start
  step. A message (a stage's output, or its input's gradient) is exchanged in the round of its consumer's start
  step, by both ranks: a rank's plan is, step by step, that step's exchange (when it has one) and then the
  action starting at that step. Every rank posts its exchanges in increasing rounds, and an exchange pairs only
  with the same round's exchanges.
- Order within a round: a rank's messages with one peer are posted sorted by (kind, stage, micro-batch), a key
  both sides compute, so the n-th send to a peer is that peer's n-th receive from it. `check_pairing` verifies
  it over every pair of ranks and every round, from the plans the runner follows.
- Shapes. An exchange is two batches: the messages' headers (dtype and sizes, a fixed size), then the payloads.
  A receiver waits for its headers before it sizes the payloads' buffers, so stages may change shapes and
  micro-batches may differ in length.
- Waiting. A rank waits for an exchange's batches where it receives in them (the next action needs the tensor);
  batches that only send are waited for at the end of the step. The price is a lockstep of the pairs: the
  sender posts a message once it has run its actions before the consumer's step, as the unit-step run orders
  them, even when the message was made earlier.
Why it cannot hang: take the lowest round (headers before payloads) with an unfinished batch on some rank.
Every rank taking part in that round has posted its batch there (a rank stops posting only to wait on a batch
of its own, unfinished, so of that round or a later one), and every batch before it on that rank's stream is of
a lower round, so finished: all of the round's batches run at once and finish. (A rank reaches its first exchange
without waiting on anyone, so the group communicator NCCL creates at every rank's first batch is created by all.)
torch.distributed.pipelining runs a lockstep too: per time step, a rank's sends and the receives of what its
neighbours send in that step, as one batch waited for at once, with shapes fixed ahead by a first pass.
Megatron's 1F1B pairs each send with the opposite receive of the same step in one batch, and exchanges shapes
first when sequence lengths vary.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from engine.pipeline.schedules import Action, ActionKind, Schedule
from engine.pipeline.simulate import ScheduleError, timeline

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_MAX_DIMS = 6
HEADER_SIZE = 2 + _MAX_DIMS  # dtype code, ndim, the sizes
_ONE_STEP = dict.fromkeys(ActionKind, 1)


@dataclass(frozen=True)
class Message:
    """What stage `stage` sends for micro-batch `microbatch`: its output (FORWARD, to stage + 1) or its input's
    gradient (BACKWARD, to stage - 1)."""

    kind: ActionKind
    stage: int
    microbatch: int

    @property
    def to_stage(self) -> int:
        return self.stage + 1 if self.kind is ActionKind.FORWARD else self.stage - 1

    def key(self) -> tuple[int, int, int]:
        """The order within a round's messages with one peer, computed the same on both sides."""
        return (0 if self.kind is ActionKind.FORWARD else 1, self.stage, self.microbatch)

    def __str__(self) -> str:
        what = "output" if self.kind is ActionKind.FORWARD else "input gradient"
        return f"the {what} of stage {self.stage}, micro-batch {self.microbatch}"


def message_in(action: Action, stages: int) -> Message | None:
    """The message `action` needs: the previous stage's output (F), the next stage's input gradient (B, I)."""
    s, j = action.stage, action.microbatch
    if action.kind is ActionKind.FORWARD:
        return Message(ActionKind.FORWARD, s - 1, j) if s > 0 else None
    if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
        return Message(ActionKind.BACKWARD, s + 1, j) if s < stages - 1 else None
    return None


def message_out(action: Action, stages: int) -> Message | None:
    """The message `action` makes: its output (F, not on the last stage), its input's gradient (B, I, not stage 0)."""
    s, j = action.stage, action.microbatch
    if action.kind is ActionKind.FORWARD:
        return Message(ActionKind.FORWARD, s, j) if s < stages - 1 else None
    if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
        return Message(ActionKind.BACKWARD, s, j) if s > 0 else None
    return None


@dataclass(frozen=True)
class Exchange:
    """One rank's point-to-point in one round: (peer pipeline rank, message) pairs in the order they are posted;
    `before`: the action that follows it on this rank (what a timeout reports the rank is on)."""

    round: int
    sends: tuple[tuple[int, Message], ...]
    receives: tuple[tuple[int, Message], ...]
    before: Action | None = None


Step = Action | Exchange


def plans(schedule: Schedule, forward_only: bool = False) -> tuple[tuple[Step, ...], ...]:
    """Per pipeline rank, its actions with its exchanges between them (Note [ordered point-to-point]); with
    forward_only, the schedule's forwards alone (evaluation). A message between stages on one rank is no
    exchange: the runner hands it over in place."""
    lists = tuple(tuple(a for a in acts if a.kind is ActionKind.FORWARD or not forward_only)
                  for acts in schedule.actions)
    start = {a: round(t) - 1 for a, t in timeline(lists, schedule.stages, _ONE_STEP).items()}
    sends: dict[tuple[int, int], list] = defaultdict(list)  # (rank, round) -> [(peer, message)]
    receives: dict[tuple[int, int], list] = defaultdict(list)
    for rank, acts in enumerate(lists):
        for action in acts:
            message = message_in(action, schedule.stages)
            src = schedule.rank_of(message.stage) if message is not None else rank
            if src != rank:
                receives[(rank, start[action])].append((src, message))
                sends[(src, start[action])].append((rank, message))
    out = []
    for rank, acts in enumerate(lists):
        steps: list[Step] = []
        rounds = sorted({t for (r, t) in (*sends, *receives) if r == rank} | {start[a] for a in acts})
        by_start = {start[a]: a for a in acts}
        for t in rounds:
            if (rank, t) in sends or (rank, t) in receives:
                steps.append(Exchange(t, _ordered(sends.get((rank, t), [])), _ordered(receives.get((rank, t), [])),
                                      by_start.get(t)))
            if t in by_start:
                steps.append(by_start[t])
        out.append(tuple(steps))
    return tuple(out)


def _ordered(pairs: list) -> tuple:
    return tuple(sorted(pairs, key=lambda pair: (pair[0], pair[1].key())))


def check_pairing(schedule: Schedule, rank_plans: Sequence[Sequence[Step]]) -> None:
    """Raises ScheduleError unless, for every pair of ranks and every round, the messages one rank sends the other
    are, in order, the ones the other receives from it; each rank's rounds increase; every message is sent after
    the action making it and received before the action using it."""
    posted: dict[tuple[str, int, int, int], list[Message]] = defaultdict(list)  # (way, from, to, round)
    for rank, steps in enumerate(rank_plans):
        made: set[Message | None] = set()
        have: set[Message] = set()
        last_round = -1
        for step in steps:
            if isinstance(step, Action):
                needed = message_in(step, schedule.stages)
                if needed is not None and schedule.rank_of(needed.stage) != rank and needed not in have:
                    raise ScheduleError(f"rank {rank} runs {step} before receiving {needed}")
                made.add(message_out(step, schedule.stages))
                continue
            if step.round <= last_round:
                raise ScheduleError(f"rank {rank} posts round {step.round} after round {last_round}")
            last_round = step.round
            for peer, m in step.sends:
                if m not in made:
                    raise ScheduleError(f"rank {rank} sends {m} in round {step.round} before making it")
                posted[("send", rank, peer, step.round)].append(m)
            for peer, m in step.receives:
                posted[("receive", peer, rank, step.round)].append(m)
                have.add(m)
    for t, src, dst in sorted({(t, src, dst) for (_, src, dst, t) in posted}):  # the first mismatch
        sent, received = posted[("send", src, dst, t)], posted[("receive", src, dst, t)]
        if sent != received:
            raise ScheduleError(f"in round {t} rank {src} sends rank {dst} {'; '.join(map(str, sent)) or 'nothing'} "
                                f"but rank {dst} receives {'; '.join(map(str, received)) or 'nothing'}: NCCL "
                                "pairs sends and receives by their order, so each would get the other's bytes")


# ---- headers ---------------------------------------------------------------------------------------------------
def header(tensor: torch.Tensor, stage: int) -> torch.Tensor:
    """dtype code, ndim and sizes of `tensor` (what `stage` sends), as int64 on the CPU."""
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise ValueError(f"pipeline stage {stage} sends a {tensor.dtype} tensor of shape {tuple(tensor.shape)}; "
                         f"stages pass tensors of at most {_MAX_DIMS} dimensions in one of "
                         f"{', '.join(str(d) for d in _DTYPES)} (reshape or cast it in the stage)")
    out = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    out[0], out[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    out[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return out


def buffer_for(header_: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor of the dtype and shape a header describes."""
    code, ndim, *sizes = header_.tolist()
    return torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=device)


# ---- transports ----------------------------------------------------------------------------------------------
class PointToPoint(Protocol):
    """Posts one batch of sends and receives (peer pipeline rank, tensor) and returns the works to wait for."""

    def post(self, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> list: ...


@dataclass
class TorchPointToPoint:
    """One batch_isend_irecv over `group` (pipeline ranks in order; None: the default group)."""

    group: dist.ProcessGroup | None = None
    _global: dict[int, int] = field(default_factory=dict)

    def post(self, sends, receives) -> list:
        ops = ([dist.P2POp(dist.isend, t, self._peer(p), self.group) for p, t in sends]
               + [dist.P2POp(dist.irecv, t, self._peer(p), self.group) for p, t in receives])
        with record_function("tiers.pipeline.p2p"):
            return dist.batch_isend_irecv(ops)

    def _peer(self, pipeline_rank: int) -> int:
        if self.group is None:
            return pipeline_rank
        if pipeline_rank not in self._global:
            self._global[pipeline_rank] = dist.get_global_rank(self.group, pipeline_rank)
        return self._global[pipeline_rank]
