"""initialize(model, config) → Engine: public steps applied in order to an unmodified model.

    load_config            → Config (every key and combination checked: engine.config_checks)
    configured_features    the registered features the config turns on (engine/feature_registry.py)
    build_features         each surveys the model as the user built it, then changes it in the registry's order:
                           tensor, expert, sequence parallelism, activation checkpointing, pipeline stages
                           (Note [feature objects])
    chunk_parameters       parameters packed into chunks, sharded by the ZeRO stage's ShardingPolicy
    build_chunk_optimizer  the optimizer over the chunks; states placed by the OffloadPolicy
    zero_runtime           the phases of a training step (Note [step phases])
    build_monitor          TensorBoard and printed metrics
Each is usable on its own; initialize() is their composition.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from typing import Callable, Iterable

import torch
from torch import nn

from engine.activation_checkpointing import ActivationCheckpointing
from engine.checkpoint import Saver
from engine.checkpoint.training_state import TrainingState
from engine.comm import Collectives, CommCounter
from engine.config import Config, load_config
from engine.config_checks import (
    OFFLOADED,
    check_client_objects,
    check_loss_fn,
    check_offload,
    check_packages,
    check_run,
)
from engine.engine import Engine, EngineParts
from engine.feature_registry import FEATURES
from engine.features import BuildContext, Feature, Features, StepContext
from engine.lr_schedules import build_lr_scheduler
from engine.mesh import Mesh
from engine.monitor import Monitor
from engine.optim import build_optimizer, check_compressed_run, chunk_segments, tiled_layout_of
from engine.optimizers.compressed import DataParallelGroup
from engine.plan import RunPlan, chunk_layout_of
from engine.precision import build_loss_scaler
from engine.process_exit import close_at_exit
from engine.progress import TrainingProgress
from engine.step_metrics import StepMetrics
from engine.topology import start_mesh
from engine.zero.chunk_layout import ChunkLayout
from engine.zero.chunked_params import ChunkedParams
from engine.zero.fused_tiles import stepped_from_sources
from engine.zero.grad_clip import GradientClipper
from engine.zero.grad_sync import GradReducer
from engine.zero.hooks import ZeroHooks
from engine.zero.offload_policy import OffloadPolicy, build_offloaded_optimizer
from engine.zero.param_gather import ParamGatherer
from engine.zero.runtime import StepParts, ZeroRuntime
from engine.zero.weight_files import assign_weight_files
from engine.zero.zero_init import materialize_parameters, zero_init_placeholders, zero_init_recording


def initialize(
    model: nn.Module,
    config: str | os.PathLike | dict | Config,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler=None,
    model_parameters: Iterable | None = None,
    loss_fn: Callable | None = None,
    collectives: Collectives | None = None,
    weights: str | os.PathLike | None = None,
) -> Engine:
    """Wraps `model` for training as `config` says: the steps below, applied in order to the model.

    optimizer: a torch optimizer over `model`'s parameters, instead of the config's `optimizer`.
    lr_scheduler: a scheduler, or a callable taking the optimizer, instead of the config's `scheduler`.
    model_parameters: parameters or param-group dicts for the config's optimizer (default: all).
    loss_fn: under a pipeline config or offload_param.layer_major, loss_fn(output, micro-batch or its labels)
        gives the loss train_batch backpropagates, for a model whose output carries none (Note [a pipelined step]).
    collectives: the all-gather and reduce-scatter every collective helper calls (engine.comm.collectives_of);
        default: torch.distributed's, under its 2.12+ names or 2.11's.
    weights: a safetensors checkpoint (file, index or directory) whose tensors the model's parameters and buffers
        take, by state-dict key; a model built under zero_init reads only each rank's part (Note [streamed weights]).
    """
    cfg = load_config(config)
    check_client_objects(cfg, optimizer, lr_scheduler, model_parameters)
    check_packages(cfg)
    check_loss_fn(cfg, loss_fn)
    mesh = start_mesh(tp_size=cfg.tensor_parallel.size, tp_mode=cfg.tensor_parallel.mode,
                      pp_size=cfg.pipeline.stages, sp_size=cfg.sequence_parallel.size,
                      ep_size=cfg.moe.expert_parallel_size, shard_size=max(cfg.zero_optimization.mics_shard_size, 0),
                      tp_depth=cfg.tensor_parallel.depth)
    check_run(cfg, mesh, optimizer=optimizer, lr_scheduler=lr_scheduler, model_parameters=model_parameters,
              built_under_zero_init=zero_init_recording(model) is not None)
    check_compressed_run(cfg, mesh)
    plan = RunPlan.of(cfg, mesh)  # after check_run: the batch sizes add up over these ranks
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    if weights is not None:
        assign_weight_files(model, weights, zero_init_recording(model))
    recording, meta_of = zero_init_placeholders(model, mesh.device)  # Note [zero_init]
    comm = CommCounter(collectives=collectives) if collectives is not None else CommCounter()
    configured = configured_features(BuildContext(cfg, plan, mesh, comm, frozenset(meta_of)))
    _to_device(model, mesh.device, _homed_on_host(model, cfg, plan.chunks, any(f.rebuilds_parameters
                                                                                 for f in configured)))
    features = build_features(model, configured)  # Note [feature objects]
    groups = _param_groups(model, optimizer, model_parameters, meta_of, features)
    chunked = chunk_parameters(model, cfg, mesh, groups, pending=set(meta_of), features=features, layout=plan.chunks)
    model.to(mesh.device)  # buffers and parameters this rank holds in no chunk join the model there
    data_parallel = DataParallelGroup(mesh.zero.group, mesh.zero.rank, mesh.zero.size, comm)
    whole_names = features.whole_names()  # None: this rank's model is the whole model
    optimizer = build_chunk_optimizer(cfg, chunked, mesh.device, optimizer, rebuild=whole_names is not None,
                                      data_parallel=data_parallel)
    if recording is not None:  # after offloading: shards may load straight into the chunk manager
        chunked.load_loose(mesh.zero.group, comm)  # parameters made after the block with values (PEFT's adapters)
        materialize_parameters(model, chunked, recording, meta_of, mesh.device,
                               mesh.zero.group if whole_names is None else None, comm, whole_names)
    loss_scaler = build_loss_scaler(cfg)
    runtime = zero_runtime(model, cfg, chunked, optimizer, mesh, loss_scaler, comm)
    features.attach(StepContext(runtime, plan.precision, loss_fn))
    checkpointing = features.parallel("activation_checkpointing")
    scheduler = _scheduler(cfg, optimizer, lr_scheduler)
    progress = TrainingProgress(plan.batch.gradient_accumulation_steps)
    saver = Saver(TrainingState(  # Note [checkpoint commit]
        model, chunked, optimizer, scheduler, loss_scaler, progress, mesh, features, cfg.zero_optimization.stage,
        plan.precision.compute_dtype, runtime.gather_updated_params, runtime.gatherer.gathered),
        cfg.checkpoint)
    engine = Engine(model, cfg, runtime, EngineParts(mesh, scheduler, loss_scaler,
                                                     build_monitor(cfg, mesh, runtime, checkpointing),
                                                     checkpointing, features, progress, saver, plan))
    close_at_exit(engine.close)  # Note [shutting down at exit]
    return engine


def configured_features(ctx: BuildContext) -> list[Feature]:
    """Note [feature objects]: the registered features the config turns on, in the registry's order."""
    return [f for f in (cls.configured(ctx) for cls in FEATURES) if f is not None]


