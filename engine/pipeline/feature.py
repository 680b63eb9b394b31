"""Pipeline parallelism and layer-major accumulation as features (Note [feature objects]): each cuts the model at
its block list and runs a step's micro-batches through a schedule (its driver, built on `attach` over the features
applied before it) in place of the per-micro-batch calls."""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine import whole_weights
from engine.comm import CommCounter
from engine.config_sections import Config
from engine.features import BuildContext, DriverContext, Feature, Features, ForwardHooks, StepContext
from engine.mesh import Mesh
from engine.pipeline.block_timing import measured_costs
from engine.pipeline.driver import PipelineDriver, shared_parameter_groups, sync_shared_values
from engine.pipeline.layer_major import LAYER_MAJOR, REFUSED_FORWARD, LayerMajorDriver
from engine.pipeline.model_split import PipelineModel, outside_modules, plan_block_stages, plan_stages, split_model


def split_pipeline(model: nn.Module, cfg: Config, mesh: Mesh, comm: CommCounter,
                   pending: set[int] = frozenset(),
                   outside: list | None = None) -> tuple[PipelineModel | None, dict]:
    """Note [pipeline stages of an unmodified model]: `model` keeps what this rank's pipeline stages hold, and
    the views those stages run, with the groups of the pipeline ranks sharing parameters, which start from the
    lowest one's values (`pending`: ids of parameters whose values zero_init brings later, the same on every
    rank: Note [zero_init]); (None, {}) without a pipeline config. outside: outside_modules of the model as the
    user built it."""
    if not cfg.pipeline.enabled:
        return None, {}
    micro_batch = cfg.batch_sizes(mesh.dp.size).micro_batch_size
    measure = functools.partial(measured_costs, model, micro_batch=micro_batch, device=mesh.device)
    split = split_model(model, plan_stages(model, cfg.pipeline, measure, outside), mesh.pp.rank)
    groups = shared_parameter_groups(split, mesh)
    sync_shared_values(split, groups, comm, pending)
    return split, groups


class PipelineFeature(Feature):
    """Note [a pipelined step]: train_batch runs the schedule in place of the per-micro-batch calls; every stage's
    parameters join the state dict; a parameter several stages hold counts once in the global norm; the schedule's
    bubble is logged. Its driver is built on `attach`."""

    name, joins_state_dict, rebuilds_parameters = "pipeline", True, True

    def __init__(self, ctx: BuildContext):
        self.ctx, self.mesh, self.comm = ctx, ctx.mesh, ctx.comm
        self.outside: list | None = None
        self.split: PipelineModel | None = None
        self.shared_groups: dict = {}  # from shared_parameter_groups, one per set of pipeline ranks sharing parameters
        self.vacated: frozenset[int] = frozenset()
        self.whole_keys: frozenset[str] = frozenset()
        self.parallel: PipelineDriver | None = None

    @classmethod
    def configured(cls, ctx: BuildContext) -> PipelineFeature | None:
        return cls(ctx) if ctx.cfg.pipeline.enabled else None

    def survey(self, model: nn.Module) -> None:
        self.outside = outside_modules(model, "pipeline")

    def build(self, model: nn.Module, before: Features) -> bool:
        whole = [id(p) for p in model.parameters()]
        self.split, self.shared_groups = split_pipeline(model, self.ctx.cfg, self.mesh, self.comm,
                                                        pending=set(self.ctx.pending), outside=self.outside)
        self.vacated = frozenset(pid for pid in whole if pid not in self.split.param_by_id)
        self.whole_keys = frozenset(self.split.keys)  # every stage's
        return True

    def other_ranks_params(self) -> frozenset[int]:
        return self.vacated

    def holds(self, param: nn.Parameter) -> bool:
        return self.split.holds(param)

    def whole_names(self) -> dict[int, str]:
        return self.split.names

    def norm_weights(self, weights: dict[int, float], model: nn.Module, chunked) -> dict[int, float]:
        """The lowest pipeline rank holding a shared parameter counts it."""
        weights = dict(weights)
        for pid, ranks in self.split.shared_here().items():
            if self.mesh.pp.rank != ranks[0]:
                weights[pid] = 0.0
        return weights

    def attach(self, step: StepContext, before: ForwardHooks) -> None:
        microbatches = self.ctx.plan.batch.gradient_accumulation_steps
        self.parallel = PipelineDriver(self.split, self.ctx.cfg.pipeline, microbatches, self.shared_groups,
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

    def __init__(self, ctx: BuildContext):
        self.mesh, self.comm = ctx.mesh, ctx.comm
        self.model: nn.Module | None = None
        self.outside: list | None = None  # the modules outside the blocks, in the model as the user built it
        self.parallel: LayerMajorDriver | None = None

    @classmethod
    def configured(cls, ctx: BuildContext) -> LayerMajorFeature | None:
        return cls(ctx) if ctx.cfg.zero_optimization.offload_param.layer_major else None

    def survey(self, model: nn.Module) -> None:
        self.outside = outside_modules(model, LAYER_MAJOR)

    def build(self, model: nn.Module, before: Features) -> bool:
        self.model = model
        return True

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
