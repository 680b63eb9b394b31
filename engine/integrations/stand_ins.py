"""Stand-ins a framework holds in place of the model and optimizer once a Tiers engine wraps them: the engine runs
the forward, reduces, steps and clears, so what the framework calls on these does nothing of its own."""

from __future__ import annotations

import contextlib

from torch import nn


class EngineModule(nn.Module):
    """What a framework calls as its model once the engine exists: the engine's forward, no gradient syncing of its
    own (the engine reduces at its boundary) and nothing to zero (the engine clears after each update)."""

    def __init__(self, engine):
        super().__init__()
        object.__setattr__(self, "engine", engine)  # not a submodule: the wrapped model's parameters stay its own

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> EngineModule:
        self.engine.train(mode)
        return super().train(mode)

    def no_sync(self):
        return contextlib.nullcontext()

    def _get_name(self) -> str:
        return self.engine.module._get_name()  # HF's Trainer tells causal LMs by it (label smoothing shifts labels)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class EngineOptimizer:
    """A framework's optimizer once the engine exists: the engine's param groups (what schedulers and learning-rate
    monitors read); stepping, zeroing and the states are the engine's own (its checkpoint holds them)."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    def step(self, closure=None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {}  # the engine's checkpoint holds the optimizer's states, in any layout
