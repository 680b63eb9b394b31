"""Offload as a policy over chunk kinds (../shared/DESIGN.md: "offload is a policy"), and the chunk manager
it places them in.

Note [offload policy]
Like the sharding policy (Note [sharding policy]), a table says, per kind of chunk, where its payload
lives between uses — its home tier; a kind not in the table stays on the compute device:
  OPTIM   optimizer states and fp32 masters     offload_optimizer.device (Note [offloaded master weights])
  GRAD    gradient shards                       the optimizer states' tier, when they are stepped with
                                                them (ZeRO stage 2-3: Note [offloaded gradient shards])
  PARAM   parameter shards                      offload_param.device (stage 3: Note [offloaded parameter shards];
                                                in one process too: Note [paging in one process])
Every offloaded kind lives in one ChunkManager. Its CPU budget is, by default, what is homed on the CPU
plus a window of `buffer_count` chunks of each kind streamed from NVMe (with room for O_DIRECT
padding); `memory.cpu_budget` replaces it. Offloaded chunks are stepped where the optimizer runs: on
the CPU when the parameters are there, else they visit the device.

Note [device tier]
Offloaded chunks are used where the chunk manager says (Note [where a chunk is used]): where the device has
memory of its own (Note [separate device memory]) and no device budget is set, on the host — so between steps
the device holds no optimizer state, master or gradient shard, and with offload_param only the gathered chunks
of the modules running; the optimizer steps each tensor on the host with torch's fused CPU Adam, its 16-bit
gradient shard sent down as it is reduced and its updated 16-bit parameter shard sent up (ZeRO-Offload: about 4
bytes per parameter over the bus per bf16 step at ZeRO-2). `memory.device_budget` or `placement: "auto"` make
the device tier a budgeted cache above the homes (ColossalAI Gemini's and PatrickStar's device chunks): a chunk
moves up, with the chunks used beside it, while the tier has room for them all, so a share of the states lives,
and is stepped, on the device; the eviction order (Note [eviction order]) sends chunks back down, device → CPU →
NVMe, when parameter shards need the room. device_budget caps the bytes of chunks resident there; "auto" caps
them, at every moment of the step, at the device's capacity less `memory.device_margin` (default 5%) less the
non-chunk memory the traced step measured at that moment (Note [measured placement]), and under device_budget
too when both are set. On a CPU-only machine either makes the device tier memory of its own, accounted apart
(the CPU seam). A budget no chunk fits in is refused at start-up, naming the value to set; so is a CPU budget,
with NVMe homes, below the chunks one stepped tensor uses together.

Note [offload ratio]
DeepSpeed's `offload_optimizer.ratio` (stage 3 only, as there) is the share of the optimizer states offloaded
and stepped on the host: the stepped tensors making up the first (1 - ratio) of the elements, in step order,
have their states, fp32 masters and gradient shards homed on the device instead, and are stepped there. Counted
in whole stepped tensors (chunk shards). Where the device is the host it changes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import Config
from engine.optim import build_optimizer, tiled_layout_of
from engine.zero.chunked_params import ChunkedParams
from engine.zero.offloaded_optimizer import OffloadedOptimizer
from engine.zero.policy import ChunkKind
from offload.chunk import Location
from offload.device_memory import DeviceMemory
from offload.device_tier import MeasuredPlacement
from offload.manager import BudgetError, Budgets, ChunkManager
from offload.nvme import NvmeSettings
from offload.units import fmt_bytes

_TIERS = {"cpu": Location.CPU, "nvme": Location.NVME}


@dataclass(frozen=True)
class OffloadPolicy:
    """Each offloaded chunk kind's home tier (Note [offload policy])."""

    homes: dict[ChunkKind, Location]
    masters: bool = False  # OPTIM includes fp32 master weights (bf16 / fp16)

    @classmethod
    def from_config(cls, cfg: Config, *, grads_sharded: bool, masters: bool) -> "OffloadPolicy":
        """grads_sharded: this run keeps gradient shards (stage 2-3 over 2 or more ranks, or paged in one
        process); masters: bf16/fp16 with fp32 master weights."""
        zero = cfg.zero_optimization
        homes = {}
        if zero.offload_optimizer.device in _TIERS:
            homes[ChunkKind.OPTIM] = _TIERS[zero.offload_optimizer.device]
            if grads_sharded:  # Note [offloaded gradient shards]
                homes[ChunkKind.GRAD] = homes[ChunkKind.OPTIM]
        if zero.offload_param.device in _TIERS:
            homes[ChunkKind.PARAM] = _TIERS[zero.offload_param.device]
        return cls(homes, masters=masters and ChunkKind.OPTIM in homes)

    def home(self, kind: ChunkKind) -> Location | None:
        """Where chunks of `kind` live between uses; None: on the compute device."""
        return self.homes.get(kind)

    @property
    def offloads(self) -> bool:
        return bool(self.homes)

    def uses(self, tier: Location) -> bool:
        return tier in self.homes.values()


