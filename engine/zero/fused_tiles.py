"""The host update of one stepped tensor, a tile at a time, through torch's fused Adam kernel.

Note [the host step in tiles]
torch's fused AdamW over fp32 values, gradients and moments moves 28 bytes per element; that pass is the floor
of an update. The offloaded step used to add whole-tensor passes around it: the 16-bit gradient shard widened
into a fresh fp32 tensor, multiplied once per factor (unscaling, clipping), the fp32 master rounded into the
16-bit parameter through another fresh tensor: about twice the floor's traffic, and fresh host memory (page
faults) every step. Here, for torch's Adam / AdamW with `fused=True` over fp32 values and fp32 moments, each
tile of `TILE` elements is
- widened from the gradient shard into a scratch tile (an fp32 gradient is read where it is);
- stepped by torch's fused kernel (`torch._fused_adam_` / `torch._fused_adamw_`, what `Adam(fused=True).step()`
  calls, the step counter advanced once before the tiles as it advances it), which divides the gradient by the
  step's `grad_scale` as it reads it (Note [one gradient factor]);
- rounded into the 16-bit tensor the model uses (or copied back up, for fp32 values of the device stepped on
  the host: Note [separate device memory]) while it is still in cache; what crosses the bus goes non-blocking
  through pinned tiles (Note [staged copies]).
The same tiles step fp32 masters held in memory on the CPU (MastersFromSources, what initialize builds for
the config's Adam / AdamW there): their 16-bit gradients are read in place, so no fp32 gradient is staged
for the step and freed after it (Note [master weights]), and the result equals the staged path bit for bit.
The scratch tiles are made once and reused, so a step allocates nothing large. Main-memory traffic per element:
the gradient read once, values and moments read and written, the 16-bit result written. The fused kernel
vectorizes each call from its first element; tiles of `TILE` elements (a multiple of every vector width) start
on vector boundaries, so the tiles give the values one call over the whole tensor gives (checked bit for bit).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.optimizers.tiled_adam import TILE
from engine.zero.gradient_factor import kernel_grad_scale, plain_fused_adam
from offload.chunk import Location
from offload.device_memory import DeviceMemory
from offload.staging_ring import StagingRing


def steps_in_tiles(opt: torch.optim.Optimizer, values_dtype: torch.dtype, state_dtypes: list[torch.dtype]) -> bool:
    """Whether `opt` (over one tensor) is what the tiles compute: torch's fused Adam / AdamW, plain options, fp32
    values and moments."""
    return plain_fused_adam(opt) and values_dtype == torch.float32 and state_dtypes == [torch.float32] * 2


class AdamMoments(NamedTuple):
    """A stepped tensor's Adam state on the host: the step count and the two moments."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class TileStepper:
    """Steps tensors tile by tile (Note [the host step in tiles]); holds the reused scratch tiles."""

    def __init__(self, staging: StagingRing, tile: int = TILE):
        """staging: the pinned tiles what crosses the bus goes through (Note [staged copies]; a chunk manager's),
        on `staging.memory`."""
        if tile > staging.tile:
            raise ValueError(f"tiles of {tile} elements do not fit the staging ring's {staging.tile}")
        self.memory, self.tile, self._ring = staging.memory, tile, staging
        self._wide: torch.Tensor | None = None  # the fp32 gradient tile, made once

    def _grad_tile(self, numel: int) -> torch.Tensor:
        if self._wide is None:
            self._wide = torch.empty(self.tile, dtype=torch.float32)
        return self._wide[:numel]

    @torch.no_grad()
    def step(self, group: dict, moments: AdamMoments, values: torch.Tensor, values_tier: Location,
             grad: torch.Tensor, factors: tuple[float, ...] | list[float],
             rounded: tuple[torch.Tensor, Location] | None) -> None:
        """One update on the host of `values` (fp32, on `values_tier`: the host, or the device, whose tiles go down
        and back up) from `grad` (on the host, any float dtype) times `factors` (an fp32 `grad` is left holding
        that product, as a multiplication in place leaves it), with the host `moments`; `rounded`: the 16-bit
        tensor the model uses and its tier, which takes the new values."""
        step, exp_avg, exp_avg_sq = moments
        grad_scale = kernel_grad_scale(factors)
        kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        beta1, beta2 = group["betas"]
        lr = group["lr"].item() if torch.is_tensor(group["lr"]) else group["lr"]
        step += 1  # once per update, as torch's fused Adam advances it before its kernel
        flat_v, flat = values.view(-1), [t.view(-1) for t in (grad, exp_avg, exp_avg_sq)]
        low = None if rounded is None else rounded[0].view(-1)
        crosses = self.memory.separate and values_tier is not Location.CPU
        if crosses:  # the values of the device, stepped here (in slots of the ring, brought down a tile ahead)
            tiles = self._ring.tiles_down(flat_v, self.tile)
        else:
            tiles = ((start, flat_v.narrow(0, start, min(self.tile, flat_v.numel() - start)), None)
                     for start in range(0, flat_v.numel(), self.tile))
        for start, host_v, key in tiles:
            n = host_v.numel()
            g, m, s = (t.narrow(0, start, n) for t in flat)
            if g.dtype == torch.float32:  # read where it is (a grad_scale writes the divided values back into it)
                wide = g
            else:
                wide = self._grad_tile(n)
                wide.copy_(g)
            kernel([host_v], [wide], [m], [s], [], [step], amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                   weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                   grad_scale=grad_scale)
            if crosses:  # and sent back up from its slot
                self._ring.send_slot_up(flat_v.narrow(0, start, n), host_v, key)
            if low is not None:
                self._round(low.narrow(0, start, n), rounded[1], host_v)

    def _round(self, low: torch.Tensor, low_tier: Location, values: torch.Tensor) -> None:
        """low := values rounded to low's dtype; across the bus only low's bytes travel."""
        if low_tier is Location.CPU or not self.memory.separate:
            low.copy_(values)
            return
        self._ring.send_up(low, values)


