"""colossalai.interface's ModelWrapper and OptimizerWrapper: what Booster.boost returns, over one Tiers engine.

The boosted model calls the engine's forward; the boosted optimizer's backward, step and zero_grad are the engine's
(every step() updates: the plugins' configs accumulate no micro-batches of their own, as ColossalAI's step does).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.compat.colossalai.unsupported import refuse


class ModelWrapper(nn.Module):
    """The boosted model: calls run the engine's forward (its precision, its parallelism); unwrap() is the model."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.module = engine.module
        self.pipeline_criterion = None  # under pipeline stages: the loss function execute_pipeline's criterion fills

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        return self.module

    def train(self, mode: bool = True) -> "ModelWrapper":
        self.engine.train(mode)
        self.training = mode
        return self


class OptimizerWrapper:
    """The boosted optimizer: the engine's backward, step and zero_grad; its param_groups are the engine
    optimizer's (a scheduler built on the optimizer the script passed drives them)."""

    def __init__(self, engine, max_norm: float, client_groups: list[tuple[list[str], dict]] | None = None):
        """client_groups: the script's optimizer's param groups as (parameter names, options), the numbering of
        ColossalAI's optimizer files (booster.save_optimizer / load_optimizer)."""
        self.engine, self.optim, self.max_norm = engine, engine.optimizer, max_norm
        self.client_groups = client_groups or []
        self._pipeline_stepped = False

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def defaults(self):
        return self.optim.defaults

    @property
    def parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optim.param_groups for p in group["params"]]

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        if args or kwargs:
            refuse("optimizer.backward(loss, inputs=..., retain_graph=...)", "call optimizer.backward(loss)")
        self.engine.backward(loss)

    def step(self, *args, **kwargs) -> None:
        if self._pipeline_stepped:  # execute_pipeline updated the model already (Tiers' train_batch)
            self._pipeline_stepped = False
            return
        self.engine.step()

    def zero_grad(self, *args, **kwargs) -> None:
        self.engine.zero_grad()

    def stepped_by_pipeline(self) -> None:
        """execute_pipeline ran the step's update: the script's step() after it has nothing left to do."""
        self._pipeline_stepped = True

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                          *args, **kwargs):
        """The engine clips in step() by the plugin's max_norm (Tiers' own argument on TorchDDPPlugin and
        TorchFSDPPlugin); a call asking for that norm is what step does, and returns None (the norm is measured in
        step(): get_grad_norm() after it)."""
        if norm_type != 2.0 or max_norm != self.max_norm:
            refuse(f"optimizer.clip_grad_by_norm({max_norm}, norm_type={norm_type}) with a plugin clipping at "
                   f"max_norm={self.max_norm}", f"give the plugin max_norm={max_norm} (it clips inside step(), over "
                   "every rank's shards; TorchDDPPlugin and TorchFSDPPlugin take it as Tiers' keyword), and keep "
                   "or drop this call")

    def clip_grad_by_value(self, clip_value: float, *args, **kwargs) -> None:
        refuse("optimizer.clip_grad_by_value", "clip by norm with the plugin's max_norm")

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs) -> float | None:
        return self.engine.get_global_grad_norm()

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim

    def state_dict(self):
        refuse("optimizer.state_dict() of a boosted optimizer (its states are sharded chunks)",
               "booster.save_optimizer(optimizer, path)")

    def load_state_dict(self, state_dict):
        refuse("optimizer.load_state_dict() of a boosted optimizer", "booster.load_optimizer(optimizer, path)")
