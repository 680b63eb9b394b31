"""Activation checkpointing as a feature (Note [feature objects]): built after the parallelisms that change what a
recompute must replay (tensor parallelism's random streams and group, sequence parallelism's split attention),
which it reads through their `recompute` hooks, and before a pipeline cuts the model into stages."""

from __future__ import annotations

from torch import nn

from engine.activation_checkpointing.checkpointer import ActivationCheckpointing
from engine.config_sections import Config
from engine.features import BuildContext, Feature, Features, RecomputeParts
from engine.mesh import Mesh


def apply_activation_checkpointing(model: nn.Module, cfg: Config, mesh: Mesh,
                                   parts: RecomputeParts | None = None) -> ActivationCheckpointing:
    """Note [activation checkpointing]: the config's options; when enabled, the model's blocks (or the modules
    the config names) wrapped so that they keep only their inputs (and recompute with `parts`: the features'
    random streams, partition group and recompute context)."""
    parts = parts if parts is not None else RecomputeParts()
    checkpointing = ActivationCheckpointing(cfg.activation_checkpointing, mesh.device, parts.streams,
                                            parts.partition_group, parts.context)
    if cfg.activation_checkpointing.enabled:
        checkpointing.wrap_modules(model)
    return checkpointing


class ActivationCheckpointingFeature(Feature):
    """Built on every run: engine.activation_checkpoint takes the config's options even when no module is wrapped."""

    name = "activation_checkpointing"

    def __init__(self, ctx: BuildContext):
        self.ctx = ctx
        self.parallel: ActivationCheckpointing | None = None

    @classmethod
    def configured(cls, ctx: BuildContext) -> ActivationCheckpointingFeature:
        return cls(ctx)

    def build(self, model: nn.Module, before: Features) -> bool:
        self.parallel = apply_activation_checkpointing(model, self.ctx.cfg, self.ctx.mesh, before.recompute())
        return True
