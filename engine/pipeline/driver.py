"""engine.train_batch / eval_batch under a pipeline config: the step's micro-batches through the schedule, inside
the engine's phases, then what an update needs from every stage.

Note [a pipelined step]
train_batch pulls gradient_accumulation_steps micro-batches (m) from the iterator on every rank (every
stage reads the micro-batch's inputs itself: Note [pipeline stages of an unmodified model]) and runs
the schedule (Note [running a pipeline schedule]). Each forward runs inside the runtime's forward
phase and the precision's autocast, each backward inside its backward phase, the whole step inside
the runtime's accumulate_locally: under every ZeRO stage, gradients accumulate per stage over the m
micro-batches in the rank's full gradient chunks (stages 2 and 3 keep them live through the step)
and are reduced over the stage's data-parallel ranks once, by the update. Stage 3 gathers each
module's parameters around its forward and its backward as without a pipeline, prefetching by a
gather trace (Note [gather trace]) kept per stage and action kind: the schedule runs the same
actions every step, so each of them follows its own record instead of the stages' passes
interleaving in one. Each micro-batch's
loss enters backward multiplied by loss_scale / (m · dp), as engine.backward scales it. Before the
update, the gradients of a parameter two pipeline ranks hold are summed over them; the global norm
(clipping, fp16 overflow) sums the stages' squares (Note [global norm, unscaling and clipping]) with
such a parameter counted once, so every stage clips by the same factor and skips the same fp16 step.
The step's loss is the mean of the m micro-batch losses, sent from the last stage to every pipeline
rank and averaged over the data-parallel ranks, as DeepSpeed's train_batch returns it. Router losses the
stage's MoE layers add during its forward (moe.aux_loss_coef / z_loss_coef, Note [expert parallelism]) ride
on the stage's output into its backward (RouterLossCarrier), weighted loss_scale / (m · dp) as engine.backward
weighs them, on any stage: they leave the loss the step reports as the model's own. The measured
bubble (the share of the step a rank waits) is averaged over the pipeline ranks for TensorBoard, next
to the schedule's own fraction on unit costs.
Each stage's forward makes the calls the engine's forward makes around a micro-batch (Note [feature
objects]) with the features applied before the pipeline: their split of the micro-batch's inputs, the
context around the forward, and on the last stage their loss for a schedule (`scheduled_loss`). Under
sequence parallelism every stage takes this rank's part of the micro-batch's sequences (its global
positions, its shifted labels), runs its attention over the sequence group, and so sends on and receives
this rank's part of the hidden state; the last stage's loss has the whole sequence's value and the
gradient of this rank's loss times its token weight (Note [sequence parallelism]).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from engine.comm import CommCounter, all_reduce_sum, broadcast_from
from engine.config_sections import PipelineConfig
from engine.features import DriverContext
from engine.mesh import Mesh
from engine.pipeline.executor import PipelineRunner, RunnerLinks, StepResult
from engine.pipeline.model_split import PipelineModel
from engine.pipeline.schedules import Action, ActionKind, build_schedule
from engine.pipeline.simulate import simulate
from engine.pipeline.stage_modules import run_stage_view
from engine.precision import PrecisionPolicy

LossFunction = Callable[[object, object], torch.Tensor]


class PipelineDriver:
    """Runs a step's micro-batches through this rank's stages of `split` (Note [a pipelined step])."""

    def __init__(self, split: PipelineModel, pipeline: PipelineConfig, microbatches: int,
                 shared_groups: dict[tuple[int, ...], object], context: DriverContext):
        """pipeline: the schedule's name and the receives' timeout; shared_groups: from shared_parameter_groups, one
        per set of pipeline ranks sharing parameters."""
        mesh = context.mesh
        self.split, self.mesh, self.precision, self.comm = split, mesh, context.precision, context.comm
        self.loss_fn, self.features, runtime = context.loss_fn, context.features, context.runtime
        schedule_name, timeout_s, plan = pipeline.schedule, pipeline.timeout_s, split.plan
        self.schedule = build_schedule(schedule_name, plan.ranks, microbatches, plan.stages // plan.ranks)
        self.formula_bubble = simulate(self.schedule).bubble
        self.runtime = runtime
        stages = {s: self._stage_function(s) for s in split.views}
        params = {s: list(view.parameters()) for s, view in split.views.items()}
        self.runner = PipelineRunner(self.schedule, mesh.pp.rank, stages, params,
                                     RunnerLinks(mesh.pp.group, timeout_s, mesh.device, context.comm), self._phase)
        self.shared_groups = shared_groups
        self._loss_scale = 1.0
        self.last_bubble: float | None = None

    # ---- one step --------------------------------------------------------------------------------
    def train(self, microbatches: list, loss_scale: float) -> float:
        """Runs the schedule over `microbatches`, leaving the stages' gradients accumulated and shared parameters'
        gradients summed; returns the step's mean loss (on every rank)."""
        self._loss_scale = loss_scale
        self._set_mode(True)
        with self.runtime.accumulate_locally():
            result = self.runner.run(microbatches, loss_factor=loss_scale / self.mesh.zero.size)
        self._sum_shared_gradients()
        self.last_bubble = self._mean_over_pipeline(result.bubble)
        return self._step_loss(result)

    def evaluate(self, microbatches: list) -> float:
        """The forwards only, with the model in eval mode; returns the mean loss on every rank."""
        was_training = self.split.holder.training
        self._set_mode(False)
        try:
            result = self.runner.run(microbatches, train=False)
        finally:
            self._set_mode(was_training)
        return self._step_loss(result)

    def _set_mode(self, training: bool) -> None:
        self.split.holder.train(training)
        for view in self.split.views.values():  # the copies on the path to the blocks keep a flag of their own
            view.train(training)

    def _phase(self, action: Action):
        """The engine's phase for `action`; under stage 3 each (stage, kind) follows a gather trace of its own."""
        key = (action.stage, action.kind)
        if action.kind is ActionKind.FORWARD:
            return _forward_phase(self.runtime, self.precision, self.mesh.device, key)
        return self.runtime.backward(False, self._loss_scale, key)

    # ---- a stage's forward -----------------------------------------------------------------------
    def _stage_function(self, stage: int):
        view, state, last = self.split.views[stage], self.split.state, self.split.plan.stages - 1

        def run(received: torch.Tensor | None, microbatch) -> torch.Tensor:
            args, kwargs = microbatch_arguments(microbatch, with_loss_fn=self.loss_fn is not None)
            args, kwargs = self.features.split_inputs(args, kwargs)
            out, ran_to_end = run_stage_view(view, state, received, args, kwargs, self.features.around_forward)
            if not ran_to_end:
                return self._carrying_router_losses(out, last=False)
            if stage != last:
                raise RuntimeError(f"pipeline stage {stage}'s forward returned without reaching its last block; the "
                                   "model's forward skipped blocks of its block list")
            loss = self.features.scheduled_loss(self._loss(out, microbatch))
            return self._carrying_router_losses(loss, last=True)

        return run

    def _carrying_router_losses(self, out: torch.Tensor, last: bool) -> torch.Tensor:
        """`out`, whose backward also backpropagates the router losses of the forward that made it (the features'
        around_forward collects them), weighted as engine.backward weighs them: on the last stage as the loss (the
        runner scales it), elsewhere loss_scale / (m · dp); both times the features' loss weight (a sequence
        part's token weight)."""
        aux = self.features.take_aux_loss()
        if aux is None or not torch.is_grad_enabled():
            return out
        weight = self.features.loss_weight()
        scale = None if last else self._loss_scale / (self.schedule.microbatches * self.mesh.zero.size)
        return RouterLossCarrier.apply(out, aux.to(out.device), weight, scale)

    def _loss(self, out, microbatch) -> torch.Tensor:
        return loss_of(out, microbatch, self.loss_fn)

    # ---- what the stages share ---------------------------------------------------------------------
    def _sum_shared_gradients(self) -> None:
        params = self.split.param_by_id
        for pid, ranks in self.split.shared_here().items():
            p = params[pid]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            all_reduce_sum(p.grad, self.shared_groups[ranks], self.comm, async_op=False)

    def _mean_over_pipeline(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.mesh.device)
        all_reduce_sum(t, self.mesh.pp.group, self.comm, async_op=False)
        return t.item() / self.mesh.pp.size

    def _step_loss(self, result: StepResult) -> float:
        """The mean micro-batch loss, from the last stage to every pipeline rank, averaged over data parallel."""
        t = torch.tensor([sum(result.losses) / max(len(result.losses), 1)], dtype=torch.float64,
                         device=self.mesh.device)
        broadcast_from(t, self.mesh.pp.size - 1, self.mesh.pp.group, self.comm)
        if self.mesh.zero.size > 1:
            all_reduce_sum(t, self.mesh.zero.group, self.comm, async_op=False)
        return t.item() / self.mesh.zero.size


