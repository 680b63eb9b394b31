"""Adam / AdamW stepped in fp32 tiles: over bf16 tensors that are their own master weights, and with block-wise
quantized moments (AdamW8bit / AdamW4bit).

Note [bf16 master weights]
DeepSpeed's `bf16.bf16_master_weights_and_grads` keeps the master weights and their gradients in bf16, and
`bf16.bf16_optimizer_states` the Adam moments too (DeepSpeed requires the first for the second, ZeRO stage 1-3,
and with fp32 moments its CPU Adam: `offload_optimizer`). Tiers keeps no separate master then: the bf16 tensors
the optimizer steps (a chunk, or this rank's shard of one) are the masters, which is what DeepSpeed's bf16 copy
holds after every step too, so the arithmetic is the same with 2 bytes per parameter less. Bytes per parameter at
rest: 2 (weights) + 4 (bf16 moments), or + 8 (fp32 moments); the bf16 gradients add 2 while held.
Adam and AdamW step such a tensor here (TiledAdam), in tiles of `TILE` elements, so the fp32 temporaries stay
small whatever the chunk size: each tile's weights, gradients and (bf16) moments are widened to fp32, torch's
single-tensor Adam arithmetic (`torch.optim.adam.adam`, foreach and fused off) steps them, and the results are
rounded back: the moments to nearest, the weights to nearest or, with `bf16.stochastic_rounding`, stochastically
(Note [keyed stochastic rounding]). torch's single-tensor path is elementwise op by op, so a tile's results do not
depend on where the tile starts (its fused kernels round the last elements of a call differently): under any
data-parallel size, ZeRO stage or tile size the same gradients give the same update, bit for bit. Other
optimizers (SGD, Lamb) step the bf16 tensors directly with bf16 states, as DeepSpeed's do. The low-bit optimizers
(Note [block-wise optimizer states]) step the same tiles with torchao's arithmetic instead, over fp32 or bf16
weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

import torch
import torch.optim.adam as torch_adam

from engine.optimizers.blockwise_states import MOMENTS, BlockwiseStates
from engine.optimizers.stochastic_rounding import KeyedBits, KeySpan, round_stochastically_into

TILE = 1 << 20  # elements widened to fp32 at a time


class Arithmetic(Enum):
    TORCH = "torch"  # torch's single-tensor Adam: Adam / AdamW over bf16 masters
    TORCHAO = "torchao"  # torchao's single_param_adam: the low-bit optimizers


@dataclass(frozen=True)
class TiledLayout:
    """How TiledAdam steps: its arithmetic; the plain moments' dtype; the keyed bits when bf16 weights are rounded
    stochastically (`spans`: id(stepped tensor) -> where its parameters lie, Note [keyed stochastic rounding]); the
    block-wise format and the stepped tensors (by id) whose moments it quantizes."""

    arithmetic: Arithmetic
    state_dtype: torch.dtype
    rounding: KeyedBits | None = None
    spans: dict[int, list[KeySpan]] = field(default_factory=dict)
    blockwise: BlockwiseStates | None = None
    quantized: frozenset[int] = frozenset()


class TiledAdam(torch.optim.Optimizer):
    """Adam (decoupled=False: L2 in the gradient) or AdamW, a tile at a time (Note [bf16 master weights])."""

    def __init__(self, params, layout: TiledLayout, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True, tile: int = TILE,
                 compiled: bool = False):
        """compiled: the update compiled (torch.compile, one shape: every tile `tile` elements, the last one padded
        with zeros; Note [block-wise optimizer states]): 8-bit states by Tiers' fused kernel (Note [fused 8-bit
        update]), others by torchao's function."""
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled=decoupled))
        self.layout, self.tile, self.compiled = layout, tile, compiled
        self._fused = compiled and _fused_8bit_available(layout.blockwise)
        if layout.blockwise is not None and tile % layout.blockwise.block:
            raise ValueError(f"tile {tile} is not a whole number of blocks of {layout.blockwise.block}")
        # keyed by place, not identity: an offloaded optimizer steps a manager view in a tensor's place
        places = [(g, i, p) for g, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])]
        self._spans = {(g, i): layout.spans.get(id(p)) for g, i, p in places}
        self._blockwise = {(g, i) for g, i, p in places if id(p) in layout.quantized}

    def _format(self, p: torch.Tensor, place: tuple[int, int] | None = None) -> BlockwiseStates | None:
        blockwise = place in self._blockwise if place is not None else id(p) in self.layout.quantized
        return self.layout.blockwise if blockwise else None

    def state_layout(self, p: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
        """The names and zero values of the state tensors kept for `p` (an offloaded optimizer pages them)."""
        blocks = self._format(p)
        if blocks is not None:  # (shapes only: nothing is allocated)
            return blocks.names(), [torch.zeros((), dtype=torch.uint8, device=p.device).expand(int(p.numel() * r))
                                    for r in map(blocks.entries_per_element, blocks.names())]
        return list(MOMENTS), [torch.zeros((), dtype=self.layout.state_dtype, device=p.device).expand(p.shape)
                               for _ in MOMENTS]

    def state_entries(self, p: torch.Tensor) -> dict[str, tuple[Fraction, torch.dtype]]:
        """The state tensors kept for `p` by name: entries per element of `p`, and dtype (a checkpoint reads them)."""
        blocks = self._format(p)
        if blocks is None:
            return {name: (Fraction(1), self.layout.state_dtype) for name in MOMENTS}
        return {name: (blocks.entries_per_element(name), torch.uint8) for name in blocks.names()}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TiledAdam steps without a closure")
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                blocks = self._format(p, (g, i))
                names = list(MOMENTS) if blocks is None else blocks.names()
                if any(name not in state for name in names):  # the first step (an offloaded optimizer gives views)
                    zeros = ([torch.zeros(p.shape, dtype=self.layout.state_dtype, device=p.device) for _ in names]
                             if blocks is None else blocks.zeros(p.numel(), p.device))
                    state.update(zip(names, zeros))
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                state["step"] += 1
                spans = self._spans.get((g, i))
                if self.layout.rounding is not None and spans is None:
                    raise ValueError("stochastic rounding needs to know where each parameter lies in the stepped "
                                     "tensor (Note [keyed stochastic rounding]); build the optimizer through "
                                     "initialize()")
                for start in range(0, p.numel(), self.tile):
                    self._step_tile(p, state, group, blocks, start, min(self.tile, p.numel() - start), spans)

    def _step_tile(self, p: torch.Tensor, state: dict, group: dict, blocks: BlockwiseStates | None, start: int,
                   numel: int, spans: list[KeySpan] | None) -> None:
        weights, grad = p.view(-1).narrow(0, start, numel), p.grad.view(-1).narrow(0, start, numel)
        # fp32 weights step in place; 16-bit ones through an fp32 copy, rounded back below
        wide = weights if weights.dtype == torch.float32 else weights.float()
        if self.compiled:
            _compiled_update(wide, grad, state, group, blocks, start, numel, self.tile, self._fused)
        else:
            if blocks is not None:
                moments = blocks.moments(state, start, numel)
            else:
                moments = tuple(state[name].view(-1).narrow(0, start, numel) for name in MOMENTS)
            update = _torchao_update if self.layout.arithmetic is Arithmetic.TORCHAO else _torch_update
            update(wide, grad, state["step"], moments, group)
        if wide is weights:
            return
        if self.layout.rounding is None:
            weights.copy_(wide)
        else:
            step = int(state["step"].item())
            round_stochastically_into(weights, wide, self.layout.rounding.bits(step, spans, start, numel, wide.device))


def _torch_update(wide: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, moments: tuple, group: dict) -> None:
    """torch's single-tensor Adam on fp32 weights; 16-bit moments are widened and rounded back to nearest."""
    wide_moments = [m if m.dtype == torch.float32 else m.float() for m in moments]
    beta1, beta2 = group["betas"]
    torch_adam.adam([wide], [grad.float()], wide_moments[:1], wide_moments[1:], [], [step.clone() - 1],
                    foreach=False, fused=False, decoupled_weight_decay=group["decoupled"], amsgrad=False,
                    beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False)
    for moment, wide_moment in zip(moments, wide_moments):
        if moment is not wide_moment:
            moment.copy_(wide_moment)


def _torchao_update(wide: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, moments: tuple, group: dict,
                    update=None) -> None:
    """torchao's single_param_adam (or `update`, its compiled form), on fp32 weights and torchao's own state objects
    (or plain moments)."""
    from torchao.optim.adam import single_param_adam

    beta1, beta2 = group["betas"]
    lr = torch.tensor(group["lr"], dtype=torch.float32, device=wide.device)  # as torchao keeps it
    (update or single_param_adam)(wide, grad, step.to(wide.device), moments[0], moments[1], None, lr, beta1, beta2,
                                  group["weight_decay"], group["eps"], group["decoupled"], False)


@functools.cache
def _compiled_adam():
    """torchao's single_param_adam compiled as torchao compiles it (a graph per shape, dtype and flags)."""
    from torchao.optim.adam import single_param_adam

    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)