class MastersFromSources(torch.optim.Adam):
    """torch's fused Adam / AdamW (the same options, state and checkpoints) over fp32 masters in memory on the CPU,
    stepped in tiles from their 16-bit gradients and rounded into their 16-bit tensors (Note [the host step in
    tiles]): no fp32 gradient is staged. `sources`: id(master) -> (its 16-bit gradient, its 16-bit tensor).
    Before each step the runtime sets `factors` (the unscaling, the clipping); a step without them (nobody set
    them) is torch's own, over the masters' .grad."""

    def __init__(self, params, sources: dict[int, tuple[torch.Tensor, torch.Tensor]], **defaults):
        super().__init__(params, **defaults)
        self._sources = sources
        self.factors: tuple[float, ...] | None = None
        self._tiles = TileStepper(StagingRing(DeviceMemory("cpu", separate=False)))  # (nothing crosses a bus)

    @torch.no_grad()
    def step(self, closure=None):
        if self.factors is None:
            return super().step(closure)
        if closure is not None:
            raise ValueError("masters stepped from their 16-bit gradients take no closure")
        factors, self.factors = self.factors, None
        for group in self.param_groups:
            for p in group["params"]:
                source, target = self._sources[id(p)]
                state = self.state[p]
                if not state:  # what torch's fused Adam makes on its first step
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moments = AdamMoments(state["step"], state["exp_avg"], state["exp_avg_sq"])
                self._tiles.step(group, moments, p, Location.CPU, source, factors, (target, Location.CPU))
        return None


def stepped_from_sources(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], sources: list[torch.Tensor],
                         targets: list[torch.Tensor]) -> torch.optim.Optimizer:
    """`optimizer` as MastersFromSources where it is torch's fused Adam / AdamW over fp32 CPU masters with fp32
    moments (what the tiles compute), else itself."""
    if not plain_fused_adam(optimizer) or optimizer.state \
            or any(m.device.type != "cpu" or m.dtype != torch.float32 for m in masters):
        return optimizer
    listed = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if listed != {id(m) for m in masters}:
        return optimizer
    return MastersFromSources(optimizer.param_groups, {id(m): (s, t) for m, s, t in zip(masters, sources, targets)},
                              **optimizer.defaults)
