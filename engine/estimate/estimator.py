"""Per-rank memory of every strategy for one model and config: model states exact, activations traced.

Note [peak memory estimate]
For one rank of a strategy (Note [estimating model states] for the states):
  device peak = device-tier states + max(backward, update) transients, where
                backward = traced activations at the micro batch (Note [tracing activations])
                           + stage-3 gathered chunks + stage-2/3 gradient chunks being reduced
                update   = bf16/fp16 fp32 gradients of the masters
  host peak   = the runtime (runtime.py, measured) + CPU-tier states and NVMe streaming window
                (+ the device's training peak when the compute device is the CPU itself)
  build       = without zero_init each rank first builds the whole model, then chunks it: the
                built weights plus whole param and gradient chunks, before any optimizer state
                exists; the device peak (and on the CPU the host peak) takes the larger of build
                and training
A pipelined strategy's row is its pipeline rank with the highest device peak (Note [estimating a
pipeline]). The largest model that fits scales the parts that grow with the parameter count
(states, chunks, the build) and keeps activations and the runtime at this model's; it is a guide
for a wider or deeper model of the same shape, not a promise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from engine.config import BatchSizes, Config, load_config
from engine.config_checks import check_quantize_frozen, optional_packages
from engine.config_schema import ConfigError
from engine.estimate.activations import ActivationTrace, default_seq_len, trace_activations
from engine.estimate.model_spec import build_model
from engine.estimate.model_states import ModelStates, TrainableParam, model_states
from engine.estimate.pipeline_stages import PipelineEstimate, PipelineSpec, Unit, model_units, plan_pipeline
from engine.estimate.runtime import runtime_host_bytes
from engine.estimate.strategies import Strategy, candidate_strategies
from engine.initialization import int8_frozen_weights
from engine.mesh import Mesh
from engine.precision import PrecisionPolicy


@dataclass(frozen=True)
class RankBudgets:
    """Bytes one rank may use on each tier (None: not limited); the whole process's, unlike
    offload.manager.Budgets, which caps the chunks one ChunkManager keeps on a tier."""

    device: int | None = None
    cpu: int | None = None
    nvme: int | None = None


@dataclass(frozen=True)
class EstimateSettings:
    """How an estimate is taken: the budgets each rank's peaks are judged against; the sequence length (None: the
    model's own); whether compute runs on the CPU (None: when no CUDA device is seen); whether the model is built
    under zero_init (no whole copy before chunking); where strategies that offload to NVMe put their files."""

    budgets: RankBudgets = RankBudgets()
    seq_len: int | None = None
    compute_on_cpu: bool | None = None
    zero_init: bool = False
    nvme_path: str | None = None


@dataclass(frozen=True)
class StrategyEstimate:
    strategy: Strategy
    config: dict
    states: ModelStates
    activations: int  # the traced step's peak at the micro batch
    runtime: int
    build: int  # device bytes while the model is built whole and chunked (0 with zero_init)
    device_peak: int
    host_peak: int
    disk_peak: int  # the swap files at the step's peak (Note [bytes on disk]); its budget is RankBudgets.nvme
    misfits: tuple[str, ...] = ()  # why it does not fit the budgets (empty: fits)
    largest_factor: float | None = None  # how many times this model's parameters fit (None: no budget given)
    pipeline: PipelineEstimate | None = None  # pipelined strategies: the bubble, in flight, the stage split

    @property
    def fits(self) -> bool:
        return not self.misfits


@dataclass
class Estimate:
    params: int  # the model's parameter count (tied weights once)
    world: int
    micro_batch: int
    seq_len: int
    compute_on_cpu: bool
    budgets: RankBudgets
    rows: list[StrategyEstimate] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # pipelined strategies that cannot run, and why

    def fitting(self) -> list[StrategyEstimate]:
        return [r for r in self.rows if r.fits]

    def largest_params(self, row: StrategyEstimate) -> int | None:
        """The largest parameter count of this model's shape that fits the budgets under `row`'s strategy."""
        return None if row.largest_factor is None else int(row.largest_factor * self.params)


def estimate(factory: Callable[[], nn.Module], config: dict, world: int, strategies: list[Strategy] | None = None,
             settings: EstimateSettings | None = None) -> Estimate:
    """Note [peak memory estimate] for each strategy (default: default_strategies' candidates at `world` ranks, with
    NVMe offload among them) of the model `factory` builds, trained with `config` (a config dict: its batch size,
    precision, optimizer and chunk settings are kept). A pipelined strategy that cannot run (the model has too
    few layers, the schedule needs other micro-batch counts) is left out and named in `skipped`."""
    settings = settings if settings is not None else EstimateSettings()
    budgets, nvme_path, zero_init = settings.budgets, settings.nvme_path, settings.zero_init
    compute_on_cpu = settings.compute_on_cpu
    if compute_on_cpu is None:
        compute_on_cpu = not torch.cuda.is_available()
    base = load_config(config)  # the user's own config errors are raised; what a strategy changes the engine may refuse
    if strategies is None:
        strategies = default_strategies(config, world, None, nvme=True)
    meta = build_model(factory, "meta")
    seq_len = settings.seq_len or default_seq_len(meta)
    result = Estimate(sum(p.numel() for p in meta.parameters()), world, 0, seq_len, compute_on_cpu, budgets)
    compiles = base.optimizer is not None and bool(base.optimizer.params.get("compile"))
    runtime = runtime_host_bytes(optional_packages(base), compiles)
    traces: dict[tuple, StrategyTrace] = {}
    for strategy in strategies:
        cfg_dict = strategy.config(config, nvme_path)
        try:
            cfg = load_config(cfg_dict)
        except ConfigError as e:  # (e.g. bf16 master weights at stage 0, a low-bit optimizer's states with tp)
            result.skipped.append(f"{strategy.name}: {e}")
            continue
        spec = PipelineSpec.of(cfg_dict, cfg)
        if world % (strategy.tp * spec.stages):
            raise ValueError(f"{strategy.name}: pipeline {spec.stages} x tensor-parallel {strategy.tp} does not "
                             f"divide the world size {world}")
        dp = world // (strategy.tp * spec.stages)
        refusal = _quantize_refusal(cfg, world, dp, strategy.tp, spec.stages)
        if refusal is not None:  # a strategy the engine refuses for this config is left out, named
            result.skipped.append(f"{strategy.name}: {refusal}")
            continue
        batch = cfg.batch_sizes(dp)
        result.micro_batch = batch.micro_batch_size
        key = (strategy.tp, cfg.tensor_parallel.mode)
        if key not in traces:
            traces[key] = trace_strategy(factory, cfg, seq_len)
        trace = traces[key]
        row_of = RowContext(strategy, cfg_dict, runtime, 0 if zero_init else trace.built, compute_on_cpu)
        if spec.stages == 1:
            states = model_states(trace.params, cfg, dp, trace.frozen)
            row = _combine(row_of, states, _unpipelined_activations(trace.activations, cfg, batch))
        else:
            try:
                row = _pipelined(row_of, cfg, spec, trace, dp, batch)
            except ValueError as e:  # too few layers for the stages, a schedule that needs other micro-batches
                result.skipped.append(f"{strategy.name}: {e}")
                continue
        result.rows.append(_judge(row, budgets, compute_on_cpu))
    return result


DEFAULT_PIPELINE_SIZES = (2, 4, 8)


def default_strategies(config: dict, world: int, tp_sizes: list[int] | None, nvme: bool,
                       pp_sizes: list[int] | None = None) -> list[Strategy]:
    """The candidates at `world` ranks for tensor-parallel sizes 1, the config's and `tp_sizes`, and pipeline sizes
    the config's and `pp_sizes` (default: 2, 4 and 8 where they divide the world size), run by the config's
    pipeline schedule (default 1F1B)."""
    base = load_config(config)
    spec = PipelineSpec.of(config, base)
    if pp_sizes is None:
        pp_sizes = [pp for pp in DEFAULT_PIPELINE_SIZES if world % pp == 0]
    return candidate_strategies(world, sorted({1, base.tensor_parallel.size, *(tp_sizes or [])}), nvme=nvme,
                                pp_sizes=sorted({spec.stages, *pp_sizes}), schedule=spec.schedule,
                                virtual_stages=spec.virtual_stages)


@dataclass(frozen=True)
class StrategyTrace:
    """What a strategy's model looks like on one rank, from the meta device."""

    params: list[TrainableParam]  # this rank's trainable parameters after the tensor-parallel plan
    frozen: list[TrainableParam]  # and its frozen ones (Note [frozen chunks])
    activations: ActivationTrace | None
    built: int  # bytes of the whole model as built, before the plan and the chunks
    units: tuple[Unit, ...] = ()  # what a pipeline splits into stages (Note [estimating a pipeline])