def build_features(model: nn.Module, configured: list[Feature]) -> Features:
    """Each feature surveys the model as the user built it, then each changes it in order, after the ones before
    it; one with nothing to do in this model drops out."""
    for f in configured:
        f.survey(model)
    built: list[Feature] = []
    for f in configured:
        if f.build(model, Features(built)):
            built.append(f)
    return Features(built)


def chunk_parameters(model: nn.Module, cfg: Config, mesh: Mesh, groups: list[dict],
                     pending: set[int] = frozenset(), features: Features | None = None,
                     layout: ChunkLayout | None = None) -> ChunkedParams:
    """The trainable parameters of `groups`, and the model's frozen ones (Note [frozen chunks]), packed into chunks
    and sharded over the data-parallel ranks as the ZeRO stage's ShardingPolicy says (Note [sharding policy]);
    `pending`: ids of parameters whose values zero_init brings later; `features`: the features built on the model,
    which say which parameters this rank holds and their names in the whole model, which chunks reduce over a group
    of their own (experts'), and each parameter's weight in the global norm (Note [feature objects]); `layout`: the
    plan's (default: resolved from `cfg` here)."""
    features = features if features is not None else Features([])
    layout = layout if layout is not None else chunk_layout_of(cfg, mesh)
    names = features.whole_names() or {id(p): n for n, p in model.named_parameters()}
    frozen = [p for p in model.parameters() if not p.requires_grad and features.holds(p)]  # Note [frozen chunks]
    int8 = int8_frozen_weights(model, frozen) if cfg.zero_optimization.quantize_frozen == "int8" else frozenset()
    if cfg.zero_optimization.quantize_frozen == "int8" and not int8:
        warnings.warn("zero_optimization.quantize_frozen \"int8\": the model has no frozen nn.Linear weight, so "
                      "nothing is quantized (weights of other layers, e.g. GPT-2's Conv1D, stay in the compute "
                      "dtype); freeze the base before initialize(), or remove quantize_frozen", stacklevel=3)
    if int8:  # Note [int8 frozen chunks]: paged in around their use, like offloaded parameters
        layout = dataclasses.replace(layout, page_params=True)
    chunked = ChunkedParams(groups, layout, mesh.device, names, pending=pending,
                            experts=features.separate_chunks(layout.shard_count > 1), frozen=frozen, int8=int8)
    chunked.norm_weights = features.norm_weights(model, chunked)
    return chunked


