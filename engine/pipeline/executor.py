"""Running one rank's part of a pipeline schedule over the stage modules it holds.

Note [running a pipeline schedule]
Each rank walks its action list (Note [pipeline schedules as data]) in order:
- F(s, j): stage s's input is micro-batch j's (stage 0) or what stage s - 1 sent; the rank runs
  the stage on it (a function of the received tensor and the micro-batch), keeps the input and
  output for the backward, and sends the output (detached) to the rank of stage s + 1; the last
  stage's function gives micro-batch j's loss, which it keeps, times loss_factor / m (the step's
  loss is the mean over its micro-batches, as DeepSpeed's train_batch reports it).
- B(s, j): autograd's backward from the loss (last stage) or from the output with the gradient
  stage s + 1 sent; the input's gradient goes to the rank of stage s - 1. Parameter gradients
  accumulate over the micro-batches in .grad, as gradient accumulation does.
- I(s, j) and W(s, j) (zero bubble) split that: I computes the input's gradient only and sends it;
  W accumulates the parameters' gradients from what I left at the nodes where their branches join
  the input's path (Note [splitting backward into input and weight passes]) and frees what the
  micro-batch kept.
Between the actions the rank runs the exchanges of its plan (Note [ordered point-to-point]): each
message goes in one batch_isend_irecv, in the round its consumer starts, posted in the same order by the
sender and the receiver, with no tags, which is what makes it pair correctly on NCCL; its dtype and shape go
first in a small header batch, so stages may change shapes. A rank waits for an exchange in which it receives
(the next action needs the tensor); sends are waited for at the end of the step. A schedule `simulate` accepts
cannot deadlock here (the note says why). A message between two stages on one rank is handed over in place.
A wait longer than `timeout_s` (a peer that failed or hangs) raises PipelineTimeout naming the action
this rank is on and the stage, micro-batch and rank it waits for, instead of hanging without a word.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import CommCounter
from engine.pipeline.p2p import (
    HEADER_SIZE,
    Exchange,
    Message,
    PointToPoint,
    TorchPointToPoint,
    buffer_for,
    check_pairing,
    header,
    message_in,
    message_out,
    plans,
)
from engine.pipeline.schedules import Action, ActionKind, Schedule
from engine.pipeline.simulate import simulate
from engine.pipeline.weight_grads import WeightPass
from engine.pipeline.weight_grads import input_grad as split_input_grad

StageFunction = Callable[[torch.Tensor | None, object], torch.Tensor]


@dataclass
class _Kept:
    """What a micro-batch's forward on one stage kept for its backward."""

    input: torch.Tensor | None
    output: torch.Tensor  # the stage's output, or the loss on the last stage
    output_grad: torch.Tensor | None = None  # kept by I for W (None on the last stage: the loss)
    weight_pass: WeightPass | None = None  # kept by I for W where the stage has an input path


class PipelineTimeout(RuntimeError):
    """A receive waited longer than the runner's timeout: names the action running and what it waits for."""


@dataclass
class StepResult:
    losses: list[float] = field(default_factory=list)  # the last stage's per-micro-batch losses (others: empty)
    compute_s: float = 0.0  # seconds in this rank's actions, receives excluded
    wall_s: float = 0.0  # seconds of the whole step on this rank, the final wait for sends included

    @property
    def bubble(self) -> float:
        """The measured bubble: the share of the step this rank spent waiting instead of computing."""
        return 1.0 - self.compute_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _Step:
    """One step's state on this rank."""

    result: StepResult
    kept: dict[tuple[int, int], _Kept] = field(default_factory=dict)
    outbox: dict[Message, torch.Tensor] = field(default_factory=dict)  # made here, until their exchange
    inbox: dict[Message, torch.Tensor] = field(default_factory=dict)  # received, until their action
    sending: list = field(default_factory=list)  # works of batches that only send, and their tensors


def _no_phase(action: Action):
    return contextlib.nullcontext()


@dataclass(frozen=True)
class RunnerLinks:
    """How a runner exchanges tensors with the other pipeline ranks. group: the pipeline ranks in order (None: the
    default group); timeout_s: how long a receive waits before PipelineTimeout names the action and what it waits
    for; device: where received tensors go (default: the first parameter's device, else the CPU); counter: where
    the bytes sent are counted (p2p_bytes); transport: what posts the batches (default: batch_isend_irecv over
    `group`)."""

    group: dist.ProcessGroup | None = None
    timeout_s: float = 600.0
    device: torch.device | None = None
    counter: CommCounter | None = None
    transport: PointToPoint | None = None


