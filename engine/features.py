"""What each parallelism adds to the engine's calls, as feature objects the engine iterates over.

Note [feature objects]
initialize() applies each parallelism to the model in one order (engine/initialization.py) and wraps what it returns
in a Feature: what it does to a forward's inputs, around the forward and to its output; how it weights the loss and
what it adds to it; how it joins a state dict gathered on this rank into the whole model's; what it logs; where it
places each tensor a rank holds and what else a checkpoint keeps of it (Note [placements]); whether it replaces the
per-micro-batch calls with a schedule (its `driver()`, whose stages then make the calls of the features applied
before it, the loss weight inside the last stage's loss: Note [a pipelined step]). The hooks and the drivers'
protocols live in engine/feature_base.py. Engine calls the `Features` collection, which folds each call over the
features in order (tensor, expert, sequence, pipeline parallelism), so Engine never asks which parallelism is on,
and a new one adds a Feature rather than branches.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from engine import whole_weights
from engine.comm import CommCounter
from engine.config_sections import PipelineConfig
from engine.feature_base import DriverContext, Feature, ForwardHooks, ScheduleDriver, StepContext
from engine.mesh import Mesh
from engine.moe.plan import ExpertParallel
from engine.pipeline.driver import PipelineDriver
from engine.pipeline.layer_major import LAYER_MAJOR, REFUSED_FORWARD, LayerMajorDriver
from engine.pipeline.model_split import PipelineModel, plan_block_stages, split_model
from engine.placement import Placement
from engine.sequence_parallel.runtime import SequenceSplit
from engine.tensor_backward import ScheduledBackward, TensorBackward
from engine.tensor_parallel import TensorParallel


class TensorParallelFeature(Feature):
    """Note [tensor-parallel plans]: every tp rank's shards join into whole weights."""

    name, joins_state_dict = "tensor_parallel", True

    def __init__(self, tensor_parallel: TensorParallel, device: torch.device):
        self.parallel, self.device = tensor_parallel, device

    def join_state_dict(self, whole: dict, keep: bool) -> dict:
        return self.parallel.join_state_dict(whole, self.device)

    def place(self, placed, tensors):
        tp, specs = self.parallel.tp, self.parallel.specs
        return {name: p.with_cut(specs.get(name), tp.rank, tp.size) for name, p in placed.items()}

    def layout(self) -> dict:
        return {"tp_mode": "2d" if self.parallel.mesh is not None else "1d"}

    def generators(self) -> list:
        return [self.parallel.streams] if self.parallel.streams is not None else []


class ExpertFeature(Feature):
    """Note [expert parallelism]: router losses join the loss, every ep rank's experts the state dict, and the
    experts' token counts the metrics."""

    name = "experts"

    def __init__(self, experts: ExpertParallel, mesh: Mesh, comm: CommCounter, logged: bool):
        self.parallel, self.mesh, self.comm, self.logged = experts, mesh, comm, logged
        self.joins_state_dict = experts.ep_size > 1

    def around_forward(self):
        return self.parallel.collecting()

    def take_aux_loss(self):
        return self.parallel.take_aux_loss()

    def join_state_dict(self, whole: dict, keep: bool) -> dict:
        if self.parallel.ep_size == 1:
            return whole
        return self.parallel.join_state_dict(whole, self.mesh.ep.group, self.comm, self.mesh.device)

    def chunked_keys(self, state: dict) -> set[str]:
        return {k for k in state if self.parallel.names_an_expert(k)}

    def place(self, placed, tensors):
        extents = self.parallel.extents()  # fused expert tensors: this rank's experts' range of the whole
        return {name: p.with_extent(*extents[id(tensors[name])]) if id(tensors[name]) in extents else p
                for name, p in placed.items()}

    def held_elsewhere(self, name: str) -> bool:
        return self.parallel.names_an_expert(name)

    def metrics(self) -> dict[str, float]:  # (a collective: every rank's counts; not a step's traffic)
        """Every layer's counts over the whole batch, as one process counts them: summed over the ranks routing
        other tokens (the dp group, which holds the sp ranks; tp ranks route the same ones), then over the
        pipeline stages (each counted only its own layers' tokens)."""
        if not self.logged:
            return {}
        groups = [self.mesh.zero.group] + ([self.mesh.pp.group] if self.mesh.pp.size > 1 else [])
        return self.parallel.metrics(groups, CommCounter(), self.mesh.device)