def int8_frozen_weights(model: nn.Module, frozen: list[nn.Parameter]) -> frozenset[int]:
    """Note [int8 frozen chunks]: ids of the frozen parameters that are an `nn.Linear`'s weight (PEFT's base
    layers, a frozen lm_head), which quantize_frozen "int8" keeps as int8."""
    frozen_ids = {id(p) for p in frozen}
    return frozenset(id(m.weight) for m in model.modules()
                     if isinstance(m, nn.Linear) and id(m.weight) in frozen_ids and m.weight.dim() == 2)


def _homed_on_host(model: nn.Module, cfg: Config, layout: ChunkLayout, rebuilt: bool) -> set[int]:
    """Note [a bounded start]: ids of the parameters whose shards offload_param keeps on the host — the sharded
    (non-persistent) ones, trainable or frozen (Note [frozen chunks]) — which need not visit the device on their
    way into their chunks. Only where no feature rebuilds the parameters before chunking (`rebuilt`)."""
    zero = cfg.zero_optimization
    if zero.stage != 3 or zero.offload_param.device not in OFFLOADED or rebuilt:
        return set()
    return {id(p) for p in model.parameters() if p.is_floating_point() and p.numel() >= layout.persistence_threshold}


def _to_device(model: nn.Module, device: torch.device, keep: set[int]) -> None:
    """model.to(device), but the parameters in `keep` stay where they are."""
    if not keep:
        model.to(device)
        return
    replaced: dict[int, nn.Parameter] = {}  # a tied parameter is replaced by one new Parameter in all its places
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in replaced:
                module._parameters[name] = replaced[id(p)]
                continue
            if id(p) in keep or p.device == device:
                continue
            moved = p.data.to(device)
            if torch._has_compatible_shallow_copy_type(p.data, moved):
                p.data = moved  # the Parameter object stays (as Module.to keeps it)
            else:  # e.g. to meta: a new Parameter, as Module.to makes then
                replaced[id(p)] = module._parameters[name] = nn.Parameter(moved, requires_grad=p.requires_grad)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def build_chunk_optimizer(cfg: Config, chunked: ChunkedParams, device: torch.device,
                          client: torch.optim.Optimizer | None = None, rebuild: bool = False,
                          data_parallel: DataParallelGroup | None = None) -> torch.optim.Optimizer:
    """The optimizer over the chunks: the config's, with its states placed by the OffloadPolicy (Note [offload
    policy]); or the client's, pointed at this rank's shards or fp32 masters when there are any, or rebuilt when
    `rebuild` (a pipeline stage: the client holds every stage's parameters, and a stage may hold no parameter of
    one of its groups)."""
    check_offload(cfg, chunked.shard_count, client)  # (initialize checked it already; this step may run alone)
    policy = OffloadPolicy.from_config(cfg, grads_sharded=chunked.shards_grads,
                                       masters=chunked.has_masters)
    if client is None and policy.offloads:
        chunk_segments(cfg.optimizer, chunked, offloaded=True)  # refuses per-parameter norms over offloaded pieces
        return build_offloaded_optimizer(cfg, chunked, device, policy)
    if client is None:
        segments = chunk_segments(cfg.optimizer, chunked, offloaded=False)
        built = build_optimizer(cfg.optimizer, chunked.optimizer_param_groups(), segments, data_parallel,
                                tiled_layout_of(cfg, chunked))
        if not chunked.has_masters:
            return built
        masters = chunked.masters  # Note [the host step in tiles]: stepped from the 16-bit gradients on the CPU
        return stepped_from_sources(built, masters.masters, masters.grad_sources, masters.targets)
    if rebuild:
        return _rebuilt_over_shards(client, chunked)
    if chunked.sharded or chunked.has_masters or chunked.values_pending:
        return _repointed_at_shards(client, chunked)
    return client