def build_offloaded_optimizer(cfg: Config, chunked: ChunkedParams, device: torch.device,
                              policy: OffloadPolicy, memory: DeviceMemory | None = None) -> OffloadedOptimizer:
    """Notes [offloaded optimizer states], [offloaded gradient shards] and [offloaded parameter shards]: the
    config's optimizer, with its states and the kinds `policy` offloads in one ChunkManager over `memory` (default:
    device_memory_for(cfg, device))."""
    zero, aio = cfg.zero_optimization, cfg.aio
    offload, offload_param = zero.offload_optimizer, zero.offload_param
    memory = memory if memory is not None else device_memory_for(cfg, device)
    groups = chunked.optimizer_param_groups()  # over the stepped tensors, before any is offloaded
    frozen_shards = [s.param_shard for s in chunked.frozen_states]  # streamed too (Note [frozen chunks])
    window = nvme_window(cfg, policy, max(t.numel() * t.element_size()
                                          for t in [p for g in groups for p in g["params"]] + frozen_shards))
    user_budget = cfg.memory.budget_bytes("cpu_budget")  # the user's cap replaces the default
    on_cpu, on_nvme = policy.uses(Location.CPU), policy.uses(Location.NVME)
    budget = user_budget if user_budget is not None else (window if on_nvme and not on_cpu else None)
    device_budget, auto = cfg.memory.budget_bytes("device_budget"), zero.placement == "auto"
    pinned = None if offload.pin_memory is None and offload_param.pin_memory is None else bool(
        offload.pin_memory or offload_param.pin_memory)  # None: pinned where CUDA is
    capacity = memory.capacity() if auto else None
    margin = cfg.memory.budget_bytes("device_margin")
    keys = {Location.DEVICE: "memory.device_budget", Location.CPU: "memory.cpu_budget"}
    nvme_path = (offload.nvme_path if offload.device == "nvme" else offload_param.nvme_path) if on_nvme else None
    nvme = NvmeSettings(nvme_path, threads=aio.intra_op_parallelism or aio.thread_count or 2,
                        queue_depth=aio.queue_depth, block_size=aio.block_size) if nvme_path else None
    measured = MeasuredPlacement(capacity, capacity // 20 if margin is None else margin) if auto else None
    manager = ChunkManager(device, Budgets(device=device_budget, cpu=budget, keys=keys), nvme=nvme, pin_memory=pinned,
                           prefetch_depth=prefetch_depth(cfg, policy), measured=measured, memory=memory)
    optim_home = policy.home(ChunkKind.OPTIM)
    homes = offload_homes([p.numel() for g in groups for p in g["params"]], optim_home, offload.ratio,
                          memory.separate)
    param_chunks, round_into = None, None
    if policy.home(ChunkKind.PARAM) is not None:
        chunked.sharded_params.offload_to(manager, policy.home(ChunkKind.PARAM))
        param_chunks = chunked.sharded_params.stepped_chunks()
    if policy.home(ChunkKind.GRAD) is not None:
        chunked.sharded_grads.offload_to(manager, homes)
    if chunked.has_masters:  # Note [offloaded master weights]: stepped in the manager, rounded as stepped
        masters = chunked.masters
        masters.offload_to(manager, homes, chunked.sharded_params.placed_shard if chunked.gathers_params else None)
        param_chunks = {id(m): h for m, h in zip(masters.masters, masters.handles)}
        round_into = lambda i: masters.placed_target(i, writes=True)  # noqa: E731
    tiled = tiled_layout_of(cfg, chunked)  # Note [bf16 master weights], [block-wise optimizer states]
    optimizer = OffloadedOptimizer(lambda g: build_optimizer(cfg.optimizer, g, tiled=tiled), groups,
                                   manager, homes, param_chunks, chunked.stepped_grad_chunks(), round_into)
    _check_device_budget(manager, device_budget)
    if user_budget is not None and on_nvme:
        _check_cpu_budget(manager, user_budget)
    if user_budget is None and on_nvme and on_cpu:  # one kind homed on CPU, the other streamed from NVMe
        manager.budgets = dataclasses.replace(manager.budgets, cpu=manager.used_bytes(Location.CPU) + window)
    return optimizer


def _check_device_budget(manager: ChunkManager, budget: int | None) -> None:
    """A device budget that no chunk fits in would leave the device tier unused: most likely a unit slip."""
    sizes = [manager.chunk(c).nbytes for kind in ("optim", "master", "grad", "param", "frozen")
             for c in manager.chunks_of(kind)]
    if budget is not None and sizes and budget < min(sizes):
        raise BudgetError(f"memory.device_budget: a device budget of {fmt_bytes(budget)} holds no chunk on the device "
                          f"tier (the smallest is {fmt_bytes(min(sizes))}), so every offloaded state would stay on the "
                          f"host; set memory.device_budget to at least {fmt_bytes(min(sizes))} (more keeps a larger "
                          "share on the device), or remove it")


def _check_cpu_budget(manager: ChunkManager, budget: int) -> None:
    """Note [offload policy]: a CPU budget below what one stepped tensor's chunks take together (its states, fp32
    master, gradient shard and parameter shard, as the host pool allocates them) would stop the step part-way, and
    with step_in_backward the backward, after some shards were updated: refused here, before anything is stepped."""
    footprint = [max((manager.pool.footprint(manager.chunk(c).nbytes, torch.uint8) for c in manager.chunks_of(kind)),
                     default=0) for kind in ("optim", "master", "grad", "param")]
    need = sum(footprint)
    if budget < need:
        raise BudgetError(f"memory.cpu_budget: {fmt_bytes(budget)} cannot hold the chunks one step of the largest "
                          f"stepped tensor uses together on the CPU ({fmt_bytes(need)}: its optimizer states, fp32 "
                          "master, gradient shard and parameter shard), so the update would stop part-way; set "
                          f"memory.cpu_budget to at least {need} ({fmt_bytes(need)}), or a smaller "
                          "zero_optimization.chunk_size")


def device_memory_for(cfg: Config, device: torch.device) -> DeviceMemory:
    """The compute device's memory (Note [separate device memory]); a device budget on a CPU-only machine makes its
    device tier memory of its own, accounted apart (Note [device tier])."""
    memory = DeviceMemory(device)
    tier = cfg.memory.device_budget is not None or cfg.zero_optimization.placement == "auto"
    return DeviceMemory(device, separate=True) if tier and not memory.separate else memory


def offload_homes(numels: list[int], home: Location, ratio: float, separate: bool) -> list[Location]:
    """Note [offload ratio]: each stepped tensor's home, in step order: the device for the first ones, up to
    (1 - ratio) of the elements, where the device has memory of its own; `home` for the rest."""
    keep = (1.0 - ratio) * sum(numels) if separate else 0.0
    homes, kept = [], 0
    for n in numels:
        on_device = kept + n <= keep
        kept += n if on_device else 0
        homes.append(Location.DEVICE if on_device else home)
    return homes


def prefetch_depth(cfg: Config, policy: OffloadPolicy) -> int:
    """Chunks the manager keeps on their way ahead of use (Note [prefetch reach]): each kind streamed from NVMe
    reads up to its `buffer_count` ahead, as DeepSpeed's swappers do; without NVMe, the device tier's look-ahead."""
    zero = cfg.zero_optimization
    streamed = [section.buffer_count for kind, section in ((ChunkKind.OPTIM, zero.offload_optimizer),
                                                            (ChunkKind.PARAM, zero.offload_param))
                if policy.home(kind) is Location.NVME]
    return sum(streamed) if streamed else max(zero.offload_optimizer.buffer_count - 2, 1)


def nvme_window(cfg: Config, policy: OffloadPolicy, largest: int) -> int:
    """CPU bytes for the chunks streamed through from NVMe: `buffer_count` of each kind, each the largest
    stepped tensor (`largest` bytes) plus an O_DIRECT block (state chunks: exp_avg + exp_avg_sq, 2x a tensor)."""
    zero, block = cfg.zero_optimization, cfg.aio.block_size
    window = 0
    if policy.home(ChunkKind.OPTIM) is Location.NVME:
        # exp_avg + exp_avg_sq (+ the gradient shard, + the fp32 master, streamed along)
        per_buffer = 2 + (policy.home(ChunkKind.GRAD) is not None) + policy.masters
        window += zero.offload_optimizer.buffer_count * per_buffer * (largest + block)
    if policy.home(ChunkKind.PARAM) is Location.NVME:
        window += zero.offload_param.buffer_count * (largest + block)
    return window