def trace_strategy(factory: Callable[[], nn.Module], cfg: Config, seq_len: int | None,
                   activations: bool = True) -> StrategyTrace:
    """The meta model under `cfg`'s tensor-parallel plan and precision; with `activations`, its step traced."""
    model = build_model(factory, "meta")
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    compute = PrecisionPolicy.from_config(cfg).compute_dtype
    with _tensor_parallel(model, cfg) as q:
        if compute != torch.float32:
            model.to(compute)  # 16-bit chunks: the model computes in the compute dtype
        trainable = [p for p in model.parameters() if p.requires_grad]
        params = [TrainableParam(p.shape, p.dtype) for p in trainable]
        frozen_params = [p for p in model.parameters() if not p.requires_grad]
        linear = int8_frozen_weights(model, frozen_params)  # Note [int8 frozen chunks]: the engine's rule
        frozen = [TrainableParam(p.shape, p.dtype, id(p) in linear) for p in frozen_params]
        units = tuple(model_units(model, trainable))
        if not activations:
            return StrategyTrace(params, frozen, None, built, units)
        if cfg.activation_checkpointing.enabled:
            from engine.activation_checkpointing import ActivationCheckpointing
            ActivationCheckpointing(cfg.activation_checkpointing, torch.device("meta")).wrap_modules(model)
        trace = trace_activations(model, seq_len or default_seq_len(model), batch_multiple=q,
                                  units=[u.modules for u in units])
    return StrategyTrace(params, frozen, trace, built, units)


