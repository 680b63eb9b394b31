"""initialize(model, config) → Engine: builds every piece a training run needs, in order."""

from __future__ import annotations

import inspect
import os
from typing import Callable, Iterable

import torch
from torch import nn

from engine.activation_checkpointing import ActivationCheckpointing
from engine.comm import CommCounter, broadcast_from
from engine.config import Config, ConfigError, load_config
from engine.engine import Engine
from engine.lr_schedules import build_lr_scheduler
from engine.monitor import Monitor
from engine.step_metrics import StepMetrics
from engine.optim import build_optimizer
from engine.precision import PrecisionPolicy, build_loss_scaler
from engine.tensor_parallel import Mesh2D, TensorParallel, TPGroup, apply_tensor_parallel
from engine.tensor_parallel.rng import RNGStreams
from engine.topology import Topology
from engine.zero.chunked_params import ChunkedParams
from engine.zero.grad_clip import GradientClipper
from engine.zero.grad_sync import GradReducer
from engine.zero.offloaded_optimizer import OffloadedOptimizer
from engine.zero.param_gather import ParamGatherer
from engine.zero.policy import ChunkKind, ShardingPolicy
from engine.zero.runtime import ZeroRuntime
from engine.zero.zero_init import materialize_parameters, zero_init_placeholders
from offload.chunk import Location
from offload.manager import Budgets, ChunkManager
from offload.chunk import DEFAULT_CHUNK_CAPACITY, best_capacity

# reduce_bucket_size defaults to 5e8 elements (DeepSpeed); a chunk that large would leave nothing
# to overlap with backward, so the default chunk is capped (16 MiB of fp32, DDP's bucket scale).
# The first-registered parameters (embeddings) get their gradients last in backward, so the first
# chunk's all-reduce cannot overlap with compute: it is kept at 1/8 of the others.
FIRST_CHUNK_FRACTION = 8


