"""Sequence parallelism as a feature (Note [feature objects]): the forward takes this rank's part of each sequence,
runs its attention over the whole one (a checkpointed block's recompute too), and returns the whole sequence's
loss; the rank's gradient is weighted by its share of tokens."""

from __future__ import annotations

from torch import nn

from engine.comm import CommCounter
from engine.config_sections import Config
from engine.features import BuildContext, Feature, Features, RecomputeParts
from engine.mesh import Mesh
from engine.sequence_parallel.runtime import SequenceSplit, choose_mode


def split_sequences(model: nn.Module, cfg: Config, mesh: Mesh,
                    comm: CommCounter | None = None) -> SequenceSplit | None:
    """Note [sequence parallelism]: how this rank's part of each sequence is taken and its attention run; None
    without sequence parallelism. "auto" says which mode it chose."""
    sp = cfg.sequence_parallel
    if not sp.enabled:
        return None
    mode = choose_mode(sp.mode, model, sp.size, mesh.tp.size)
    if sp.mode == "auto" and mesh.world.rank == 0:
        print(f"[tiers] sequence_parallel.mode auto: {mode} over {sp.size} ranks (Ulysses when the model's attention "
              "heads per tensor-parallel rank divide by the size, else ring)", flush=True)
    return SequenceSplit(mesh.sp.group, sp.size, mesh.sp.rank, mode, model, comm)


class SequenceFeature(Feature):
    """Note [sequence parallelism]."""

    name = "sequence"

    def __init__(self, ctx: BuildContext):
        self.ctx = ctx
        self.parallel: SequenceSplit | None = None

    @classmethod
    def configured(cls, ctx: BuildContext) -> SequenceFeature | None:
        return cls(ctx) if ctx.cfg.sequence_parallel.enabled else None

    def build(self, model: nn.Module, before: Features) -> bool:
        self.parallel = split_sequences(model, self.ctx.cfg, self.ctx.mesh, self.ctx.comm)
        return True

    def recompute(self, parts: RecomputeParts) -> RecomputeParts:
        return parts.replace(context=self.parallel.attention)

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