def _unpipelined_activations(activations: ActivationTrace, cfg: Config, batch) -> int:
    """The step's activation peak: one micro-batch's; under layer-major accumulation (Note [layer-major
    accumulation]) the other m - 1 micro-batches' forwards keep what they leave for their backward beside it."""
    peak = activations.peak_at(batch.micro_batch_size)
    if not cfg.zero_optimization.offload_param.layer_major:
        return peak
    return peak + (batch.gradient_accumulation_steps - 1) * sum(activations.held_at(batch.micro_batch_size))


def _quantize_refusal(cfg: Config, world: int, dp: int, tp: int, pp: int) -> str | None:
    """Why the engine refuses this strategy's quantize_frozen (Note [int8 frozen chunks]: stage 3, data
    parallelism only), or None."""
    moe = cfg.moe.expert_parallel_size if cfg.moe.enabled else 1
    try:
        check_quantize_frozen(cfg, Mesh.layout(zero=dp, tp=tp, pp=pp, ep=moe))
    except ConfigError as error:
        return str(error)
    return None


@contextlib.contextmanager
def _tensor_parallel(model: nn.Module, cfg: Config):
    """The config's tensor-parallel plan applied to the meta model as rank 0 of its group sees it, over
    torch's "fake" process group (collectives do nothing: only shapes matter); yields the batch multiple
    the trace needs (the grid's batch blocks; 1 in 1D)."""
    size = cfg.tensor_parallel.size
    if size == 1:
        yield 1
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from engine.mesh import ParallelDims
    from engine.tensor_parallel import TPGroup, apply_tensor_parallel
    from engine.tensor_parallel.feature import grid_of
    from engine.tensor_parallel.mappings_2d import batch_parts

    if dist.is_initialized():
        raise RuntimeError("the tensor-parallel estimate builds its own (fake) process group; run it in a process "
                           "that has not initialized torch.distributed")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        tp_cfg = cfg.tensor_parallel
        whole = Mesh.build(ParallelDims(size, tp=size, tp_mode=tp_cfg.mode, tp_depth=tp_cfg.depth), "cpu")
        tp = TPGroup(whole.tp.group, size, 0)
        mesh = grid_of(tp, whole, tp_cfg.mode)
        apply_tensor_parallel(model, tp_cfg.plan, tp, None, mesh)
        yield batch_parts(mesh) if mesh else 1
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class RowContext:
    """What every row of one strategy is estimated with: the strategy, its config dict, the runtime's host bytes,
    the bytes of the model built whole before chunking (0 under zero_init), and whether compute runs on the CPU."""

    strategy: Strategy
    config: dict
    runtime: int
    built: int
    compute_on_cpu: bool