def _fused_8bit_available(blockwise: BlockwiseStates | None) -> bool:
    """Whether the fused 8-bit update steps these states (Note [fused 8-bit update])."""
    from engine.optimizers.lowbit_kernel import tables

    return blockwise is not None and blockwise.bits == 8 and tables(torch.device("cpu")) is not None


def _compiled_update(wide: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, blocks: BlockwiseStates | None,
                     start: int, numel: int, tile: int, fused: bool) -> None:
    """The compiled update of elements [start, start + numel) on `tile` elements always (one compiled shape): a
    shorter last tile is stepped in zero-padded copies (the padding is whole blocks of zeros, which quantize alone),
    written back after. `fused`: quantized states step by the fused 8-bit update."""
    names = blocks.names() if blocks is not None else list(MOMENTS)
    ratio = {n: blocks.entries_per_element(n) if blocks is not None else 1 for n in names}
    views = {n: state[n].view(-1).narrow(0, int(start * ratio[n]), int(numel * ratio[n])) for n in names}
    padded = numel < tile
    if padded:
        views = {n: _padded(v, int(tile * ratio[n])) for n, v in views.items()}
        weights, grad = _padded(wide, tile), _padded(grad, tile)
    else:
        weights = wide
    if blocks is not None and fused:
        _fused_update(weights, grad, state["step"], views, group)
    else:
        moments = blocks.moments(views, 0, tile) if blocks is not None else tuple(views[n] for n in MOMENTS)
        with torch._dynamo.utils.disable_cache_limit():  # as torchao's optimizer calls it: never eager ops
            _torchao_update(weights, grad, state["step"], moments, group, _compiled_adam())
    if padded:
        wide.copy_(weights[:numel])
        for n in names:
            state[n].view(-1).narrow(0, int(start * ratio[n]), int(numel * ratio[n])).copy_(
                views[n][:int(numel * ratio[n])])


def _fused_update(weights: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, views: dict[str, torch.Tensor],
                  group: dict) -> None:
    """Tiers' fused 8-bit update on fp32 weights (gradients widened here: Note [fused 8-bit update])."""
    from engine.optimizers.lowbit_kernel import adam8bit, tables

    device = weights.device
    beta1, beta2 = group["betas"]
    lr = torch.tensor(group["lr"], dtype=torch.float32, device=device)
    states = tuple(views[f"{m}.codes"] if part == "codes" else views[f"{m}.scale"].view(torch.float32)
                   for m in MOMENTS for part in ("codes", "scale"))  # the scales' bytes are fp32 values
    adam8bit(weights, grad.float(), step.to(device), states, tables(device), lr, beta1, beta2,
             group["weight_decay"], group["eps"], group["decoupled"])


def _padded(values: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=values.dtype, device=values.device)
    out[:values.numel()] = values
    return out