class RouterLossCarrier(torch.autograd.Function):
    """forward: `out` unchanged; backward: `out`'s gradient, and `aux`'s: `weight` × (`scale`, or (None) the
    gradient of a scalar `out`: the loss it is added to)."""

    @staticmethod
    def forward(ctx, out, aux, weight, scale):
        ctx.weight, ctx.scale = weight, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        upstream = grad if ctx.scale is None else torch.full((), ctx.scale, dtype=torch.float32, device=grad.device)
        return grad, upstream * ctx.weight, None, None


@contextlib.contextmanager
def _forward_phase(runtime, precision: PrecisionPolicy, device: torch.device, key):
    with runtime.forward(key), precision.autocast(device):
        yield


def loss_of(out, microbatch, loss_fn: LossFunction | None) -> torch.Tensor:
    """A micro-batch's loss from the model's output: loss_fn(output, micro-batch or its labels), else the output's
    own (`.loss`, a "loss" entry, or a scalar output)."""
    if loss_fn is not None:
        target = microbatch[1] if isinstance(microbatch, (tuple, list)) else microbatch
        return loss_fn(out, target)
    loss = out if torch.is_tensor(out) else getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not torch.is_tensor(loss) or loss.dim() != 0:
        raise ValueError(f"the model returned {type(out).__name__} without a scalar loss: "
                         "train_batch needs the loss from the model's output (pass labels in the "
                         "micro-batch, e.g. {\"input_ids\": x, \"labels\": y}) or initialize(..., loss_fn=f) "
                         "with f(output, micro-batch or its labels)")
    return loss


