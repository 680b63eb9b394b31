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
Sends are non-blocking (isend) and waited for at the end of the step; a receive waits for its data
(irecv, then wait). Every message carries a tag made of its kind, stage and micro-batch, so messages
between the same two ranks in both directions (interleaved stages) cannot be confused; its shape
and dtype go first in a small header (a tag of its own), so stages may change shapes. A schedule
`simulate` accepts cannot deadlock here: no send ever blocks, and each receive matches a send its peer issues in order.
A receive that waits longer than `timeout_s` (a peer that failed or hangs) raises PipelineTimeout
naming the action this rank is on and the stage, micro-batch and rank it waits for, instead of
hanging without a word.
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
from engine.pipeline.schedules import Action, ActionKind, Schedule
from engine.pipeline.simulate import simulate
from engine.pipeline.weight_grads import WeightPass
from engine.pipeline.weight_grads import input_grad as split_input_grad

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 8  # dtype code, ndim, up to 6 sizes


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


def _no_phase(action: Action):
    return contextlib.nullcontext()


class PipelineRunner:
    """Runs `schedule`'s actions for `rank` over `stages` (stage index -> function of (the received tensor, or
    None on stage 0; the micro-batch) giving the stage's output, or on the last stage its loss) in `group`
    (pipeline ranks in order; None: the default group). `params`: each stage's parameters, which W passes
    accumulate into; `around`: the context each action runs in (the engine's phases)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, StageFunction],
                 params: dict[int, list[nn.Parameter]], group: dist.ProcessGroup | None = None,
                 timeout_s: float = 600.0, device: torch.device | None = None,
                 around: Callable[[Action], contextlib.AbstractContextManager] = _no_phase,
                 counter: CommCounter | None = None):
        """timeout_s: how long a receive waits before PipelineTimeout names the action and what it waits for;
        device: where received tensors go (default: the first parameter's device, else the CPU); counter: where
        the bytes sent are counted (p2p_bytes)."""
        simulate(schedule)  # refuses an incomplete or deadlocking schedule before anything runs
        held = [s for s in range(schedule.stages) if schedule.rank_of(s) == rank]
        if sorted(stages) != held:
            raise ValueError(f"rank {rank} holds pipeline stage(s) {held} but was given modules for {sorted(stages)}; "
                             f"stage s lives on rank s mod {schedule.ranks}")
        self.schedule, self.rank, self.stages, self.params, self.group = schedule, rank, stages, params, group
        self.around, self.counter = around, counter
        self.last = schedule.stages - 1
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device or next((p.device for ps in params.values() for p in ps), torch.device("cpu"))
        self._action: Action | None = None  # the one running, for a timeout's report

    @classmethod
    def over_modules(cls, schedule: Schedule, rank: int, modules: dict[int, nn.Module],
                     loss_fn: Callable[[torch.Tensor, object], torch.Tensor], group: dist.ProcessGroup | None = None,
                     timeout_s: float = 600.0) -> "PipelineRunner":
        """A runner over stage modules called on a tensor, whose micro-batches are (input, target) pairs: stage 0
        takes the input, the last stage's output and the target go into loss_fn."""
        last = schedule.stages - 1

        def stage_function(s: int, module: nn.Module) -> StageFunction:
            def run(received, microbatch):
                out = module(microbatch[0] if received is None else received)
                return loss_fn(out, microbatch[1]) if s == last else out
            return run

        return cls(schedule, rank, {s: stage_function(s, m) for s, m in modules.items()},
                   {s: list(m.parameters()) for s, m in modules.items()}, group, timeout_s)

    def run(self, microbatches: list, loss_factor: float = 1.0, train: bool = True) -> StepResult:
        """One step over `microbatches` (every stage reads micro-batch j's object; stage 0 and the last use it);
        gradients of (loss_factor × each loss / m) accumulate in the stages' parameters. train=False runs the
        forwards only, without autograd."""
        kept: dict[tuple[int, int], _Kept] = {}
        sends: list[dist.Work] = []
        result = StepResult()
        start = time.perf_counter()
        with torch.set_grad_enabled(train and torch.is_grad_enabled()):
            for action in self.schedule.actions[self.rank]:
                if not train and action.kind is not ActionKind.FORWARD:
                    continue
                self._action = action
                if action.kind is ActionKind.FORWARD:
                    self._forward(action, microbatches, kept, sends, result, loss_factor, train)
                elif action.kind is ActionKind.BACKWARD_WEIGHT:
                    self._weight_grad(action, kept, result)
                else:
                    self._backward(action, kept, sends, result)
        for work in sends:
            work.wait()
        result.wall_s = time.perf_counter() - start
        return result

    @contextlib.contextmanager
    def _computing(self, action: Action, result: StepResult):
        """Runs the action's compute inside the caller's phase, counting its seconds."""
        start = time.perf_counter()
        try:
            with self.around(action):
                yield
        finally:
            result.compute_s += time.perf_counter() - start

    def _forward(self, a: Action, microbatches: list, kept, sends, result: StepResult, loss_factor: float,
                 train: bool) -> None:
        s, j = a.stage, a.microbatch
        x = None if s == 0 else self._recv(ActionKind.FORWARD, s - 1, j)
        if x is not None and train and x.is_floating_point():
            x.requires_grad_()
        with self._computing(a, result):
            out = self.stages[s](x, microbatches[j])
            if s == self.last:
                if out.dim() != 0:
                    raise ValueError(f"the last pipeline stage gave a loss of shape {tuple(out.shape)}; the loss must "
                                     "be a scalar (reduce it, e.g. .mean())")
                result.losses.append(out.item())
                out = out * (loss_factor / self.schedule.microbatches) if train else out
        if s != self.last:
            sends += self._send(out.detach(), ActionKind.FORWARD, s, j, s + 1)
        if train:
            kept[(s, j)] = _Kept(x if s > 0 else None, out)

    def _backward(self, a: Action, kept, sends, result: StepResult) -> None:
        """B (everything) or I (the input's gradient only, the graph kept for W)."""
        s, j = a.stage, a.microbatch
        k = kept[(s, j)] if a.kind is ActionKind.BACKWARD_INPUT else kept.pop((s, j))
        grad = None if s == self.last else self._recv(ActionKind.BACKWARD, s + 1, j)
        with self._computing(a, result):
            if a.kind is ActionKind.BACKWARD:
                torch.autograd.backward(k.output, grad)
                input_grad = k.input.grad if k.input is not None else None
            elif k.input is not None:  # Note [splitting backward into input and weight passes]
                input_grad, k.weight_pass = split_input_grad(k.output, grad, k.input, self._trainable(a.stage))
            else:
                input_grad, k.output_grad = None, grad
        if s > 0:
            sends += self._send(input_grad, ActionKind.BACKWARD, s, j, s - 1)

    def _weight_grad(self, a: Action, kept, result: StepResult) -> None:
        k = kept.pop((a.stage, a.microbatch))
        with self._computing(a, result):
            if k.weight_pass is not None:
                k.weight_pass.run()
            else:  # the first stage: no input path, so W is the whole backward
                torch.autograd.backward(k.output, k.output_grad, inputs=self._trainable(a.stage))

    def _trainable(self, stage: int) -> list[nn.Parameter]:
        return [p for p in self.params[stage] if p.requires_grad]

    # ---- point to point ----------------------------------------------------------------------------
    def _tag(self, kind: ActionKind, stage: int, microbatch: int) -> int:
        direction = 0 if kind is ActionKind.FORWARD else 1
        return (microbatch * self.schedule.stages + stage) * 2 + direction

    def _peer(self, stage: int) -> int:
        """The global rank of the pipeline rank holding `stage`."""
        pipeline_rank = self.schedule.rank_of(stage)
        return dist.get_global_rank(self.group, pipeline_rank) if self.group is not None else pipeline_rank

    def _send(self, tensor: torch.Tensor, kind: ActionKind, stage: int, microbatch: int, to_stage: int) -> list:
        tag, dst = self._tag(kind, stage, microbatch), self._peer(to_stage)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        payload = tensor.contiguous()
        if self.counter is not None:
            self.counter.p2p_bytes += header.numel() * header.element_size() + payload.numel() * payload.element_size()
        return [dist.isend(header.to(payload.device), dst, self.group, tag=2 * tag),
                dist.isend(payload, dst, self.group, tag=2 * tag + 1)]

    def _recv(self, kind: ActionKind, stage: int, microbatch: int) -> torch.Tensor:
        """What stage `stage` sent for micro-batch `microbatch` (its output, or its input's gradient)."""
        tag, src = self._tag(kind, stage, microbatch), self._peer(stage)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(header, src, self.group, tag=2 * tag), kind, stage, microbatch)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty([int(n) for n in header[2:2 + ndim]], dtype=dtype, device=self.device)
        self._wait(dist.irecv(tensor, src, self.group, tag=2 * tag + 1), kind, stage, microbatch)
        return tensor

    def _wait(self, work: dist.Work, kind: ActionKind, stage: int, microbatch: int) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            what = "output" if kind is ActionKind.FORWARD else "input gradient"
            raise PipelineTimeout(
                f"pipeline rank {self.rank} is on {self._action}, waiting for the {what} of stage {stage}, "
                f"micro-batch {microbatch}, from rank {self.schedule.rank_of(stage)}; nothing came in "
                f"{self.timeout.total_seconds():.0f} s: that rank failed or is stuck (its own report says on what)"
            ) from e
