"""Model-state bytes per rank, exact from parameter shapes: the same chunk layout the engine builds.

Note [estimating model states]
`initialize` packs the trainable parameters of each (dtype, persistent) kind into chunks with
`chunk_layout` and `plan_slots`; the estimate calls those same two functions on the parameter
shapes, so its chunk sizes are the engine's, padding included. What a rank then holds between
steps follows from the sharding policy (Note [sharding policy]) over N data-parallel ranks:
  param   every chunk whole; stage 3: a 1/N shard of each (persistent chunks stay whole)
  grad    every chunk whole; stages 2-3: a 1/N shard of each
  optim   per stepped element (the whole chunk, or its 1/N shard): the optimizer's state bytes,
          measured by stepping the config's optimizer once on a small tensor, plus 4 bytes of fp32
          master weight with bf16/fp16
These three numbers are what `Engine.model_state_bytes()` counts. Offload moves kinds between
tiers (Note [offload policy]): optimizer states and fp32 masters, and with stages 2-3 the gradient
shards, to CPU or NVMe; with offload_param the parameter shards too, in one process as well
(Note [paging in one process]). With quantize_frozen "int8" (Note [int8 frozen chunks]) the frozen
`nn.Linear` weights get frozen chunks of their own, never persistent: their shards hold 1 byte per
element (on their tier), their fp32 per-row scales (4 bytes per weight row) stay whole on every rank
on the device, their gathered payload is in the compute dtype as any chunk's, and one rank pages its
chunks even without offload_param. Transient buffers (a stage-2 gradient chunk while it is reduced,
stage-3 gathered chunks with the int8 buffers their all-gathers fill, bf16 fp32 gradients at the
update: all of them, or with managed gradient shards the one being stepped) are reported apart, as
they add to the peak but not to the state at rest.
The disk's peak (`disk`, Note [bytes on disk]) is one swap file per chunk of each kind homed on NVMe,
padded to aio.block_size: parameter shards, optimizer states, fp32 masters, and the gradient shards
when they wait for the step (a step after backward, or micro-batches accumulated before it). With
step_in_backward and one micro-batch per step each gradient shard is stepped as it is reduced, so
none is written. Chunks the CPU window holds may never be written: the peak is at most this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import Config
from engine.config_checks import OFFLOADED
from engine.optim import build_optimizer, state_blocks
from engine.optimizers.tiled_adam import TILE
from engine.plan import chunk_layout, persistence_threshold
from engine.precision import PrecisionPolicy
from engine.zero.offload_policy import OffloadPolicy, nvme_window
from engine.zero.policy import ChunkKind, ShardingPolicy
from offload.chunk import Location, plan_slots
from offload.direct_io import padded_size

FP32 = 4


@dataclass(frozen=True)
class ChunkSpec:
    """One parameter chunk (and its gradient chunk): elements, padding included."""

    numel: int
    dtype: torch.dtype  # of the payload (gathered: the compute dtype)
    persistent: bool
    int8: bool = False  # an int8 frozen chunk: its shards hold 1 byte per element (Note [int8 frozen chunks])
    blockwise: bool = False  # its optimizer states are quantized block-wise (Note [block-wise optimizer states])

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Tiers:
    """Bytes on each tier of one rank."""

    device: int = 0
    cpu: int = 0
    nvme: int = 0

    def __add__(self, other: "Tiers") -> "Tiers":
        return Tiers(self.device + other.device, self.cpu + other.cpu, self.nvme + other.nvme)

    def on(self, tier: str, nbytes: int) -> "Tiers":
        return self + Tiers(**{tier: nbytes})


@dataclass(frozen=True)
class ModelStates:
    """What one rank holds between steps, by kind (as Engine.model_state_bytes counts it) and by tier."""

    param: int
    grad: int
    optim: int
    tiers: Tiers
    gathered_peak: int  # stage 3: bytes of full parameter chunks gathered at once (transient)
    grad_in_flight: int  # stages 2-3: full gradient chunks alive while being reduced (transient)
    update_extra: int  # bf16/fp16: fp32 gradients of the masters, alive during the update (transient)
    chunks: tuple[ChunkSpec, ...]  # trainable, then frozen
    frozen: int = 0  # of `param`: the frozen chunks' bytes (Note [frozen chunks]), int8 scales included
    disk: int = 0  # the swap files' bytes at the step's peak (Note [bytes on disk])
    updates_in_backward: bool = False  # step_in_backward: update_extra lives during backward

    def by_kind(self) -> dict[str, int]:
        return {"param": self.param, "grad": self.grad, "optim": self.optim}


@dataclass(frozen=True)
class TrainableParam:
    shape: torch.Size
    dtype: torch.dtype
    linear_weight: bool = False  # the 2-D weight of an nn.Linear: quantize_frozen "int8" keeps it frozen as int8


def quantized(p: TrainableParam, config: Config) -> bool:
    """Whether frozen `p` lives in an int8 chunk (Note [int8 frozen chunks]), as int8_frozen_weights picks them."""
    return p.linear_weight and config.zero_optimization.quantize_frozen == "int8"


def chunk_specs(params: list[TrainableParam], config: Config, shards: int, frozen: bool = False) -> list[ChunkSpec]:
    """The chunks `ChunkedParams` builds for one param group of these parameters (frozen: the frozen ones, int8
    chunks apart), in its order."""
    stage = ShardingPolicy(config.zero_optimization.stage)
    threshold = persistence_threshold(config)
    capacity, first = chunk_layout(config, shards)
    compute = PrecisionPolicy.from_config(config).compute_dtype
    blocks = state_blocks(config.optimizer)
    by_kind: dict[tuple[torch.dtype, bool, bool, bool], list[torch.Size]] = {}
    for p in params:
        int8 = frozen and quantized(p, config)  # gathered around every use: never persistent
        persistent = stage.shards(ChunkKind.PARAM) and p.shape.numel() < threshold and not int8
        dtype = compute if compute != torch.float32 else p.dtype
        blockwise = not frozen and blocks is not None and blocks.quantizes(p.shape.numel())
        by_kind.setdefault((dtype, persistent, int8, blockwise), []).append(p.shape)
    specs = []
    for (dtype, persistent, int8, blockwise), shapes in by_kind.items():
        align = shards * (blocks.block if blockwise else 1)
        _, sizes = plan_slots(shapes, capacity, align=align, first_capacity=first)
        specs += [ChunkSpec(n, dtype, persistent, int8, blockwise) for n in sizes]
    return specs


def optimizer_state_bytes_per_element(config: Config, dtype: torch.dtype) -> float:
    """Bytes of optimizer state per stepped element of `dtype`: the config's optimizer stepped once on a
    small tensor, its non-scalar states counted (Adam: 2 x the element size; SGD with momentum: 1 x)."""
    tensor = torch.zeros(64, dtype=dtype, requires_grad=True)
    tensor.grad = torch.ones_like(tensor)
    optimizer = build_optimizer(config.optimizer, [{"params": [tensor]}])
    optimizer.step()
    state = optimizer.state[tensor]
    return sum(v.numel() * v.element_size() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0) / tensor.numel()


def model_states(params: list[TrainableParam], config: Config, dp: int,
                 frozen: list[TrainableParam] = ()) -> ModelStates:
    """Note [estimating model states]: one rank's model states over `dp` data-parallel ranks (over one shard group
    of them under hybrid sharding: Note [hybrid sharding]). frozen: parameters that do not train, in chunks of
    their own (Note [frozen chunks]): sharded and offloaded as parameters are, without gradients or states."""
    if config.optimizer is None:
        raise ValueError("the config has no 'optimizer' section; the estimate needs it to size optimizer states")
    zero = config.zero_optimization
    policy = ShardingPolicy(zero.stage)
    if zero.mics_shard_size > 0 and dp % zero.mics_shard_size:
        raise ValueError(f"zero_optimization.mics_shard_size {zero.mics_shard_size} must divide the {dp} data-parallel "
                         "ranks, as a run requires (Note [hybrid sharding]); use a divisor, or -1")
    group = zero.mics_shard_size if zero.mics_shard_size > 0 else dp
    shards = group if policy.shards(ChunkKind.OPTIM) else 1
    sharded = shards > 1
    chunks = chunk_specs(params, config, shards)
    frozen_chunks = chunk_specs(list(frozen), config, shards, frozen=True) if frozen else []
    scales = sum(p.shape[0] for p in frozen if quantized(p, config)) * FP32  # whole on every rank, on the device
    bf16_masters = config.bf16.bf16_master_weights_and_grads  # Note [bf16 master weights]: the weights are masters
    masters = PrecisionPolicy.from_config(config).compute_dtype != torch.float32 and not bf16_masters

    def stepped(c: ChunkSpec) -> int:
        return c.numel // shards

    # Note [paging in one process]: shards of one rank too, with offload_param or int8 chunks to gather
    paged = zero.offload_param.device in OFFLOADED or any(c.int8 for c in frozen_chunks)
    shard_params = (sharded or paged) and policy.shards(ChunkKind.PARAM)
    pages_grads = zero.offload_optimizer.device in OFFLOADED  # Note [device tier]: gradient shards go with the states
    shard_grads = (sharded or paged or pages_grads) and policy.shards(ChunkKind.GRAD)
    if any(c.int8 for c in frozen_chunks) and not shard_params:
        raise ValueError(f"zero_optimization.quantize_frozen: \"int8\" needs ZeRO stage 3 (this config: stage "
                         f"{zero.stage}); set stage 3, or remove quantize_frozen")

    def held(c: ChunkSpec) -> int:  # a parameter chunk's bytes on this rank
        if c.int8:
            return stepped(c)  # int8: 1 byte per element of the shard
        return stepped(c) * c.dtype.itemsize if shard_params and not c.persistent else c.nbytes

    frozen_bytes = sum(held(c) for c in frozen_chunks) + scales
    param = sum(held(c) for c in chunks) + frozen_bytes
    grad = sum(stepped(c) * c.dtype.itemsize if shard_grads else c.nbytes for c in chunks)
    # the dtype the states take: fp32 beside fp32 masters, the moments' dtype of bf16 masters, else the chunks'
    moments = torch.bfloat16 if config.bf16.bf16_optimizer_states else torch.float32
    state_of = {c.dtype: torch.float32 if masters else moments if bf16_masters else c.dtype for c in chunks}
    blocks, blockwise_bytes = state_blocks(config.optimizer), 0.0
    if blocks is None:
        per_element = {d: optimizer_state_bytes_per_element(config, d) for d in set(state_of.values())}
    else:  # Note [block-wise optimizer states]: two plain moments, or each moment's codes and scale bytes
        per_element = {d: 2.0 * d.itemsize for d in set(state_of.values())}
        blockwise_bytes = float(sum(blocks.entries_per_element(n) for n in blocks.names()))

    def state_bytes(c: ChunkSpec) -> int:
        return round(stepped(c) * (blockwise_bytes if c.blockwise else per_element[state_of[c.dtype]]))

    states = sum(state_bytes(c) for c in chunks)
    master_bytes = sum(stepped(c) * FP32 for c in chunks) if masters else 0

    largest_stepped = max(stepped(c) * (FP32 if masters else c.dtype.itemsize) for c in chunks)
    held_as = HeldAs(shard_params, shard_grads, masters)
    tiers = _placement(config, chunks + frozen_chunks, KindBytes(param, grad, states, master_bytes, scales), held_as,
                       largest_stepped)
    files = {ChunkKind.PARAM: [held(c) for c in chunks + frozen_chunks if not c.persistent],
             ChunkKind.OPTIM: [state_bytes(c) for c in chunks] + [stepped(c) * FP32 for c in chunks if masters],
             ChunkKind.GRAD: [stepped(c) * c.dtype.itemsize for c in chunks]}
    disk = _disk_bytes(config, _policy(config, held_as), files, dp)
    gathered = 0
    if shard_params:  # Note [gathering around modules]: up to the prefetch window plus the chunk in use
        released = [c for c in chunks + frozen_chunks if not c.persistent]
        largest = max((c.numel for c in released), default=0)
        window = min(sum(c.numel for c in released), zero.stage3_max_live_parameters,
                     _prefetch_numel(config) + 2 * largest)
        gathered = window * (released[0].dtype.itemsize if released else 0)
        # Note [int8 frozen chunks]: an int8 chunk's all-gather fills an int8 buffer beside its payload
        gathered += min(window, sum(c.numel for c in released if c.int8))
    in_flight = 2 * max(c.nbytes for c in chunks) if shard_grads else 0  # one filling, one being reduced
    # fp32 gradients staged for every master; managed 16-bit shards are widened one stepped tensor at a time
    streamed = zero.offload_optimizer.device in OFFLOADED and shard_grads
    update_extra = (largest_stepped if streamed else sum(stepped(c) * FP32 for c in chunks)) if masters else 0
    if bf16_masters or blocks is not None:  # Tiers' tiled Adam: one tile's fp32 weights, gradients, moments and
        # Adam's temporaries (block-wise moments are dequantized a tile at a time)
        update_extra = max(update_extra, min(TILE, max(stepped(c) for c in chunks)) * FP32 * 6)
    return ModelStates(param, grad, states + master_bytes, tiers, gathered, in_flight, update_extra,
                       tuple(chunks + frozen_chunks), frozen_bytes, disk,
                       zero.offload_optimizer.step_in_backward)


def _disk_bytes(config: Config, policy: OffloadPolicy, files: dict[ChunkKind, list[int]], dp: int) -> int:
    """Note [estimating model states]: the swap files of the kinds homed on NVMe, one per chunk, padded."""
    grads_wait = (not config.zero_optimization.offload_optimizer.step_in_backward
                  or config.batch_sizes(dp).gradient_accumulation_steps > 1)
    kinds = [k for k in files if policy.home(k) is Location.NVME and (k is not ChunkKind.GRAD or grads_wait)]
    return sum(padded_size(n, config.aio.block_size) for k in kinds for n in files[k] if n)


def _prefetch_numel(config: Config) -> int:
    size = config.zero_optimization.stage3_prefetch_bucket_size
    return 50_000_000 if size == "auto" else size


@dataclass(frozen=True)
class HeldAs:
    """How one rank holds the kinds: parameters and gradients as shards, and whether fp32 masters exist."""

    shard_params: bool
    shard_grads: bool
    masters: bool


@dataclass(frozen=True)
class KindBytes:
    """One rank's bytes of each kind; `scales`: the part of `param` that is int8 chunks' scales, on the device
    wherever their shards live."""

    param: int
    grad: int
    states: int
    masters: int
    scales: int = 0


def _policy(config: Config, held_as: HeldAs) -> OffloadPolicy:
    """Where each kind lives: parameters are offloaded only as stage-3 shards (Note [offloaded parameter shards])."""
    policy = OffloadPolicy.from_config(config, grads_sharded=held_as.shard_grads, masters=held_as.masters)
    if not held_as.shard_params:
        policy = OffloadPolicy({k: v for k, v in policy.homes.items() if k is not ChunkKind.PARAM})
    return policy


def _placement(config: Config, chunks: list[ChunkSpec], kinds: KindBytes, held_as: HeldAs, largest: int) -> Tiers:
    """Which tier each kind lives on (Note [offloaded optimizer states]). On a machine without an accelerator the
    device tier is CPU memory too, but it is still reported as the device tier."""
    param, grad, states, master_bytes, scales = kinds.param, kinds.grad, kinds.states, kinds.masters, kinds.scales
    configured = OffloadPolicy.from_config(config, grads_sharded=held_as.shard_grads, masters=held_as.masters)
    policy = _policy(config, held_as)
    optimizer_home = policy.home(ChunkKind.OPTIM)
    if optimizer_home is None:
        return Tiers(device=param + grad + states + master_bytes)
    tier = {kind: (home.value if home is not None else "device") for kind in ChunkKind
            for home in [policy.home(kind)]}
    # Note [offloaded master weights]: the masters live with the states
    tiers = Tiers().on(tier[ChunkKind.OPTIM], states + master_bytes).on(tier[ChunkKind.GRAD], grad)
    persistent = sum(c.nbytes for c in chunks if c.persistent) if policy.home(ChunkKind.PARAM) else 0
    tiers = tiers.on(tier[ChunkKind.PARAM], param - persistent - scales).on("device", persistent + scales)
    # NVMe kinds stream through a CPU window of buffer_count stepped tensors each (the CPU budget initialize sets)
    user_budget = config.memory.budget_bytes("cpu_budget")
    if user_budget is not None and configured.uses(Location.NVME):
        return tiers.on("cpu", max(user_budget - tiers.cpu, 0))  # the manager may fill the user's CPU budget
    return tiers.on("cpu", nvme_window(config, policy, largest))