def microbatch_arguments(microbatch, with_loss_fn: bool) -> tuple[tuple, dict]:
    """The model's forward arguments from a micro-batch: keyword arguments from a dict; with a loss_fn, (inputs,
    labels) as DeepSpeed's pipeline takes them; else a tuple's elements as positional arguments, or one tensor."""
    if isinstance(microbatch, dict):
        return (), dict(microbatch)
    if isinstance(microbatch, (tuple, list)):
        inputs = microbatch[0] if with_loss_fn else microbatch
        return (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {})
    return (microbatch,), {}


def pull_microbatches(data_iter: Iterator, count: int) -> list:
    """`count` micro-batches from the iterator, or an error saying how many it had."""
    if data_iter is None or not hasattr(data_iter, "__next__"):
        raise TypeError(f"train_batch/eval_batch take an iterator over micro-batches (e.g. iter(loader)), got "
                        f"{type(data_iter).__name__}")
    batches = []
    for _ in range(count):
        try:
            batches.append(next(data_iter))
        except StopIteration:
            raise ValueError(f"the data iterator ran out after {len(batches)} of the step's {count} micro-batches "
                             "(gradient_accumulation_steps); give it whole steps") from None
    return batches


def sync_shared_values(split: PipelineModel, groups: dict[tuple[int, ...], dist.ProcessGroup],
                       comm: CommCounter, pending: set[int] = frozenset()) -> None:
    """A parameter several pipeline ranks hold starts from the lowest one's values (before it is chunked), except
    the `pending` ones (zero_init brings the same values to every rank later)."""
    params = split.param_by_id
    with torch.no_grad():
        for pid, ranks in split.shared_here().items():
            if pid not in pending:
                broadcast_from(params[pid].data, 0, groups[ranks], comm)


def shared_parameter_groups(split: PipelineModel, mesh: Mesh) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """One group per set of pipeline ranks sharing a parameter, within this rank's place in the other dimensions of
    the mesh (Note [one mesh])."""
    return {ranks: mesh.subgroup("pp", ranks) for ranks in sorted(set(split.shared.values()))}
