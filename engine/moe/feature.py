"""Expert parallelism as a feature (Note [feature objects]): each MoE layer keeps this rank's experts; their
chunks are reduced and sharded over the ranks holding the same experts; router losses join the loss, every ep
rank's experts the state dict, and the experts' token counts the metrics."""

from __future__ import annotations

from torch import nn

from engine.comm import CommCounter
from engine.features import BuildContext, Feature, Features
from engine.moe.plan import ExpertParallel, apply_expert_parallel
from engine.zero.chunk_packing import ExpertChunks
from engine.zero.chunk_state import ShardPlace


class ExpertFeature(Feature):
    """Note [expert parallelism]: built on every run (the model's MoE layers route their tokens under any ep size);
    drops out when the model has no MoE layer Tiers routes."""

    name = "experts"

    def __init__(self, ctx: BuildContext):
        self.ctx, self.mesh, self.comm, self.logged = ctx, ctx.mesh, ctx.comm, ctx.cfg.tensorboard.enabled
        self.parallel: ExpertParallel | None = None

    @classmethod
    def configured(cls, ctx: BuildContext) -> ExpertFeature:
        return cls(ctx)

    @property
    def rebuilds_parameters(self) -> bool:
        return self.mesh.ep.size > 1

    @property
    def joins_state_dict(self) -> bool:
        return self.parallel is not None and self.parallel.ep_size > 1

    def build(self, model: nn.Module, before: Features) -> bool:
        """Under tensor parallelism the experts stay whole on every tp rank."""
        cfg = self.ctx.cfg
        self.parallel = apply_expert_parallel(model, cfg.moe, self.mesh, self.comm, before.cut_names(),
                                              cfg.pipeline.enabled)
        return self.parallel is not None

    def other_ranks_params(self) -> frozenset[int]:
        return self.parallel.dropped

    def holds(self, param: nn.Parameter) -> bool:
        return id(param) not in self.parallel.dropped

    def separate_chunks(self, sharded: bool) -> ExpertChunks | None:
        """With 2 or more ep ranks, expert chunks are reduced over (and with ZeRO sharded across) the ranks holding
        the same experts."""
        if self.mesh.ep.size == 1:
            return None
        edp = self.mesh.edp
        place = ShardPlace(edp.rank if sharded else 0, edp.size if sharded else 1, edp.group)
        return ExpertChunks(frozenset(id(p) for p in self.parallel.expert_params()), place)

    def norm_weights(self, weights: dict[int, float], model: nn.Module, chunked) -> dict[int, float]:
        """Unsharded, each rank holds the whole gradient: an expert's counts once over the ranks holding it, any
        other parameter once over the ZeRO group."""
        if not (chunked.has_experts and not chunked.sharded):
            return weights
        weights, chunk_of = dict(weights), chunked.chunk_index()
        for p in chunked.params:
            expert = chunked.states[chunk_of[id(p)]].place.group is not None
            share = 1.0 / (self.mesh.edp.size if expert else self.mesh.zero.size)
            weights[id(p)] = weights.get(id(p), 1.0) * share
        return weights

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