class SequenceFeature(Feature):
    """Note [sequence parallelism]: the forward takes this rank's part of each sequence, runs its attention over
    the whole one, and returns the whole sequence's loss; the rank's gradient is weighted by its share of tokens."""

    name = "sequence"

    def __init__(self, split: SequenceSplit):
        self.parallel = split

    def split_inputs(self, args, kwargs):
        return self.parallel.split(args, kwargs)

    def around_forward(self):
        return self.parallel.forward_context()

    def output(self, output):
        return self.parallel.whole_loss(output)

    def close(self) -> None:
        self.parallel.close()

    def loss_weight(self) -> float:
        return self.parallel.token_weight

    def scheduled_loss(self, loss):
        return self.parallel.scheduled_loss(loss)


class PipelineFeature(Feature):
    """Note [a pipelined step]: train_batch runs the schedule in place of the per-micro-batch calls; every stage's
    parameters join the state dict; the schedule's bubble is logged. Its driver is built on `attach`."""

    name, joins_state_dict = "pipeline", True

    def __init__(self, split: PipelineModel, shared_groups: dict, pipeline: PipelineConfig, microbatches: int,
                 mesh: Mesh, comm: CommCounter):
        """shared_groups: from shared_parameter_groups, one per set of pipeline ranks sharing parameters."""
        self.split, self.shared_groups, self.pipeline, self.microbatches = split, shared_groups, pipeline, microbatches
        self.mesh, self.comm = mesh, comm
        self.parallel: PipelineDriver | None = None
        self.whole_keys = frozenset(split.keys)  # every stage's

    def attach(self, step: StepContext, before: ForwardHooks) -> None:
        self.parallel = PipelineDriver(self.split, self.pipeline, self.microbatches, self.shared_groups,
                                       DriverContext(self.mesh, step.runtime, step.precision, self.comm, before,
                                                     step.loss_fn))

    def join_state_dict(self, whole: dict, keep: bool) -> dict:
        return whole_weights.join_stages(whole, self.split.keys, self.mesh, self.comm, keep)

    def metrics(self) -> dict[str, float]:
        if self.parallel is None or self.parallel.last_bubble is None:
            return {}
        return {"Pipeline/bubble_fraction": self.parallel.last_bubble,
                "Pipeline/bubble_fraction_formula": self.parallel.formula_bubble}

    def place(self, placed, tensors):
        return {name: p.on_stage(self.mesh.pp.rank) for name, p in placed.items()}

    def held_elsewhere(self, name: str) -> bool:
        return name in self.whole_keys

    def model_keys(self, keys: list[str]) -> list[str]:
        return list(self.split.keys)

    def stage(self) -> tuple[int, int]:
        return self.mesh.pp.rank, self.mesh.pp.size

    def driver(self) -> PipelineDriver | None:
        return self.parallel

    def check_micro_batch_call(self, call: str) -> None:
        raise RuntimeError(f"engine.{call} runs one micro-batch, and under a pipeline config a micro-batch runs "
                           "across every stage of the schedule; call engine.train_batch(data_iter) (or eval_batch) "
                           "once per step instead of forward, backward and step")


class LayerMajorFeature(Feature):
    """Note [layer-major accumulation]: train_batch runs a step's micro-batches block by block in place of the
    per-micro-batch calls; a forward without gradients still runs as usual. The blocks are split and the driver
    built on `attach`."""

    name = "layer_major"

    def __init__(self, model: nn.Module, outside: list | None, mesh: Mesh, comm: CommCounter):
        """outside: the modules outside the blocks (outside_modules, taken before the features changed the model)."""
        self.model, self.outside, self.mesh, self.comm = model, outside, mesh, comm
        self.parallel: LayerMajorDriver | None = None

    def attach(self, step: StepContext, before: ForwardHooks) -> None:
        split = split_model(self.model, plan_block_stages(self.model, LAYER_MAJOR, self.outside), 0, LAYER_MAJOR)
        self.parallel = LayerMajorDriver(split, DriverContext(self.mesh, step.runtime, step.precision, self.comm,
                                                              before, step.loss_fn))

    def driver(self) -> LayerMajorDriver | None:
        return self.parallel

    def check_micro_batch_call(self, call: str) -> None:
        if call == "forward" and not torch.is_grad_enabled():
            return
        raise RuntimeError(f"engine.{call}: {REFUSED_FORWARD}")

    def close(self) -> None:
        if self.parallel is not None:
            self.parallel.close()