def _pipelined(row_of: RowContext, cfg: Config, spec: PipelineSpec, trace: StrategyTrace, dp: int,
               batch: BatchSizes) -> StrategyEstimate:
    """Note [estimating a pipeline]: every pipeline rank's peaks; the row is the rank with the highest device
    peak."""
    plan, shares = plan_pipeline(spec, trace.units, [p.shape.numel() for p in trace.params], trace.activations,
                                 batch.gradient_accumulation_steps, batch.micro_batch_size)
    rows = [_combine(row_of, model_states([trace.params[i] for i in share.params], cfg, dp), share.activations)
            for share in shares]
    rank = max(range(len(rows)), key=lambda r: (rows[r].device_peak, rows[r].host_peak))
    return dataclasses.replace(rows[rank], pipeline=dataclasses.replace(plan, rank=rank))


def _combine(row_of: RowContext, states: ModelStates, activations: int) -> StrategyEstimate:
    """Note [peak memory estimate]."""
    runtime, built, compute_on_cpu = row_of.runtime, row_of.built, row_of.compute_on_cpu
    backward = activations + states.gathered_peak + states.grad_in_flight
    # with step_in_backward the update's transients are alive while backward's are
    update = states.update_extra
    training = states.tiers.device + (backward + update if states.updates_in_backward else max(backward, update))
    build = built + sum(c.nbytes for c in states.chunks) * 2 if built else 0  # no CPU-tier states exist yet
    device_peak = max(training, build)
    # on an accelerator the model is still built whole in host memory first (without zero_init)
    host_peak = runtime + (max(states.tiers.cpu + training, build) if compute_on_cpu else
                           max(states.tiers.cpu, built))
    return StrategyEstimate(row_of.strategy, row_of.config, states, activations, runtime, build, device_peak,
                            host_peak, states.disk)


def _judge(row: StrategyEstimate, budgets: RankBudgets, compute_on_cpu: bool) -> StrategyEstimate:
    """The budgets each peak exceeds, and the factor on the parameter count at which the tightest budget is
    just met (activations and the runtime held fixed)."""
    activations = row.activations if row.device_peak > row.build else 0  # the build peak has none
    checks = [("device", row.device_peak, budgets.device, activations),
              ("cpu", row.host_peak, budgets.cpu, row.runtime + (activations if compute_on_cpu else 0)),
              ("nvme", row.disk_peak, budgets.nvme, 0)]
    misfits, factors = [], []
    for tier, need, budget, fixed in checks:
        if budget is None:
            continue
        if need > budget:
            misfits.append(f"{tier} {need / 1e9:.2f} GB > budget {budget / 1e9:.2f} GB")
        if need > fixed:
            factors.append(max(budget - fixed, 0) / (need - fixed))
    return dataclasses.replace(row, misfits=tuple(misfits), largest_factor=min(factors) if factors else None)