class PipelineRunner:
    """Runs `schedule`'s actions for `rank` over `stages` (stage index -> function of (the received tensor, or
    None on stage 0; the micro-batch) giving the stage's output, or on the last stage its loss), exchanging
    tensors over `links`. `params`: each stage's parameters, which W passes accumulate into; `around`: the context
    each action runs in (the engine's phases)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, StageFunction],
                 params: dict[int, list[nn.Parameter]], links: RunnerLinks | None = None,
                 around: Callable[[Action], contextlib.AbstractContextManager] = _no_phase):
        links = links if links is not None else RunnerLinks()
        simulate(schedule)  # refuses an incomplete or deadlocking schedule before anything runs
        held = [s for s in range(schedule.stages) if schedule.rank_of(s) == rank]
        if sorted(stages) != held:
            raise ValueError(f"rank {rank} holds pipeline stage(s) {held} but was given modules for {sorted(stages)}; "
                             f"stage s lives on rank s mod {schedule.ranks}")
        self.schedule, self.rank, self.stages, self.params = schedule, rank, stages, params
        self.around, self.counter = around, links.counter
        self.transport = links.transport or TorchPointToPoint(links.group)
        self.plans = {}  # train -> this rank's actions and exchanges (Note [ordered point-to-point])
        for train in (True, False):
            every_rank = plans(schedule, forward_only=not train)
            check_pairing(schedule, every_rank)
            self.plans[train] = every_rank[rank]
        self.last = schedule.stages - 1
        self.timeout = timedelta(seconds=links.timeout_s)
        self.device = links.device or next((p.device for ps in params.values() for p in ps), torch.device("cpu"))
        self._action: Action | None = None  # the one running, for a timeout's report

    @classmethod
    def over_modules(cls, schedule: Schedule, rank: int, modules: dict[int, nn.Module],
                     loss_fn: Callable[[torch.Tensor, object], torch.Tensor], group: dist.ProcessGroup | None = None,
                     timeout_s: float = 600.0, transport: PointToPoint | None = None) -> "PipelineRunner":
        """A runner over stage modules called on a tensor, whose micro-batches are (input, target) pairs: stage 0
        takes the input, the last stage's output and the target go into loss_fn."""
        last = schedule.stages - 1

        def stage_function(s: int, module: nn.Module) -> StageFunction:
            def run(received, microbatch):
                out = module(microbatch[0] if received is None else received)
                return loss_fn(out, microbatch[1]) if s == last else out
            return run

        return cls(schedule, rank, {s: stage_function(s, m) for s, m in modules.items()},
                   {s: list(m.parameters()) for s, m in modules.items()},
                   RunnerLinks(group, timeout_s, transport=transport))

    def run(self, microbatches: list, loss_factor: float = 1.0, train: bool = True) -> StepResult:
        """One step over `microbatches` (every stage reads micro-batch j's object; stage 0 and the last use it);
        gradients of (loss_factor × each loss / m) accumulate in the stages' parameters. train=False runs the
        forwards only, without autograd."""
        step = _Step(StepResult())
        start = time.perf_counter()
        with torch.set_grad_enabled(train and torch.is_grad_enabled()):
            for item in self.plans[train]:
                if isinstance(item, Exchange):
                    self._action = item.before
                    self._exchange(item, step)
                    continue
                self._action = item
                if item.kind is ActionKind.FORWARD:
                    self._forward(item, microbatches, step, loss_factor, train)
                elif item.kind is ActionKind.BACKWARD_WEIGHT:
                    self._weight_grad(item, step)
                else:
                    self._backward(item, step)
        self._action = None
        for works, _tensors in step.sending:
            self._wait(works, None)
        step.result.wall_s = time.perf_counter() - start
        return step.result

    @contextlib.contextmanager
    def _computing(self, action: Action, result: StepResult):
        """Runs the action's compute inside the caller's phase, counting its seconds."""
        start = time.perf_counter()
        try:
            with self.around(action):
                yield
        finally:
            result.compute_s += time.perf_counter() - start

    def _forward(self, a: Action, microbatches: list, step: _Step, loss_factor: float, train: bool) -> None:
        s, j = a.stage, a.microbatch
        x = None if s == 0 else step.inbox.pop(message_in(a, self.schedule.stages))
        if x is not None and train and x.is_floating_point():
            x.requires_grad_()
        with self._computing(a, step.result):
            out = self.stages[s](x, microbatches[j])
            if s == self.last:
                if out.dim() != 0:
                    raise ValueError(f"the last pipeline stage gave a loss of shape {tuple(out.shape)}; the loss must "
                                     "be a scalar (reduce it, e.g. .mean())")
                step.result.losses.append(out.item())
                out = out * (loss_factor / self.schedule.microbatches) if train else out
        if s != self.last:
            self._made(message_out(a, self.schedule.stages), out.detach(), step)
        if train:
            step.kept[(s, j)] = _Kept(x if s > 0 else None, out)

    def _backward(self, a: Action, step: _Step) -> None:
        """B (everything) or I (the input's gradient only, the graph kept for W)."""
        s, j = a.stage, a.microbatch
        k = step.kept[(s, j)] if a.kind is ActionKind.BACKWARD_INPUT else step.kept.pop((s, j))
        grad = None if s == self.last else step.inbox.pop(message_in(a, self.schedule.stages))
        with self._computing(a, step.result):
            if a.kind is ActionKind.BACKWARD:
                torch.autograd.backward(k.output, grad)
                input_grad = k.input.grad if k.input is not None else None
            elif k.input is not None:  # Note [splitting backward into input and weight passes]
                input_grad, k.weight_pass = split_input_grad(k.output, grad, k.input, self._trainable(a.stage))
            else:
                input_grad, k.output_grad = None, grad
        if s > 0:
            self._made(message_out(a, self.schedule.stages), input_grad, step)

    def _weight_grad(self, a: Action, step: _Step) -> None:
        k = step.kept.pop((a.stage, a.microbatch))
        with self._computing(a, step.result):
            if k.weight_pass is not None:
                k.weight_pass.run()
            else:  # the first stage: no input path, so W is the whole backward
                torch.autograd.backward(k.output, k.output_grad, inputs=self._trainable(a.stage))

    def _trainable(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.params[stage] if p.requires_grad]

    # ---- point to point (Note [ordered point-to-point]) --------------------------------------------
    def _made(self, message: Message, tensor: torch.Tensor, step: _Step) -> None:
        """A tensor an action made for another stage: for its exchange, or straight to a stage on this rank (a copy,
        as a receive would give)."""
        if self.schedule.rank_of(message.to_stage) == self.rank:
            step.inbox[message] = tensor.detach().clone()
        else:
            step.outbox[message] = tensor.contiguous()

    def _exchange(self, exchange: Exchange, step: _Step) -> None:
        """The exchange's headers, then its payloads, each one batch; waits where it receives."""
        payloads = [(peer, step.outbox.pop(m)) for peer, m in exchange.sends]
        headers = [(peer, header(t, m.stage).to(t.device)) for (peer, t), (_, m) in zip(payloads, exchange.sends)]
        incoming = [(peer, torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device))
                    for peer, _ in exchange.receives]
        self._batch(headers, incoming, exchange, step)
        buffers = [(peer, buffer_for(h, self.device)) for peer, h in incoming]
        if self.counter is not None:
            self.counter.p2p_bytes += sum(h.numel() * h.element_size() + t.numel() * t.element_size()
                                          for (_, h), (_, t) in zip(headers, payloads))
        self._batch(payloads, buffers, exchange, step)
        for (_, m), (_, t) in zip(exchange.receives, buffers):
            step.inbox[m] = t

    def _batch(self, sends: list, receives: list, exchange: Exchange, step: _Step) -> None:
        works = self.transport.post(sends, receives)
        if receives:
            self._wait(works, exchange)
        else:
            step.sending.append((works, sends))  # the tensors stay alive until the end of the step

    def _wait(self, works: list, exchange: Exchange | None) -> None:
        try:
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise PipelineTimeout(self._waiting(exchange) + f"; nothing came in {self.timeout.total_seconds():.0f} s: "
                                  "that rank failed or is stuck (its own report says on what)") from e

    def _waiting(self, exchange: Exchange | None) -> str:
        if exchange is None:
            return f"pipeline rank {self.rank} finished its actions and waits for its sends to be received"
        what = " and ".join(f"{message}, from rank {peer}" for peer, message in exchange.receives)
        return f"pipeline rank {self.rank} is on {self._action}, waiting for {what}"