class Features:
    """The run's feature objects, in the order initialize() applied them; each call folds over them."""

    def __init__(self, features: list[Feature]):
        self.items = list(features)

    def attach(self, step: StepContext) -> None:
        """Each feature's `attach`, in order, over the features before it."""
        for i, f in enumerate(self.items):
            f.attach(step, Features(self.items[:i]))

    def parallel(self, name: str):
        """The object a feature wraps (TensorParallel, ExpertParallel, SequenceSplit, PipelineDriver), or None."""
        return next((f.parallel for f in self.items if f.name == name), None)

    def split_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for f in self.items:
            args, kwargs = f.split_inputs(args, kwargs)
        return args, kwargs

    @contextlib.contextmanager
    def around_forward(self):
        with contextlib.ExitStack() as stack:
            for f in self.items:
                stack.enter_context(f.around_forward())
            yield

    def output(self, output):
        for f in self.items:
            output = f.output(output)
        return output

    def loss_weight(self) -> float:
        weight = 1.0
        for f in self.items:
            weight *= f.loss_weight()
        return weight

    def scheduled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        for f in self.items:
            loss = f.scheduled_loss(loss)
        return loss

    def take_aux_loss(self) -> torch.Tensor | None:
        losses = [loss for loss in (f.take_aux_loss() for f in self.items) if loss is not None]
        return sum(losses[1:], losses[0]) if losses else None

    @property
    def joins_state_dict(self) -> bool:
        return any(f.joins_state_dict for f in self.items)

    def join_state_dict(self, whole: dict, keep: bool) -> dict:
        for f in self.items:
            whole = f.join_state_dict(whole, keep)
        return whole

    def chunked_keys(self, state: dict) -> set[str]:
        return set().union(*(f.chunked_keys(state) for f in self.items))

    def metrics(self) -> dict[str, float]:
        return {k: v for f in self.items for k, v in f.metrics().items()}

    def check_micro_batch_call(self, call: str) -> None:
        for f in self.items:
            f.check_micro_batch_call(call)

    def close(self) -> None:
        for f in self.items:
            f.close()

    def placements(self, tensors: dict[str, torch.Tensor]) -> dict[str, Placement]:
        """Note [placements]: each of this rank's tensors (by name in the whole model) placed by every feature."""
        placed = {name: Placement(name) for name in tensors}
        for f in self.items:
            placed = f.place(placed, tensors)
        return placed

    def held_elsewhere(self, name: str) -> bool:
        return any(f.held_elsewhere(name) for f in self.items)

    def model_keys(self, keys: list[str]) -> list[str]:
        for f in self.items:
            keys = f.model_keys(keys)
        return keys

    def stage(self) -> tuple[int, int]:
        stage, stages = 0, 1
        for f in self.items:
            part, parts = f.stage()
            stage, stages = stage * parts + part, stages * parts
        return stage, stages

    def layout(self) -> dict:
        return {k: v for f in self.items for k, v in f.layout().items()}

    def generators(self) -> list:
        return [g for f in self.items for g in f.generators()]

    def schedule(self, call: str) -> ScheduleDriver:
        """The driver engine.`call` (train_batch, eval_batch) runs: a pipeline's, or layer-major accumulation's
        (Note [layer-major accumulation]); raises without either."""
        driver = self._scheduling_driver()
        if driver is None:
            raise RuntimeError(f"engine.{call} runs a step's micro-batches through a schedule, and this config has "
                               "none (pipeline.stages is 1, zero_optimization.offload_param.layer_major is false); "
                               "call the engine's forward, backward and step per micro-batch")
        return driver

    def tensor_backward(self, build: Callable) -> TensorBackward | ScheduledBackward:
        """build() (Note [tensor backward]), unless a schedule runs the micro-batches' backward passes itself."""
        return ScheduledBackward() if self._scheduling_driver() is not None else build()

    def _scheduling_driver(self) -> ScheduleDriver | None:
        return next((d for d in (f.driver() for f in self.items) if d is not None), None)
