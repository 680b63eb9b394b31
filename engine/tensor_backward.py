"""PyTorch-style backward: `loss.backward()` (or `tensor.backward(grad)`) then `engine.step()`.

Note [tensor backward]
engine.backward(loss) multiplies the loss by the loss scale and by the accumulation and data-parallel
mean (and, under sequence parallelism, the rank's token weight) before autograd runs, inside the ZeRO
runtime's backward phase (which arms the gradient reduction and, at stage 3, the backward gathers).
A backward started on a tensor directly skips engine.backward, so the engine enters that phase from
autograd itself:
- a gradient hook on the forward's outputs (any of them) enters the phase when backward reaches the
  model, before any of its modules runs backward;
- a hook on every trainable parameter multiplies its gradient by the same factor engine.backward
  puts on the loss (the factor is linear, so the gradients equal engine.backward's up to rounding,
  also for loss terms that reach the parameters without passing through the outputs); the first
  such gradient also enters the phase if the outputs' hook did not;
- a callback queued on autograd's engine ends the phase when that backward finishes.
The loss scale (fp16) cannot be put on the gradients afterwards (they would underflow on the way):
as in DeepSpeed, the loss must be scaled with `engine.scale(loss)` first, and a backward under a loss
scale that did not is refused at its first parameter gradient, before anything is reduced or
updated. engine.scale puts the whole factor on the loss, as engine.backward does, and a hook on the
tensor it returns tells the backward that starts there to leave the gradients as they come: the
gradients are then engine.backward's to the bit. engine.moe.MoE's router losses are added by
engine.backward only, so a tensor backward with router losses pending is refused too. A backward
that gives no parameter a gradient (`torch.autograd.grad` over an output, e.g. a gradient penalty)
leaves the phase without reducing, and gradients torch.autograd.grad returns are never scaled.
A backward that raised never runs its callback: the next engine call abandons the phase, as a
failed engine.backward does.
"""

from __future__ import annotations

import enum
import weakref

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook

from engine.weak_hooks import WeakMethodHook
from engine.zero.param_gather import _tensors_in
from engine.zero.runtime import TrainingPhase, ZeroRuntime


class TensorBackwardState(enum.Enum):
    IDLE = "idle"  # no tensor backward running
    ENTERED = "entered"  # the phase is entered; no parameter gradient yet
    GRADIENTS = "gradients"  # parameter gradients are arriving