def zero_runtime(model: nn.Module, cfg: Config, chunked: ChunkedParams, optimizer: torch.optim.Optimizer,
                 mesh: Mesh, loss_scaler, comm: CommCounter | None = None) -> ZeroRuntime:
    """The phases of a training step over `chunked` (Note [step phases]): stage 3 gathers parameters around
    the modules that use them (Note [gathering around modules]); with 2 or more data-parallel ranks gradient
    chunks are reduced as backward fills them (Note [reduction order]). comm: the counter of the collectives so
    far (zero_init's), if any."""
    zero, comm = cfg.zero_optimization, comm if comm is not None else CommCounter()
    hooks = ZeroHooks()
    prefetch = zero.stage3_prefetch_bucket_size if zero.stage3_prefetch_bucket_size != "auto" else 50_000_000
    # Note [stage predicates]: under stages 0-2 every chunk is WHOLE, so the gatherer hooks no module
    gatherer = ParamGatherer(model, chunked.sharded_params, chunked.param_chunk_index(), mesh.shard.group, comm,
                             prefetch, zero.stage3_max_live_parameters, hooks)
    overlap = zero.overlap_comm is not False  # stage 0 overlaps unless told not to
    reducer = (GradReducer(chunked, mesh, comm, hooks, overlap, zero.reduce_scatter,
                           gatherer.on_grads_complete if chunked.gathers_params else None)
               if mesh.zero.size > 1 or chunked.shards_grads else None)
    clipper = GradientClipper(chunked, mesh, comm, cfg.gradient_clipping, loss_scaler.checks_overflow,
                              norm_logged=cfg.tensorboard.enabled)
    return ZeroRuntime(chunked, optimizer, mesh, comm, StepParts(gatherer, reducer, clipper, hooks),
                       steps_in_backward=zero.offload_optimizer.step_in_backward)


