"""A parallelism's part in building the engine and in its calls, as feature objects (Note [feature objects]).

Note [feature objects]
Each parallelism, and activation checkpointing, is a Feature registered by one line in engine/feature_registry.py,
in the order initialize() applies them (tensor, expert, sequence parallelism, activation checkpointing, pipeline,
layer-major accumulation). The build hooks: `configured` (the feature when the config turns it on), `survey` (what
it needs of the model as the user built it), `build` (it changes the model, after the features before it, whose
`cut_names` and `recompute` it reads), and the hooks chunking reads (`other_ranks_params`, `holds`,
`whole_names`: which parameters are this rank's and their names in the whole model; `separate_chunks`: parameters
reduced and sharded over another group; `norm_weights`: each parameter's share in the global gradient norm). The
step hooks: what it does to a forward's inputs, around the forward and to its output; how it weights the loss and
what it adds to it; how it joins a state dict gathered on this rank into the whole model's; what it logs; where it
places each tensor a rank holds and what else a checkpoint keeps of it (Note [placements]); whether it replaces the
per-micro-batch calls with a schedule (its `driver()`, built on `attach` once the runtime exists, whose stages make
the calls of the features applied before it, the loss weight inside the last stage's loss: Note [a pipelined
step]). `Features` folds each hook over the features in order, so neither initialize() nor Engine asks which
parallelism is on, and a new one adds its package's Feature and a registry line rather than branches.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from engine.comm import CommCounter
from engine.config_sections import Config
from engine.mesh import Mesh
from engine.placement import Placement
from engine.plan import RunPlan
from engine.tensor_backward import ScheduledBackward, TensorBackward
from engine.zero.chunk_packing import ExpertChunks


@dataclass(frozen=True)
class BuildContext:
    """What every feature is configured and built with: the checked config, the run's plan, the mesh, the
    collectives' counter (zero_init's so far; its collectives are initialize's), and the ids of the parameters
    whose values zero_init brings later (the same on every rank: Note [zero_init])."""

    cfg: Config
    plan: RunPlan
    mesh: Mesh
    comm: CommCounter
    pending: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RecomputeParts:
    """What a checkpointed block's recompute takes from the features applied before activation checkpointing: the
    random streams it replays (engine.tensor_parallel.rng.RNGStreams), the group partition_activations splits saved
    inputs over (a TPGroup), and a context every recompute runs in besides the user's (sequence parallelism's split
    attention)."""

    streams: object = None
    partition_group: object = None
    context: Callable | None = None

    def replace(self, **changes) -> RecomputeParts:
        return dataclasses.replace(self, **changes)


class ForwardHooks(Protocol):
    """The calls a scheduling driver makes around each micro-batch's forward, in the features' order."""

    def split_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...

    def around_forward(self) -> contextlib.AbstractContextManager: ...

    def loss_weight(self) -> float: ...

    def scheduled_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def take_aux_loss(self) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class DriverContext:
    """What a scheduling driver runs each micro-batch with: the mesh, the engine's ZeRO runtime (whose phases every
    action runs in), the precision policy, the collectives' counter, the features applied before the driver (whose
    calls every forward makes: Note [a pipelined step]) and the loss function (None: the model's own loss)."""

    mesh: Mesh
    runtime: object
    precision: object
    comm: object
    features: ForwardHooks
    loss_fn: Callable | None = None


@dataclass(frozen=True)
class StepContext:
    """What a feature's `attach` gets once the engine's ZeRO runtime exists: the runtime, the precision policy and
    initialize's loss function (None: the model's own loss)."""

    runtime: object
    precision: object
    loss_fn: Callable | None = None


class ScheduleDriver(Protocol):
    """Runs a step's micro-batches through a schedule: engine.train_batch and eval_batch call it."""

    def train(self, microbatches: list, loss_scale: float) -> float: ...

    def evaluate(self, microbatches: list) -> float: ...


class Feature:
    """One parallelism's (or activation checkpointing's) part in building the engine and in its calls; every default
    leaves the build or the call as it is."""

    name = ""
    joins_state_dict = False  # whether a gathered state dict is only this rank's part of the whole model's
    rebuilds_parameters = False  # whether build() replaces the model's parameters (Note [a bounded start])

    # ---- building (initialize, in the registry's order) -----------------------------------------------------

    @classmethod
    def configured(cls, ctx: BuildContext) -> Feature | None:
        """This feature when the config turns it on; None: off."""
        return None

    def survey(self, model: nn.Module) -> None:
        """Takes what the build needs of the model as the user built it, before any feature changes it."""

    def build(self, model: nn.Module, before: Features) -> bool:
        """Applies this feature to the model, after the features `before` it; False: the model has nothing for it,
        and the feature drops out."""
        return True

    def cut_names(self) -> frozenset[str]:
        """Names of the parameters this feature split across ranks (which expert parallelism keeps whole)."""
        return frozenset()

    def recompute(self, parts: RecomputeParts) -> RecomputeParts:
        """What a checkpointed block's recompute needs from this feature, added to `parts`."""
        return parts

    def other_ranks_params(self) -> frozenset[int]:
        """Ids of the model's parameters this feature took out of it because other ranks hold them (a client's
        param groups may name them)."""
        return frozenset()

    def holds(self, param: nn.Parameter) -> bool:
        """Whether this rank's part of the model holds `param`."""
        return True

    def whole_names(self) -> dict[int, str] | None:
        """id(parameter) -> its name in the whole model, for every parameter of it, when this rank's model holds
        only a part of it (None: the model is whole, its own names are the whole model's)."""
        return None

    def separate_chunks(self, sharded: bool) -> ExpertChunks | None:
        """Parameters whose chunks are reduced (and, when `sharded`, sharded) over a group of their own."""
        return None

    def norm_weights(self, weights: dict[int, float], model: nn.Module, chunked) -> dict[int, float]:
        """Each parameter's weight in the global gradient norm (default 1), with this feature's share: a
        parameter other ranks also hold counts once. chunked: the ChunkedParams the weights are for."""
        return weights

    # ---- the engine's calls ---------------------------------------------------------------------------------

    def split_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def around_forward(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def output(self, output):
        return output

    def loss_weight(self) -> float:
        return 1.0

    def scheduled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as a pipeline's last stage backpropagates it (Note [a pipelined step]): valued as
        output() values it, with the gradient loss_weight() gives engine.backward's."""
        return loss

    def take_aux_loss(self) -> torch.Tensor | None:
        return None

    def join_state_dict(self, whole: dict, keep: bool) -> dict:
        return whole

    def close(self) -> None:
        """Removes what the feature installed on the model (Engine.close)."""

    def chunked_keys(self, state: dict) -> set[str]:
        """Keys of `state` that other ranks' chunks hold (saved in the compute dtype like this rank's)."""
        return set()

    def metrics(self) -> dict[str, float]:
        return {}

    def check_micro_batch_call(self, call: str) -> None:
        """Raises when engine.`call` (forward, backward, step, scale) cannot run one micro-batch alone."""

    def place(self, placed: dict[str, Placement], tensors: dict[str, torch.Tensor]) -> dict[str, Placement]:
        """Each tensor's placement (Note [placements]) with this parallelism's part added."""
        return placed

    def held_elsewhere(self, name: str) -> bool:
        """Whether `name`, a tensor of the whole model that this rank lacks, is one another rank holds."""
        return False

    def model_keys(self, keys: list[str]) -> list[str]:
        """The whole model's state-dict keys, given this rank's model's."""
        return keys

    def stage(self) -> tuple[int, int]:
        """(this rank's part, the parts) of a model whose parts keep optimizer options and schedules apart."""
        return 0, 1

    def layout(self) -> dict:
        """What a checkpoint's manifest records of this parallelism's layout, besides the placements."""
        return {}

    def generators(self) -> list:
        """The random streams (engine.tensor_parallel.rng.RNGStreams) this parallelism draws from."""
        return []

    def attach(self, step: StepContext, before: ForwardHooks) -> None:
        """Builds what needs the runtime, once it exists (a scheduling driver, over `before`: the features applied
        before this one)."""

    def driver(self) -> ScheduleDriver | None:
        """The driver that runs a step's micro-batches when this feature schedules them (Note [a pipelined step])."""
        return None


class Features:
    """The run's feature objects, in the order initialize() applied them; each call folds over them."""

    def __init__(self, features: list[Feature]):
        self.items = list(features)

    def attach(self, step: StepContext) -> None:
        """Each feature's `attach`, in order, over the features before it."""
        for i, f in enumerate(self.items):
            f.attach(step, Features(self.items[:i]))

    # ---- building -------------------------------------------------------------------------------------------

    def cut_names(self) -> frozenset[str]:
        return frozenset().union(*(f.cut_names() for f in self.items))

    def recompute(self) -> RecomputeParts:
        parts = RecomputeParts()
        for f in self.items:
            parts = f.recompute(parts)
        return parts

    def other_ranks_params(self) -> frozenset[int]:
        return frozenset().union(*(f.other_ranks_params() for f in self.items))

    def holds(self, param: nn.Parameter) -> bool:
        return all(f.holds(param) for f in self.items)

    def whole_names(self) -> dict[int, str] | None:
        return next((n for n in (f.whole_names() for f in self.items) if n is not None), None)

    def separate_chunks(self, sharded: bool) -> ExpertChunks | None:
        return next((c for c in (f.separate_chunks(sharded) for f in self.items) if c is not None), None)

    def norm_weights(self, model: nn.Module, chunked) -> dict[int, float]:
        weights: dict[int, float] = {}
        for f in self.items:
            weights = f.norm_weights(weights, model, chunked)
        return weights

    # ---- the engine's calls ---------------------------------------------------------------------------------

    def parallel(self, name: str):
        """The object a feature wraps (TensorParallel, ExpertParallel, SequenceSplit, ActivationCheckpointing,
        PipelineDriver), or None."""
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
