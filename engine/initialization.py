"""initialize(model, config) → Engine: public steps applied in order to an unmodified model.

    load_config            → Config (every key and combination checked: engine.config_checks)
    parallelize_tensors    the tensor-parallel plan replaces layers (Note [tensor-parallel plans])
    place_experts          each MoE layer keeps this rank's experts (Note [expert parallelism])
    apply_activation_checkpointing
    split_pipeline         this rank keeps its pipeline stages' blocks (Note [pipeline stages of an unmodified model])
    chunk_parameters       parameters packed into chunks, sharded by the ZeRO stage's ShardingPolicy
    build_chunk_optimizer  the optimizer over the chunks; states placed by the OffloadPolicy
    zero_runtime           the phases of a training step (Note [step phases])
    build_monitor          TensorBoard and printed metrics
Each is usable on its own; initialize() is their composition.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from engine.activation_checkpointing import ActivationCheckpointing
from engine.checkpoint import Saver
from engine.checkpoint.training_state import TrainingState
from engine.comm import Collectives, CommCounter, broadcast_from
from engine.config import Config, load_config
from engine.config_checks import OFFLOADED, check_client_objects, check_offload, check_packages, check_run
from engine.engine import Engine, EngineParts
from engine.feature_base import StepContext
from engine.features import (
    ExpertFeature,
    Features,
    LayerMajorFeature,
    PipelineFeature,
    SequenceFeature,
    TensorParallelFeature,
)
from engine.lr_schedules import build_lr_scheduler
from engine.mesh import Mesh
from engine.moe.plan import ExpertParallel, apply_expert_parallel
from engine.monitor import Monitor
from engine.optim import build_optimizer, check_compressed_run, chunk_segments, state_blocks, tiled_layout_of
from engine.optimizers.compressed import DataParallelGroup
from engine.pipeline.block_timing import measured_costs
from engine.pipeline.driver import shared_parameter_groups, sync_shared_values
from engine.pipeline.layer_major import LAYER_MAJOR
from engine.pipeline.model_split import PipelineModel, outside_modules, plan_stages, split_model
from engine.plan import RunPlan
from engine.precision import PrecisionPolicy, build_loss_scaler
from engine.process_exit import close_at_exit
from engine.progress import TrainingProgress
from engine.sequence_parallel.runtime import SequenceSplit, choose_mode
from engine.step_metrics import StepMetrics
from engine.tensor_parallel import Mesh2D, TensorParallel, TPGroup, apply_tensor_parallel
from engine.tensor_parallel.rng import RNGStreams
from engine.topology import start_mesh
from engine.zero.chunk_layout import ChunkLayout
from engine.zero.chunk_packing import ExpertChunks
from engine.zero.chunk_state import ShardPlace
from engine.zero.chunked_params import ChunkedParams
from engine.zero.fused_tiles import stepped_from_sources
from engine.zero.grad_clip import GradientClipper
from engine.zero.grad_sync import GradReducer
from engine.zero.hooks import ZeroHooks
from engine.zero.offload_policy import OffloadPolicy, build_offloaded_optimizer
from engine.zero.param_gather import ParamGatherer
from engine.zero.policy import ChunkKind, ShardingPolicy
from engine.zero.runtime import StepParts, ZeroRuntime
from engine.zero.weight_files import assign_weight_files
from engine.zero.zero_init import materialize_parameters, zero_init_placeholders, zero_init_recording
from offload.chunk import DEFAULT_CHUNK_CAPACITY

# reduce_bucket_size defaults to 5e8 elements (DeepSpeed); a chunk that large would leave nothing
# to overlap with backward, so the default chunk is capped (16 MiB of fp32, DDP's bucket scale).
# The first-registered parameters (embeddings) get their gradients last in backward, so the first
# chunk's all-reduce cannot overlap with compute: it is kept at 1/8 of the others.
FIRST_CHUNK_FRACTION = 8


def chunk_layout(config: Config, shards: int = 1) -> tuple[int, int | None]:
    """(capacity, first chunk's capacity): `zero_optimization.chunk_size` for every chunk when given;
    else a small first chunk and the default cap. Both are rounded up to a multiple of `shards`
    (Note [sharding policy]); chunks are trimmed to what they hold (Note [chunk packing])."""
    zero = config.zero_optimization
    if zero.chunk_size is not None:
        return _round_up(zero.chunk_size, shards), None
    target = DEFAULT_CHUNK_CAPACITY
    if zero.reduce_bucket_size != "auto":
        target = min(zero.reduce_bucket_size, target)
    first = _round_up(max(target // FIRST_CHUNK_FRACTION, 1), shards)
    return _round_up(target, shards), first


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
    if loss_fn is not None and not (cfg.pipeline.enabled or cfg.zero_optimization.offload_param.layer_major):
        raise ValueError("initialize(loss_fn=...) is the loss train_batch uses under a pipeline config (or "
                         "offload_param.layer_major), and this config has neither; compute the loss yourself and call "
                         "engine.backward(loss)")
    if loss_fn is not None and cfg.pipeline.enabled and cfg.sequence_parallel.enabled:
        raise ValueError("initialize(loss_fn=...) under sequence_parallel would take this rank's part of each "
                         "sequence's output with the whole sequence's labels; pass the labels in the micro-batch "
                         "(e.g. {\"input_ids\": x, \"labels\": y}) so that the model's own loss is split with it")
    mesh = start_mesh(tp_size=cfg.tensor_parallel.size, tp_mode=cfg.tensor_parallel.mode,
                      pp_size=cfg.pipeline.stages, sp_size=cfg.sequence_parallel.size,
                      ep_size=cfg.moe.expert_parallel_size, shard_size=max(cfg.zero_optimization.mics_shard_size, 0))
    check_run(cfg, mesh, optimizer=optimizer, lr_scheduler=lr_scheduler, model_parameters=model_parameters,
              built_under_zero_init=zero_init_recording(model) is not None)
    check_compressed_run(cfg, mesh)
    plan = RunPlan.of(cfg, mesh)  # after check_run: the batch sizes add up over these ranks
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    if weights is not None:
        assign_weight_files(model, weights, zero_init_recording(model))
    recording, meta_of = zero_init_placeholders(model, mesh.device)  # Note [zero_init]
    _to_device(model, mesh.device, _homed_on_host(model, cfg, mesh))  # Note [a bounded start]
    layer_major = cfg.zero_optimization.offload_param.layer_major
    outside = outside_modules(model, LAYER_MAJOR if layer_major and not cfg.pipeline.enabled else "pipeline") \
        if cfg.pipeline.enabled or layer_major else None  # before the features change the model
    comm = CommCounter(collectives=collectives) if collectives is not None else CommCounter()
    tensor_parallel = parallelize_tensors(model, cfg, mesh, comm.collectives)
    experts = place_experts(model, cfg, mesh, comm, tensor_parallel)
    sequence = split_sequences(model, cfg, mesh, comm)
    checkpointing = apply_activation_checkpointing(model, cfg, mesh, tensor_parallel, sequence)
    groups = _param_groups(model, optimizer, model_parameters, meta_of, experts.dropped if experts else frozenset())
    split, shared_groups = split_pipeline(model, cfg, mesh, comm, pending=set(meta_of), outside=outside)
    if split is not None:  # this rank's parameters, named as in the whole model
        groups = [dict(g, params=[p for p in g["params"] if split.holds(p)]) for g in groups]
        groups = [g for g in groups if g["params"]]
    chunked = chunk_parameters(model, cfg, mesh, groups, pending=set(meta_of), tensor_parallel=tensor_parallel,
                               split=split, experts=experts)
    model.to(mesh.device)  # buffers and parameters this rank holds in no chunk join the model there
    data_parallel = DataParallelGroup(mesh.zero.group, mesh.zero.rank, mesh.zero.size, comm)
    optimizer = build_chunk_optimizer(cfg, chunked, mesh.device, optimizer, rebuild=split is not None,
                                      data_parallel=data_parallel)
    if recording is not None:  # after offloading: shards may load straight into the chunk manager
        chunked.load_loose(mesh.zero.group, comm)  # parameters made after the block with values (PEFT's adapters)
        materialize_parameters(model, chunked, recording, meta_of, mesh.device,
                               mesh.zero.group if split is None else None, comm, split.names if split else None)
    loss_scaler = build_loss_scaler(cfg)
    runtime = zero_runtime(model, cfg, chunked, optimizer, mesh, loss_scaler, comm)
    features = feature_objects(cfg, plan, mesh, comm, Applied(model, tensor_parallel, experts, sequence, split,
                                                              shared_groups, outside))
    features.attach(StepContext(runtime, plan.precision, loss_fn))  # Note [feature objects]
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


@dataclass(frozen=True)
class Applied:
    """What initialize applied to the model before chunking it: each parallelism's object (None: off), and the
    modules outside the blocks (for layer-major accumulation)."""

    model: nn.Module
    tensor_parallel: TensorParallel | None
    experts: ExpertParallel | None
    sequence: SequenceSplit | None
    split: PipelineModel | None
    shared_groups: dict
    outside: list | None


def feature_objects(cfg: Config, plan: RunPlan, mesh: Mesh, comm: CommCounter, applied: Applied) -> Features:
    """Note [feature objects]: what each parallelism applied above adds to the engine's calls, in this order; a
    scheduling driver (pipeline, layer-major) is built over those before it when the runtime exists (attach)."""
    a = applied
    features = [TensorParallelFeature(a.tensor_parallel, mesh.device) if a.tensor_parallel else None,
                ExpertFeature(a.experts, mesh, comm, cfg.tensorboard.enabled) if a.experts else None,
                SequenceFeature(a.sequence) if a.sequence else None,
                PipelineFeature(a.split, a.shared_groups, cfg.pipeline,
                                plan.batch.gradient_accumulation_steps, mesh, comm)
                if a.split is not None else None,
                LayerMajorFeature(a.model, a.outside, mesh, comm)  # Note [layer-major accumulation]
                if cfg.zero_optimization.offload_param.layer_major else None]
    return Features([f for f in features if f is not None])


def parallelize_tensors(model: nn.Module, cfg: Config, mesh: Mesh,
                        collectives: Collectives | None = None) -> TensorParallel | None:
    """Note [tensor-parallel plans]: the config's plan applied to the model, before its parameters are chunked;
    None without tensor parallelism. collectives: as initialize's."""
    if mesh.tp.size == 1:
        return None
    counter = CommCounter(collectives=collectives) if collectives is not None else CommCounter()
    tp = TPGroup(mesh.tp.group, mesh.tp.size, mesh.tp.rank, counter)
    with torch.no_grad():  # the plan slices whole weights: every tp rank starts from its group's first rank's
        for t in list(model.parameters()) + list(model.buffers()):
            broadcast_from(t.data, 0, tp.group, tp.counter)
    grid = Mesh2D.of(tp, mesh.tp_row.group, mesh.tp_col.group) if cfg.tensor_parallel.mode == "2d" else None
    return apply_tensor_parallel(model, cfg.tensor_parallel.plan, tp, RNGStreams(tp, mesh.device), grid,
                                 cfg.tensor_parallel.sequence_parallel)


def place_experts(model: nn.Module, cfg: Config, mesh: Mesh, comm: CommCounter,
                  tensor_parallel: TensorParallel | None = None) -> ExpertParallel | None:
    """Note [expert parallelism]: the model's MoE layers (engine.moe.MoE, and a Hugging Face model's experts when
    the config has a `moe` section) keep this rank's experts and dispatch tokens to every rank's; None without any.
    Under tensor parallelism they stay whole on every tp rank."""
    return apply_expert_parallel(model, cfg.moe, mesh, comm, frozenset(tensor_parallel.specs) if tensor_parallel else
                                 frozenset(), cfg.pipeline.enabled)


def apply_activation_checkpointing(model: nn.Module, cfg: Config, mesh: Mesh,
                                   tensor_parallel: TensorParallel | None = None,
                                   sequence: SequenceSplit | None = None) -> ActivationCheckpointing:
    """Note [activation checkpointing]: the config's options; when enabled, the model's blocks (or the modules
    the config names) wrapped so that they keep only their inputs (and, under sequence parallelism, recompute
    their attention over the split sequence too)."""
    checkpointing = ActivationCheckpointing(cfg.activation_checkpointing, mesh.device,
                                            tensor_parallel.streams if tensor_parallel else None,
                                            tensor_parallel.tp if tensor_parallel else None,
                                            sequence.attention if sequence else None)
    if cfg.activation_checkpointing.enabled:
        checkpointing.wrap_modules(model)
    return checkpointing


def split_pipeline(model: nn.Module, cfg: Config, mesh: Mesh, comm: CommCounter,
                   pending: set[int] = frozenset(),
                   outside: list | None = None) -> tuple[PipelineModel | None, dict]:
    """Note [pipeline stages of an unmodified model]: `model` keeps what this rank's pipeline stages hold, and
    the views those stages run, with the groups of the pipeline ranks sharing parameters, which start from the
    lowest one's values (`pending`: ids of parameters whose values zero_init brings later, the same on every
    rank: Note [zero_init]); (None, {}) without a pipeline config."""
    if not cfg.pipeline.enabled:
        return None, {}
    micro_batch = cfg.batch_sizes(mesh.dp.size).micro_batch_size
    measure = functools.partial(measured_costs, model, micro_batch=micro_batch, device=mesh.device)
    split = split_model(model, plan_stages(model, cfg.pipeline, measure, outside), mesh.pp.rank)
    groups = shared_parameter_groups(split, mesh)
    sync_shared_values(split, groups, comm, pending)
    return split, groups


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


def chunk_parameters(model: nn.Module, cfg: Config, mesh: Mesh, groups: list[dict],
                     pending: set[int] = frozenset(), tensor_parallel: TensorParallel | None = None,
                     split: PipelineModel | None = None, experts: ExpertParallel | None = None) -> ChunkedParams:
    """The trainable parameters of `groups`, and the model's frozen ones (Note [frozen chunks]), packed into chunks
    and sharded over the data-parallel ranks as the ZeRO stage's ShardingPolicy says (Note [sharding policy]);
    `pending`: ids of parameters whose values
    zero_init brings later; `split`: this rank's pipeline stages (which name the parameters, and whose parameters
    other pipeline ranks also hold count once in the global norm); `experts`: their parameters' chunks are reduced
    and sharded over the expert-data-parallel group."""
    policy = ShardingPolicy(cfg.zero_optimization.stage)
    shards = mesh.shard.size if policy.shards(ChunkKind.OPTIM) else 1
    capacity, first_capacity = chunk_layout(cfg, shards)
    names = split.names if split is not None else {id(p): n for n, p in model.named_parameters()}
    dropped = experts.dropped if experts is not None else frozenset()
    frozen = [p for p in model.parameters() if not p.requires_grad and id(p) not in dropped
              and (split is None or split.holds(p))]  # Note [frozen chunks]
    int8 = int8_frozen_weights(model, frozen) if cfg.zero_optimization.quantize_frozen == "int8" else frozenset()
    if cfg.zero_optimization.quantize_frozen == "int8" and not int8:
        warnings.warn("zero_optimization.quantize_frozen \"int8\": the model has no frozen nn.Linear weight, so "
                      "nothing is quantized (weights of other layers, e.g. GPT-2's Conv1D, stay in the compute "
                      "dtype); freeze the base before initialize(), or remove quantize_frozen", stacklevel=3)
    layout = ChunkLayout(capacity, first_capacity, shard_count=shards, shard_rank=mesh.shard.rank if shards > 1 else 0,
                         shard_grads=policy.shards(ChunkKind.GRAD), shard_params=policy.shards(ChunkKind.PARAM),
                         persistence_threshold=persistence_threshold(cfg),
                         compute_dtype=PrecisionPolicy.from_config(cfg).compute_dtype,
                         page_params=cfg.zero_optimization.offload_param.device in OFFLOADED or bool(int8),
                         page_grads=_pages_grads(cfg), offloaded=_offloaded_kinds(cfg),
                         fp32_masters=not cfg.bf16.bf16_master_weights_and_grads,
                         state_blocks=state_blocks(cfg.optimizer))
    chunked = ChunkedParams(groups, layout, mesh.device, names, pending=pending,
                            experts=_expert_chunks(experts, mesh, shards > 1), frozen=frozen, int8=int8)
    if tensor_parallel is not None:
        chunked.norm_weights = tensor_parallel.norm_weights(model)
    if chunked.has_experts and not chunked.sharded:  # each rank holds the whole gradient: count it once over dp
        chunk_of = chunked.chunk_index()
        for p in chunked.params:
            expert = chunked.states[chunk_of[id(p)]].place.group is not None
            share = 1.0 / (mesh.edp.size if expert else mesh.zero.size)
            chunked.norm_weights[id(p)] = chunked.norm_weights.get(id(p), 1.0) * share  # (times tp's weight)
    for pid, ranks in (split.shared_here() if split is not None else {}).items():
        if mesh.pp.rank != ranks[0]:  # the lowest pipeline rank holding it counts it
            chunked.norm_weights[pid] = 0.0
    return chunked


def int8_frozen_weights(model: nn.Module, frozen: list[nn.Parameter]) -> frozenset[int]:
    """Note [int8 frozen chunks]: ids of the frozen parameters that are an `nn.Linear`'s weight (PEFT's base
    layers, a frozen lm_head), which quantize_frozen "int8" keeps as int8."""
    frozen_ids = {id(p) for p in frozen}
    return frozenset(id(m.weight) for m in model.modules()
                     if isinstance(m, nn.Linear) and id(m.weight) in frozen_ids and m.weight.dim() == 2)


def _offloaded_kinds(cfg: Config) -> frozenset[str]:
    """The chunk kinds a chunk manager will hold (Note [offload policy]): their shards start as placeholders."""
    zero = cfg.zero_optimization
    kinds = {"optim", "grad"} if zero.offload_optimizer.device in OFFLOADED else set()
    return frozenset(kinds | ({"param"} if zero.offload_param.device in OFFLOADED else set()))


def _homed_on_host(model: nn.Module, cfg: Config, mesh: Mesh) -> set[int]:
    """Note [a bounded start]: ids of the parameters whose shards offload_param keeps on the host — the sharded
    (non-persistent) ones, trainable or frozen (Note [frozen chunks]) — which need not visit the device on their
    way into their chunks. Only where
    nothing rebuilds layers before chunking (no tensor, pipeline or expert parallelism)."""
    zero = cfg.zero_optimization
    if zero.stage != 3 or zero.offload_param.device not in OFFLOADED or max(
            mesh.tp.size, mesh.pp.size, mesh.ep.size) > 1:
        return set()
    threshold = persistence_threshold(cfg)
    return {id(p) for p in model.parameters() if p.is_floating_point() and p.numel() >= threshold}


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


def _pages_grads(cfg: Config) -> bool:
    """Note [device tier]: offloaded optimizer states at stage 2-3 keep gradient shards with one rank too, so that
    the gradients go to the host with them (Note [paging in one process])."""
    zero = cfg.zero_optimization
    return zero.offload_optimizer.device in OFFLOADED and zero.stage >= 2


def _expert_chunks(experts: ExpertParallel | None, mesh: Mesh, sharded: bool) -> ExpertChunks | None:
    """Note [expert parallelism]: with 2 or more ep ranks, expert chunks are reduced over (and with ZeRO
    sharded across) the ranks holding the same experts."""
    if experts is None or mesh.ep.size == 1:
        return None
    place = ShardPlace(mesh.edp.rank if sharded else 0, mesh.edp.size if sharded else 1,
                       mesh.edp.group)
    return ExpertChunks(frozenset(id(p) for p in experts.expert_params()), place)


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


def persistence_threshold(cfg: Config) -> int:
    """Stage 3: parameters with fewer elements stay gathered (`auto`: 100,000, DeepSpeed's default)."""
    threshold = cfg.zero_optimization.stage3_param_persistence_threshold
    return 100_000 if threshold == "auto" else threshold


def _param_groups(model: nn.Module, optimizer, model_parameters, meta_of: dict[int, torch.Tensor],
                  dropped: frozenset[int] = frozenset()) -> list[dict]:
    """The param groups to chunk. zero_init: groups built before initialize() name the meta parameters their
    placeholders replaced. dropped: ids of parameters of experts other ranks hold (Note [expert parallelism])."""
    replaced = {id(meta_of[id(p)]): p for p in model.parameters() if id(p) in meta_of}
    groups = _given_param_groups(model, optimizer, model_parameters, replaced, dropped)
    # a group left empty stays: chunk groups remember the index of the group they came from (a client optimizer's)
    return [dict(g, params=[replaced.get(id(p), p) for p in g["params"] if id(p) not in dropped]) for g in groups]


def _given_param_groups(model: nn.Module, optimizer, model_parameters, replaced: dict,
                        dropped: frozenset[int]) -> list[dict]:
    if optimizer is not None:
        model_ids = {id(p) for p in model.parameters()} | set(replaced) | dropped
        groups = [dict(g) for g in optimizer.param_groups]
        stray = [p for g in groups for p in g["params"] if id(p) not in model_ids]
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
