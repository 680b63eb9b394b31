"""The hooks a parallelism adds to the engine's calls (`Feature`, Note [feature objects]); what a driver that
schedules a step's micro-batches itself (a pipeline, layer-major accumulation) offers the engine (`ScheduleDriver`)
and calls on the features applied before it (`ForwardHooks`). Defined apart from engine/features.py, which holds
the features, the drivers' among them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from engine.mesh import Mesh
from engine.placement import Placement


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
    """One parallelism's part in the engine's calls; every default leaves the call as it is."""

    name = ""
    joins_state_dict = False  # whether a gathered state dict is only this rank's part of the whole model's

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
