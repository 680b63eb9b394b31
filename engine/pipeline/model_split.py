"""Splitting an unmodified model into pipeline stages at the boundaries of its block list.

Note [pipeline stages of an unmodified model]
A model is cut where users cut it by hand: its block list (engine.block_list: the largest ModuleList
of same-class modules) is divided into S = pipeline.stages × virtual_stages contiguous runs of
blocks, balanced by parameters (the modules called before the list, such as the embeddings, count towards
the first run, the modules called after it, such as the final norm and the output layer, towards the last;
where the forward calls them: engine/pipeline/call_order.py)
or uniformly, or by each block's forward time measured on one synthetic micro-batch (rank 0's
measurement, broadcast), or at the blocks pipeline.partition names. Stage s lives on pipeline rank s mod P.
Nothing is traced or rewritten: each stage runs the model's own forward, from the micro-batch's own
inputs, on a view of the model whose block list holds only that stage's blocks:
- the first block takes the hidden state the previous stage sent in place of its own input (stage
  0's takes the embeddings' output, as in the whole model); the last block of a stage before the last
  ends the forward (StageOutput) and its hidden state is sent on. The last stage runs to the end, and
  the loss is the model's own (`.loss`, or a scalar output) or initialize's loss_fn.
- modules with parameters outside the list run on the first stage (called before the list) or on
  the last (called after); elsewhere a VacantModule stands in: before the blocks it gives zeros
  shaped like the received hidden state (what mask and position code reads), anywhere else it
  raises, naming the module (a model that calls a module on the other side of its blocks from where
  it registers it is refused, not silently wrong).
- so every value a later stage needs from the inputs (labels for a loss computed at the end, the
  attention mask, position ids) reaches it: every stage reads the micro-batch itself. Only the hidden
  state crosses a stage boundary: blocks that hand other values to the next block (T5's position
  bias, taken from the previous block's output) are not supported yet.
- a Hugging Face forward picks each layer's mask (sliding-window or full attention) by the layer's place in the
  list it runs (`config.layer_types[i]`): a stage's view carries a config whose layer_types are its own
  blocks', and runs with use_cache False (a cache is built for the whole config's layers, and a training
  step reads none).
- the model object itself (engine.module) keeps exactly this rank's parameters under their own
  names: what another rank holds is replaced by VacantModules. A parameter that modules of two stages
  use (GPT-2's lm_head.weight is wte.weight) is held by both ranks: it starts from the lowest one's
  values, its gradients are summed over them before every update, and so it stays the same on both.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

from torch import nn

from engine.block_list import find_block_list
from engine.config_sections import PipelineConfig
from engine.pipeline.call_order import traced_places
from engine.pipeline.partition import balanced_starts, starts_from_names
from engine.pipeline.stage_modules import Place, StageBoundary, StageState, VacantModule


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage runs, and which modules outside the block list run before or after them."""

    list_name: str
    starts: tuple[int, ...]  # the first block of each stage
    block_count: int
    outside: tuple[tuple[str, Place], ...]  # modules with parameters outside the list, in registration order, placed
    ranks: int  # pipeline ranks P; stage s lives on rank s mod P

    @property
    def stages(self) -> int:
        return len(self.starts)

    def blocks_of(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < self.stages else self.block_count
        return range(self.starts[stage], end)

    def stage_of_block(self, index: int) -> int:
        return max(s for s, start in enumerate(self.starts) if start <= index)

    def runs_outside(self, place: Place, stage: int) -> bool:
        return (place is Place.BEFORE and stage == 0) or (place is Place.AFTER and stage == self.stages - 1)

    def stages_of_rank(self, rank: int) -> list[int]:
        return [s for s in range(self.stages) if s % self.ranks == rank]

    def describe_stage(self, stage: int) -> str:
        blocks = self.blocks_of(stage)
        return f"pipeline stage {stage} (rank {stage % self.ranks}, blocks {blocks.start}-{blocks.stop - 1})"


def plan_stages(model: nn.Module, config: PipelineConfig, measure=None,
                outside: list[tuple[str, Place]] | None = None) -> StagePlan:
    """Note [pipeline stages of an unmodified model]: the cut of `model` that `config` asks for. measure(blocks)
    gives (each block's seconds, before them, after them) for partition "time"; outside: `outside_modules` of the
    model before any feature changed it (found now if not given)."""
    found = find_block_list(model)
    if found is None:
        raise ValueError(f"pipeline: {type(model).__name__} has no nn.ModuleList of same-class blocks to cut into "
                         "stages; Tiers splits a model at the blocks of its layer list (e.g. GPT-2's transformer.h)")
    list_name, blocks = found
    outside = outside_modules(model) if outside is None else outside
    stages = config.stages * config.virtual_stages
    block_names = [f"{list_name}.{i}" for i in range(len(blocks))]
    if isinstance(config.partition, list):
        starts = starts_from_names(block_names, config.partition, stages)
    elif config.partition == "uniform":
        starts = balanced_starts([1.0] * len(blocks), stages)
    elif config.partition == "parameters":
        count = lambda m: float(sum(p.numel() for p in m.parameters()))  # noqa: E731
        head = sum(count(model.get_submodule(n)) for n, place in outside if place is Place.BEFORE)
        tail = sum(count(model.get_submodule(n)) for n, place in outside if place is Place.AFTER)
        starts = balanced_starts([count(b) for b in blocks], stages, head, tail)
    else:  # "time"
        costs, head, tail = measure(blocks)
        starts = balanced_starts(costs, stages, head, tail)
    return StagePlan(list_name, tuple(starts), len(blocks), tuple(outside), config.stages)


def plan_block_stages(model: nn.Module, what: str, outside: list[tuple[str, Place]] | None = None) -> StagePlan:
    """One stage per block of `model`'s block list, all on one rank (Note [layer-major accumulation]); `what`
    names the option asking for it in errors; outside: as plan_stages takes it."""
    found = find_block_list(model)
    if found is None:
        raise ValueError(f"{what}: {type(model).__name__} has no nn.ModuleList of same-class blocks to run block by "
                         "block (e.g. GPT-2's transformer.h); remove the option for this model")
    list_name, blocks = found
    outside = outside_modules(model, what) if outside is None else outside
    return StagePlan(list_name, tuple(range(len(blocks))), len(blocks), tuple(outside), ranks=1)


def outside_modules(model: nn.Module, what: str = "pipeline") -> list[tuple[str, Place]] | None:
    """The modules with parameters beside the path from the root to `model`'s block list, each before or after it
    where the forward calls it (engine/pipeline/call_order.py; by registration order where the forward cannot run
    on fake tensors); None for a model without a block list. A parameter held directly by a module on that path
    cannot be placed: refused. Found on the model as the user built it: a copy of one whose features hold process
    groups cannot be made."""
    found = find_block_list(model)
    if found is None:
        return None
    registered = _registered_outside(model, found[0], what)
    traced = traced_places(model, found[0], [name for name, _ in registered], what) or {}
    return [(name, traced.get(name, place)) for name, place in registered]


def _registered_outside(model: nn.Module, list_name: str, what: str) -> list[tuple[str, Place]]:
    """The modules with parameters beside the path from the root to the block list, each before or after it by
    registration order."""
    path = list_name.split(".") if list_name else []
    outside, module, prefix = [], model, ""
    for step in path:
        direct = [n for n, _ in module.named_parameters(recurse=False)]
        if direct:
            raise ValueError(f"{what}: parameter {prefix}{direct[0]} belongs to {type(module).__name__}, which "
                             "contains the block list, so no stage can hold it alone; move it into a submodule "
                             "(e.g. an nn.Embedding) so that the stage that uses it holds it")
        place = Place.BEFORE
        for name, child in module.named_children():
            if name == step:
                place = Place.AFTER
            elif any(True for _ in child.parameters()):
                outside.append((f"{prefix}{name}", place))
        module, prefix = getattr(module, step), f"{prefix}{step}."
    return outside


@dataclass
class PipelineModel:
    """This rank's part of a split model: the model itself with only this rank's parameters, the view each of
    its stages runs, and the parameters held by more than one pipeline rank."""

    plan: StagePlan
    rank: int
    holder: nn.Module
    views: dict[int, nn.Module]
    state: StageState
    names: dict[int, str]  # id(parameter) -> its name in the whole model
    shared: dict[int, tuple[int, ...]] = field(default_factory=dict)  # id -> the pipeline ranks holding it
    keys: tuple[str, ...] = ()  # the whole model's state-dict keys, in its order (checkpoints, full_state_dict)

    @functools.cached_property
    def param_by_id(self) -> dict[int, nn.Parameter]:
        """This rank's parameters by id (the split is done: the holder keeps these from here on)."""
        return {id(p): p for p in self.holder.parameters()}

    def holds(self, p: nn.Parameter) -> bool:
        return id(p) in self.param_by_id

    def shared_here(self) -> dict[int, tuple[int, ...]]:
        """The shared parameters this rank holds, with the pipeline ranks holding each."""
        return {pid: ranks for pid, ranks in self.shared.items() if self.rank in ranks}


def split_model(model: nn.Module, plan: StagePlan, rank: int, what: str = "pipeline.stages") -> PipelineModel:
    """Vacates in `model` what pipeline rank `rank` does not hold, and builds its stages' views; `what` names the
    option asking for the split in errors."""
    _refuse_losses_over_every_block(model, what)
    names = {id(p): n for n, p in model.named_parameters()}
    keys = tuple(model.state_dict(keep_vars=True))  # before vacating: every stage's keys
    ranks_of = _ranks_of_parameters(model, plan)
    mine = set(plan.stages_of_rank(rank))
    state = StageState()
    blocks = model.get_submodule(plan.list_name)
    originals = {i: blocks[i] for i in range(plan.block_count)}
    outside = {name: model.get_submodule(name) for name, _ in plan.outside}
    for index in range(plan.block_count):
        stage = plan.stage_of_block(index)
        if stage not in mine:
            blocks[index] = VacantModule(f"{plan.list_name}.{index}", Place.BLOCK, plan.describe_stage(stage), state)
    for name, place in plan.outside:
        stage = 0 if place is Place.BEFORE else plan.stages - 1
        if stage not in mine:
            _replace(model, name, VacantModule(name, place, plan.describe_stage(stage), state))
    views = {s: _view(model, plan, s, state, originals, outside) for s in sorted(mine)}
    shared = {pid: tuple(sorted(r)) for pid, r in ranks_of.items() if len(r) > 1}
    return PipelineModel(plan, rank, model, views, state, names, shared, keys)


def _ranks_of_parameters(model: nn.Module, plan: StagePlan) -> dict[int, set[int]]:
    """id(parameter) -> the pipeline ranks whose stages run a module holding it."""
    ranks: dict[int, set[int]] = {}
    blocks = model.get_submodule(plan.list_name)
    for index in range(plan.block_count):
        for p in blocks[index].parameters():
            ranks.setdefault(id(p), set()).add(plan.stage_of_block(index) % plan.ranks)
    for name, place in plan.outside:
        stage = 0 if place is Place.BEFORE else plan.stages - 1
        for p in model.get_submodule(name).parameters():
            ranks.setdefault(id(p), set()).add(stage % plan.ranks)
    return ranks


def _view(model: nn.Module, plan: StagePlan, stage: int, state: StageState, originals: dict,
          outside: dict[str, nn.Module]) -> nn.Module:
    """The model as `stage` runs it: copies of the modules on the path to the block list (sharing every
    parameter, buffer, hook and other submodule), the list holding the stage's blocks only, and the modules outside
    it that run elsewhere vacant."""
    run = list(plan.blocks_of(stage))
    stage_blocks = []
    for i in run:
        block = originals[i]
        first, last = i == run[0], i == run[-1]
        if first or (last and stage < plan.stages - 1):
            block = StageBoundary(block, state, takes_input=first and stage > 0,
                                  ends_stage=last and stage < plan.stages - 1)
        stage_blocks.append(block)
    replacements = {plan.list_name: nn.ModuleList(stage_blocks)}
    for name, place in plan.outside:
        held_here = plan.runs_outside(place, stage)
        replacements[name] = outside[name] if held_here else VacantModule(
            name, place, plan.describe_stage(0 if place is Place.BEFORE else plan.stages - 1), state)
    view = _copy_path(model, "", replacements)
    _stage_layer_types(view, plan, run)
    return view


def _stage_layer_types(view: nn.Module, plan: StagePlan, run: list[int]) -> None:
    """A Hugging Face model's forward picks each layer's mask by its place in the block list it runs
    (`config.layer_types[i]`: sliding-window or full attention), and a stage's list starts at its first block: the
    copies on the view's path get a config reading the model's own but for layer_types, which are the stage's
    blocks' (the blocks themselves read theirs when built). Types not one per block, unless all alike, are refused:
    the stage could not tell its blocks' apart."""
    module = view
    for step in plan.list_name.split("."):
        config = getattr(module, "config", None)
        types = getattr(config, "layer_types", None)
        if isinstance(types, (list, tuple)) and len(set(types)) > 1:
            if len(types) != plan.block_count:
                raise ValueError(f"pipeline: {type(module).__name__}'s config.layer_types lists {len(types)} layer "
                                 f"types for {plan.block_count} blocks, so a stage cannot tell its blocks' types; "
                                 "use pipeline.stages 1")
            module.__dict__["config"] = StageConfig(config, type(types)(types[i] for i in run))
        module = module._modules[step]


class StageConfig:
    """A model's config as one pipeline stage's view reads it: every attribute the model's own (read and written
    through, so later changes reach every stage), but layer_types, which are the stage's blocks'."""

    def __init__(self, config, layer_types):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "layer_types", layer_types)

    def __getattr__(self, name: str):
        return getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name: str, value) -> None:
        if name == "layer_types":
            raise AttributeError("a pipeline stage's layer_types are its blocks'; change the model's config")
        setattr(object.__getattribute__(self, "_config"), name, value)

    def __delattr__(self, name: str) -> None:
        if name == "layer_types":
            raise AttributeError("a pipeline stage's layer_types are its blocks'; change the model's config")
        delattr(object.__getattribute__(self, "_config"), name)


def _copy_path(module: nn.Module, prefix: str, replacements: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of `module` whose children named in `replacements` are replaced, recursing into the
    children on the way to one; every other child is shared."""
    view = copy.copy(module)
    children = dict(module._modules)
    for name in children:
        full = f"{prefix}{name}"
        if full in replacements:
            children[name] = replacements[full]
        elif any(key.startswith(full + ".") for key in replacements):
            children[name] = _copy_path(module._modules[name], full + ".", replacements)
    view.__dict__["_modules"] = children
    return view


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[child] = new


def _refuse_losses_over_every_block(model: nn.Module, what: str) -> None:
    """A Hugging Face MoE model with output_router_logits adds an aux loss over every layer's router logits; only
    the hidden state crosses a stage boundary, so the last stage would take it over its own layers' logits only."""
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(f"{what}: {type(model).__name__} adds its routers' aux loss (output_router_logits="
                         "True) from every MoE layer's router logits, and only the hidden state crosses a stage "
                         "boundary, so the last stage would see its own layers' logits only; set "
                         "output_router_logits=False in its config, or build its MoE layers with engine.moe.MoE "
                         "(moe.aux_loss_coef then adds their router losses on every stage)")