class TensorBackward:
    """Runs backward passes started on a tensor through the runtime's backward phase (Note [tensor backward])."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], runtime: ZeroRuntime, engine):
        """engine: gives `_gradient_factor()`, `_on_tensor_backward()`, `loss_scaler`,
        `is_gradient_accumulation_boundary()` and `experts`."""
        # weakly: the engine holds this object, and a cycle would keep a dropped engine's memory until gc runs
        self.runtime, self._engine = runtime, weakref.ref(engine)
        self.state = TensorBackwardState.IDLE
        self._reduces = False
        self._scaled = False  # the running backward started at a tensor engine.scale returned
        self._factor = 1.0
        self._handles = [module.register_forward_hook(_OutputsWatcher(self), prepend=True)]
        self._handles += [p.register_hook(WeakMethodHook(self._scale_gradient, p)) for p in params]

    def scaled(self, loss: torch.Tensor, factor: float) -> torch.Tensor:
        """`loss` times `factor` (the loss scale and engine.backward's factor), for a backward that starts there."""
        out = loss.float() * factor
        if out.requires_grad:
            out.register_hook(self._through_scaled)
        return out

    def settle(self) -> None:
        """Before an engine call: a tensor backward that raised left its phase entered; abandon it."""
        if self.state is not TensorBackwardState.IDLE:
            self.state, self._scaled = TensorBackwardState.IDLE, False
            self.runtime.abandon_backward(self._reduces, None)

    # ---- hooks -------------------------------------------------------------------------------------
    def _watch_outputs(self, module, args, output) -> None:
        if not torch.is_grad_enabled() or self.runtime.phase is TrainingPhase.BACKWARD:
            return  # no backward to come, or a recomputation inside one
        needing_grad = [t for t in _tensors_in(output) if t.requires_grad]
        if needing_grad:
            register_multi_grad_hook(needing_grad, lambda grads: self._enter(), mode="any")

    def _through_scaled(self, grad: torch.Tensor) -> None:
        if self.state is TensorBackwardState.IDLE and self.runtime.phase is TrainingPhase.BACKWARD:
            return  # engine.backward(engine.scale(loss)): scaled twice, as the two calls say
        self._enter()
        self._scaled = True

    def _scale_gradient(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
        if self.state is TensorBackwardState.IDLE and self.runtime.phase is TrainingPhase.BACKWARD:
            return None  # engine.backward scaled the loss
        if not _accumulates(param):
            return None  # torch.autograd.grad returns it to the caller
        self._enter()
        if self.state is TensorBackwardState.ENTERED:
            self._first_gradient()
        return grad * self._factor if self._factor != 1.0 else None

    # ---- the phase ---------------------------------------------------------------------------------
    def _enter(self) -> None:
        if self.state is not TensorBackwardState.IDLE or self.runtime.phase is TrainingPhase.BACKWARD:
            return  # entered already, or inside engine.backward
        engine = self._engine()
        self._reduces = self.runtime.begin_backward(engine.is_gradient_accumulation_boundary(),
                                                    engine.loss_scaler.scale)
        self.state = TensorBackwardState.ENTERED
        torch.autograd.Variable._execution_engine.queue_callback(self._exit)

    def _first_gradient(self) -> None:
        """The backward is a training one: refuse what it cannot get right before any gradient lands."""
        engine = self._engine()
        if engine.loss_scaler.scale != 1.0 and not self._scaled:
            raise RuntimeError(
                f"loss.backward() under a loss scale ({engine.loss_scaler.scale:g}, fp16) without engine.scale: "
                "the gradients would underflow unscaled; call engine.scale(loss).backward(), or "
                "engine.backward(loss)")
        if engine.features.take_aux_loss() is not None:
            raise RuntimeError(
                "loss.backward() with engine.moe.MoE router losses pending: engine.backward(loss) adds them to the "
                "loss; call engine.backward(loss) instead")
        self._factor = 1.0 if self._scaled else engine._gradient_factor()
        self.state = TensorBackwardState.GRADIENTS
        engine._on_tensor_backward()

    def _exit(self) -> None:
        gradients, self.state = self.state is TensorBackwardState.GRADIENTS, TensorBackwardState.IDLE
        self._scaled = False
        if gradients:
            self.runtime.end_backward(self._reduces)
        else:  # nothing to reduce (torch.autograd.grad over an output)
            self.runtime.abandon_backward(self._reduces, None)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ScheduledBackward:
    """In place of TensorBackward where a schedule runs every backward itself (a pipeline): nothing to watch;
    engine.scale is refused by the feature first (Note [feature objects])."""

    def settle(self) -> None:
        pass

    def remove_hooks(self) -> None:
        pass


class _OutputsWatcher:
    """The forward hook on the model. A copy of the model (deepcopy, pickle) is no longer the engine's: its copy
    of the hook watches nothing."""

    def __init__(self, owner: TensorBackward | None):
        self.owner = owner

    def __call__(self, module, args, output) -> None:
        if self.owner is not None:
            self.owner._watch_outputs(module, args, output)

    def __reduce__(self):
        return _OutputsWatcher, (None,)


def _accumulates(param: nn.Parameter) -> bool:
    """Whether the running backward accumulates into `param.grad`: a backward does, torch.autograd.grad does not
    (autograd refuses to answer for a leaf there, which is how it is told apart)."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError:
        return False