def build_monitor(cfg: Config, mesh: Mesh, runtime: ZeroRuntime,
                  checkpointing: ActivationCheckpointing) -> Monitor:
    """TensorBoard and printed metrics (rank 0), counted per update over the runtime's traffic."""
    manager = getattr(runtime.optimizer, "manager", None)
    metrics = StepMetrics(runtime.comm, mesh.device, cfg.wall_clock_breakdown,
                          (lambda: checkpointing.recompute_seconds) if cfg.activation_checkpointing.profile else None,
                          (lambda: manager.stats) if manager is not None else None)
    return Monitor(cfg.tensorboard, cfg.steps_per_print, is_writer_rank=mesh.world.rank == 0, device=mesh.device,
                   step_metrics=metrics)


def _param_groups(model: nn.Module, optimizer, model_parameters, meta_of: dict[int, torch.Tensor],
                  features: Features) -> list[dict]:
    """The param groups to chunk: those given, without the parameters other ranks hold (Note [feature objects]).
    zero_init: groups built before initialize() name the meta parameters their placeholders replaced."""
    replaced = {id(meta_of[id(p)]): p for p in model.parameters() if id(p) in meta_of}
    others = features.other_ranks_params()
    gone = others | {id(meta_of[pid]) for pid in others if pid in meta_of}  # with the meta ones they replaced
    groups = _given_param_groups(model, optimizer, model_parameters, {id(p) for p in model.parameters()}
                                 | set(replaced) | gone)
    held = ([replaced.get(id(p), p) for p in g["params"] if id(p) not in gone] for g in groups)
    # a group left empty stays: chunk groups remember the index of the group they came from (a client optimizer's)
    return [dict(g, params=[p for p in params if features.holds(p)]) for g, params in zip(groups, held)]


def _given_param_groups(model: nn.Module, optimizer, model_parameters, known: set[int]) -> list[dict]:
    """known: ids of the model's parameters, of the ones other ranks hold, and of the meta parameters zero_init's
    placeholders replaced."""
    if optimizer is not None:
        groups = [dict(g) for g in optimizer.param_groups]
        stray = [p for g in groups for p in g["params"] if id(p) not in known]
        if stray:
            shapes = ", ".join(str(tuple(p.shape)) for p in stray[:5])
            raise ValueError(f"the optimizer holds {len(stray)} tensor(s) that are not parameters of the model "
                             f"(shapes {shapes}); build it over model.parameters()")
        return [dict(g, params=list(g["params"])) for g in groups]  # with options: a rebuild over shards keeps them
    if model_parameters is None:
        return [{"params": list(model.parameters())}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


def _repointed_at_shards(client: torch.optim.Optimizer, chunked: ChunkedParams) -> torch.optim.Optimizer:
    """ZeRO shards a client optimizer's states as DeepSpeed does: each of the client's param groups (its options
    kept) now holds this rank's shards of its parameters' chunks, so a scheduler built on the client drives the
    engine's updates."""
    for group, stepped in zip(client.param_groups, chunked.stepped_by_origin(len(client.param_groups)), strict=True):
        group["params"] = stepped
    return client


def _rebuilt_over_shards(client: torch.optim.Optimizer, chunked: ChunkedParams) -> torch.optim.Optimizer:
    """ZeRO shards a client optimizer's states (as DeepSpeed does): the same class and options, over this
    rank's shards of the chunks, one param group per client group."""
    accepted = inspect.signature(type(client).__init__).parameters  # defaults may hold derived keys
    options = {k: v for k, v in client.defaults.items() if k in accepted}
    return type(client)(chunked.optimizer_param_groups(), **options)


def _scheduler(cfg: Config, optimizer: torch.optim.Optimizer, client: Callable | object | None):
    if cfg.scheduler is not None:
        return build_lr_scheduler(optimizer, cfg.scheduler.type, cfg.scheduler.params)
    if client is None:
        return None
    if callable(client) and not hasattr(client, "step"):
        return client(optimizer)
    return client