def chunk_layout(config: Config, trainable: list[torch.Size], shards: int = 1) -> tuple[int, int | None]:
    """(capacity, first chunk's capacity): `zero_optimization.chunk_size` for every chunk when given;
    else a small first chunk and the padding-minimizing capacity up to the default cap. Both are
    rounded up to a multiple of `shards` (Note [sharding policy])."""
    zero = config.zero_optimization
    if zero.chunk_size is not None:
        return _round_up(zero.chunk_size, shards), None
    target = DEFAULT_CHUNK_CAPACITY
    if zero.reduce_bucket_size != "auto":
        target = min(zero.reduce_bucket_size, target)
    first = _round_up(max(target // FIRST_CHUNK_FRACTION, 1), shards)
    return _round_up(best_capacity(trainable, target, first_capacity=first), shards), first


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def initialize(
    model: nn.Module,
    config: str | os.PathLike | dict | Config,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler=None,
    model_parameters: Iterable | None = None,
) -> Engine:
    """Wraps `model` for training as `config` says.

    optimizer: a torch optimizer over `model`'s parameters, instead of the config's `optimizer`.
    lr_scheduler: a scheduler, or a callable taking the optimizer, instead of the config's `scheduler`.
    model_parameters: parameters or param-group dicts for the config's optimizer (default: all).
    """
    cfg = load_config(config)
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer: given both in the config and as initialize(optimizer=...); keep one")
    if optimizer is None and cfg.optimizer is None:
        raise ConfigError("optimizer: missing; add an 'optimizer' section to the config or pass initialize(optimizer=...)")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler: given both in the config and as initialize(lr_scheduler=...); keep one")
    if optimizer is not None and model_parameters is not None:
        raise ValueError("model_parameters is for the config's optimizer; a passed optimizer already names its parameters")

    topology = Topology.from_environment(tp_size=cfg.tensor_parallel.size, tp_mode=cfg.tensor_parallel.mode)
    batch = cfg.batch_sizes(topology.dp_world_size)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    recording, meta_of = zero_init_placeholders(model, topology.device)  # Note [zero_init]
    model.to(topology.device)
    tensor_parallel = _tensor_parallel(cfg, model, topology, optimizer, model_parameters, recording)
    checkpointing = ActivationCheckpointing(cfg.activation_checkpointing, topology.device,
                                            tensor_parallel.streams if tensor_parallel else None,
                                            tensor_parallel.tp if tensor_parallel else None)
    if cfg.activation_checkpointing.enabled:  # Note [activation checkpointing]
        checkpointing.wrap_modules(model)

    policy = ShardingPolicy(cfg.zero_optimization.stage)
    shards = topology.dp_world_size if policy.shards(ChunkKind.OPTIM) else 1
    # zero_init: groups built before initialize() name the meta parameters their placeholders replaced
    replaced = {id(meta_of[id(p)]): p for p in model.parameters() if id(p) in meta_of}
    groups = _param_groups(model, optimizer, model_parameters, replaced)
    trainable = [p.shape for g in groups for p in g["params"] if p.requires_grad]
    capacity, first_capacity = chunk_layout(cfg, trainable, shards)
    names = {id(p): n for n, p in model.named_parameters()}
    chunked = ChunkedParams(groups, capacity, topology.device, first_capacity, names,
                            shard_count=shards, shard_rank=topology.dp_rank if shards > 1 else 0,
                            shard_grads=policy.shards(ChunkKind.GRAD), shard_params=policy.shards(ChunkKind.PARAM),
                            persistence_threshold=persistence_threshold(cfg), pending=set(meta_of),
                            compute_dtype=PrecisionPolicy.from_config(cfg).compute_dtype)
    if tensor_parallel is not None:
        chunked.norm_weights = tensor_parallel.norm_weights(model)
    offload = cfg.zero_optimization.offload_optimizer
    _check_step_in_backward(cfg, chunked, topology)
    if optimizer is None and offload.device in ("cpu", "nvme"):
        optimizer = _offloaded(cfg, chunked, topology)
    elif cfg.zero_optimization.offload_param.device in ("cpu", "nvme"):
        raise ConfigError("zero_optimization.offload_param: offloaded parameter shards are stepped by the offloaded "
                          "optimizer where they live; also set zero_optimization.offload_optimizer.device (cpu or nvme) "
                          "and give the optimizer in the config's 'optimizer' section")
    elif optimizer is None:
        optimizer = build_optimizer(cfg.optimizer, chunked.optimizer_param_groups())
    elif offload.device in ("cpu", "nvme"):
        raise ConfigError("zero_optimization.offload_optimizer: offloading a client optimizer's states is not "
                          "supported yet; give the optimizer in the config's 'optimizer' section instead")
    elif chunked.sharded or chunked.masters is not None or recording is not None:
        if lr_scheduler is not None and hasattr(lr_scheduler, "step"):
            raise ValueError("with ZeRO stage >= 1 or bf16/fp16 the optimizer passed to initialize() is rebuilt over "
                             "this rank's shards or fp32 master weights, so a scheduler built on it would drive the "
                             "old one; pass lr_scheduler as a callable that takes the optimizer (e.g. "
                             "lambda opt: LambdaLR(opt, f))")
        optimizer = _rebuilt_over_shards(optimizer, chunked)
    if recording is not None:  # after offloading: shards may load straight into the chunk manager
        materialize_parameters(model, chunked, recording, meta_of, topology.device, topology.dp_group)
    scheduler = _scheduler(cfg, optimizer, lr_scheduler)
    loss_scaler = build_loss_scaler(cfg)
    runtime = zero_runtime(model, cfg, chunked, optimizer, topology, loss_scaler)
    metrics = StepMetrics(runtime.comm, topology.device, cfg.wall_clock_breakdown,
                          (lambda: checkpointing.recompute_seconds) if cfg.activation_checkpointing.profile else None,
                          (lambda: optimizer.manager.stats) if isinstance(optimizer, OffloadedOptimizer) else None)
    monitor = Monitor(cfg.tensorboard, cfg.steps_per_print, is_writer_rank=topology.rank == 0, device=topology.device,
                      step_metrics=metrics)
    return Engine(model, cfg, batch, topology, runtime, scheduler, loss_scaler, PrecisionPolicy.from_config(cfg),
                  monitor, tensor_parallel, checkpointing)


def zero_runtime(model: nn.Module, cfg: Config, chunked: ChunkedParams, optimizer: torch.optim.Optimizer,
                 topology: Topology, loss_scaler) -> ZeroRuntime:
    """The phases of a training step over `chunked` (Note [step phases]): stage 3 gathers parameters around
    the modules that use them (Note [gathering around modules]); with 2 or more data-parallel ranks gradient
    chunks are reduced as backward fills them (Note [reduction order])."""
    zero, comm = cfg.zero_optimization, CommCounter()
    gatherer = None
    if chunked.sharded_params is not None:
        prefetch = zero.stage3_prefetch_bucket_size if zero.stage3_prefetch_bucket_size != "auto" else 50_000_000
        gatherer = ParamGatherer(model, chunked.sharded_params, chunked.chunk_index(), topology.dp_group, comm,
                                 prefetch, zero.stage3_max_live_parameters)
    overlap = zero.overlap_comm is not False  # stage 0 overlaps unless told not to
    reducer = (GradReducer(chunked, topology.dp_group, comm, overlap, zero.reduce_scatter,
                           gatherer.on_grads_complete if gatherer else None)
               if topology.is_distributed else None)
    clipper = GradientClipper(chunked, topology, comm, cfg.gradient_clipping, loss_scaler.checks_overflow,
                              norm_logged=cfg.tensorboard.enabled)
    return ZeroRuntime(chunked, optimizer, topology, comm, clipper, gatherer, reducer,
                       steps_in_backward=zero.offload_optimizer.step_in_backward)


def _tensor_parallel(cfg: Config, model: nn.Module, topology: Topology, optimizer, model_parameters,
                     recording) -> TensorParallel | None:
    """Note [tensor-parallel plans]: the config's plan applied to the model, before its parameters are chunked."""
    if topology.tp_size == 1:
        return None
    if optimizer is not None or model_parameters is not None:
        raise ConfigError("tensor_parallel: the plan replaces the model's layers and their parameters, so an optimizer "
                          "or model_parameters built before initialize() would name the old ones; give the optimizer "
                          "in the config's 'optimizer' section (not supported yet with tensor parallelism)")
    if recording is not None:
        raise ConfigError("tensor_parallel: building the model under zero_init() is not supported yet with tensor "
                          "parallelism; build it normally (each rank then keeps only its shards after initialize)")
    tp = TPGroup(topology.tp_group, topology.tp_size, topology.tp_rank)
    with torch.no_grad():  # the plan slices whole weights: every tp rank starts from its group's first rank's
        for t in list(model.parameters()) + list(model.buffers()):
            broadcast_from(t.data, 0, tp.group, tp.counter)
    mesh = Mesh2D.of(tp, topology.tp_row_group, topology.tp_col_group) if cfg.tensor_parallel.mode == "2d" else None
    return apply_tensor_parallel(model, cfg.tensor_parallel.plan, tp, RNGStreams(tp, topology.device), mesh)


def _check_step_in_backward(cfg: Config, chunked: ChunkedParams, topology: Topology) -> None:
    """Note [stepping in backward]: what updating each gradient shard as soon as it is reduced needs."""
    zero = cfg.zero_optimization
    if not zero.offload_optimizer.step_in_backward:
        return
    key = "zero_optimization.offload_optimizer.step_in_backward"
    if zero.offload_optimizer.device not in ("cpu", "nvme"):
        raise ConfigError(f"{key}: steps the offloaded optimizer; set zero_optimization.offload_optimizer.device to "
                          "cpu or nvme, or remove step_in_backward")
    if chunked.sharded_grads is None:
        raise ConfigError(f"{key}: needs gradient shards, i.e. ZeRO stage 2 or 3 over 2 or more data-parallel ranks "
                          f"(this run: stage {zero.stage}, {topology.dp_world_size} rank(s)); remove step_in_backward")
    if chunked.masters is not None:
        raise ConfigError(f"{key}: not supported yet with bf16/fp16 (fp32 master gradients are staged after backward); "
                          "train in fp32 or remove step_in_backward")
    if cfg.gradient_clipping > 0:
        raise ConfigError(f"{key}: clipping by the global gradient norm needs every gradient before the first "
                          f"update, and step_in_backward updates during backward; set gradient_clipping to 0 "
                          f"(it is {cfg.gradient_clipping}) or remove step_in_backward")


def persistence_threshold(cfg: Config) -> int:
    """Stage 3: parameters with fewer elements stay gathered (`auto`: 100,000, DeepSpeed's default)."""
    threshold = cfg.zero_optimization.stage3_param_persistence_threshold
    return 100_000 if threshold == "auto" else threshold


def _param_groups(model: nn.Module, optimizer, model_parameters, replaced: dict[int, nn.Parameter]) -> list[dict]:
    groups = _given_param_groups(model, optimizer, model_parameters, replaced)
    return [dict(g, params=[replaced.get(id(p), p) for p in g["params"]]) for g in groups]


def _given_param_groups(model: nn.Module, optimizer, model_parameters, replaced: dict) -> list[dict]:
    if optimizer is not None:
        model_ids = {id(p) for p in model.parameters()} | set(replaced)
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


def _offloaded(cfg: Config, chunked: ChunkedParams, topology: Topology) -> OffloadedOptimizer:
    """Notes [offloaded optimizer states], [offloaded gradient shards] and [offloaded parameter shards]: the
    config's optimizer, with its states, the gradient shards (stages 2-3, fp32) and with offload_param the
    parameter shards in one ChunkManager."""
    zero, aio = cfg.zero_optimization, cfg.aio
    offload, offload_param = zero.offload_optimizer, zero.offload_param
    params_offloaded = offload_param.device in ("cpu", "nvme")
    if params_offloaded and chunked.masters is not None:
        raise ConfigError(f"zero_optimization.offload_param.device: {offload_param.device!r} — offloading 16-bit "
                          "parameter shards with fp32 master weights is not supported yet; train in fp32 with "
                          "offload_param, or keep bf16/fp16 and remove offload_param")
    if params_offloaded and chunked.sharded_params is None:
        raise ConfigError(f"zero_optimization.offload_param.device: {offload_param.device!r} — parameter shards are "
                          "offloaded only when ZeRO stage 3 shards them over 2 or more data-parallel ranks, and this "
                          "run has one; not supported yet in a single process: remove offload_param (optimizer "
                          "states still offload) or launch more ranks")
    nvme_path = offload.nvme_path if offload.device == "nvme" else offload_param.nvme_path
    if params_offloaded and offload.device == "nvme" == offload_param.device and offload_param.nvme_path != nvme_path:
        raise ConfigError("zero_optimization.offload_param.nvme_path: Tiers keeps parameter shards and optimizer "
                          "states in one swap directory; give both the same nvme_path")
    on_nvme = offload.device == "nvme" or (params_offloaded and offload_param.device == "nvme")
    on_cpu = offload.device == "cpu" or (params_offloaded and offload_param.device == "cpu")
    groups = chunked.optimizer_param_groups()
    # the CPU tier's default budget: what is homed there plus a window of buffer_count chunks of each kind
    # streamed from NVMe, with room for O_DIRECT padding (state chunks: exp_avg + exp_avg_sq, 2x a tensor)
    largest = max(p.numel() * p.element_size() for g in groups for p in g["params"])
    grads_offloaded = chunked.sharded_grads is not None and chunked.masters is None  # Note [offloaded gradient shards]
    per_buffer = 3 if grads_offloaded else 2  # (+ the gradient shard, streamed through with the states)
    window = offload.buffer_count * per_buffer * (largest + aio.block_size) if offload.device == "nvme" else 0
    if params_offloaded and offload_param.device == "nvme":
        window += offload_param.buffer_count * (largest + aio.block_size)
    user_budget = cfg.memory.budget_bytes("cpu_budget")  # the user's cap replaces the default
    budget = user_budget if user_budget is not None else (window if on_nvme and not on_cpu else None)
    manager = ChunkManager(topology.device, Budgets(cpu=budget), nvme_dir=nvme_path if on_nvme else None,
                           nvme_threads=aio.intra_op_parallelism or aio.thread_count or 2,
                           nvme_queue_depth=aio.queue_depth, nvme_block_size=aio.block_size,
                           pin_memory=offload.pin_memory or offload_param.pin_memory,
                           prefetch_depth=max(offload.buffer_count - 2, 1))
    # Adam runs where the parameters are when they are on the CPU; on CUDA the chunks visit the device
    compute = Location.CPU if topology.device.type == "cpu" else Location.DEVICE
    param_chunks = None
    if params_offloaded:
        home = Location.NVME if offload_param.device == "nvme" else Location.CPU
        chunked.sharded_params.offload_to(manager, home, compute)
        param_chunks = chunked.sharded_params.stepped_chunks()
    states_home = Location.NVME if offload.device == "nvme" else Location.CPU
    if grads_offloaded:
        chunked.sharded_grads.offload_to(manager, states_home, compute)
    optimizer = OffloadedOptimizer(lambda g: build_optimizer(cfg.optimizer, g), groups, manager, states_home, compute,
                                   param_chunks, chunked.stepped_grad_chunks())
    if user_budget is None and on_nvme and on_cpu:  # one kind homed on CPU, the other streamed from NVMe
        manager.budgets = Budgets(cpu=manager.used_bytes(Location.CPU) + window)
    return optimizer


def _rebuilt_over_shards(client: torch.optim.Optimizer, chunked: ChunkedParams) -> torch.optim.Optimizer:
    """ZeRO shards a client optimizer's states (as DeepSpeed does): the same class and options, over this
    rank's shards of the chunks, one param group per client group."""
    if client.state:
        raise ValueError(f"the {type(client).__name__} passed to initialize() already holds state; with ZeRO "
                         "stage >= 1 it is rebuilt over this rank's shards, so pass a freshly built optimizer")
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
