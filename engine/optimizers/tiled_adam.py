"""Adam / AdamW over bf16 tensors that are their own master weights, stepped in fp32 tiles.

Note [bf16 master weights]
DeepSpeed's `bf16.bf16_master_weights_and_grads` keeps the master weights and their gradients in bf16, and
`bf16.bf16_optimizer_states` the Adam moments too (DeepSpeed requires the first for the second, ZeRO stage 1-3,
and with fp32 moments its CPU Adam: `offload_optimizer`). Tiers keeps no separate master then: the bf16 tensors
the optimizer steps (a chunk, or this rank's shard of one) are the masters, which is what DeepSpeed's bf16 copy
holds after every step too, so the arithmetic is the same with 2 bytes per parameter less. Bytes per parameter at
rest: 2 (weights) + 4 (bf16 moments), or + 8 (fp32 moments); the bf16 gradients add 2 while held.
Adam and AdamW step such a tensor here, in tiles of `TILE` elements, so the fp32 temporaries stay small whatever
the chunk size: each tile's weights, gradients and (bf16) moments are widened to fp32, torch's single-tensor
Adam arithmetic (`torch.optim.adam.adam`, foreach and fused off) steps them, and the results are rounded back:
the moments to nearest, the weights to nearest or, with `bf16.stochastic_rounding`, stochastically (Note [keyed
stochastic rounding]). torch's single-tensor path is elementwise op by op, so a tile's results do not depend on
where the tile starts (its fused kernels round the last elements of a call differently): any data-parallel
size, ZeRO stage or tile size gives the same weights, bit for bit. Other optimizers (SGD, Lamb) step the bf16
tensors directly with bf16 states, as DeepSpeed's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.optim.adam as torch_adam

from engine.optimizers.stochastic_rounding import KeyedBits, KeySpan, round_stochastically

TILE = 1 << 20  # elements widened to fp32 at a time


@dataclass(frozen=True)
class Bf16Masters:
    """How bf16 masters are stepped: the moments' dtype, and the keyed bits when rounding stochastically
    (`spans`: id(stepped tensor) -> where its parameters lie, Note [keyed stochastic rounding])."""

    state_dtype: torch.dtype
    rounding: KeyedBits | None = None
    spans: dict[int, list[KeySpan]] = field(default_factory=dict)


class Bf16MasterAdam(torch.optim.Optimizer):
    """Adam (decoupled=False: L2 in the gradient) or AdamW over bf16 tensors (Note [bf16 master weights])."""

    def __init__(self, params, layout: Bf16Masters, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True, tile: int = TILE):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled=decoupled))
        self.layout, self.tile = layout, tile
        # keyed by place, not identity: an offloaded optimizer steps a manager view in a tensor's place
        self._spans = {(g, i): layout.spans.get(id(p)) for g, group in enumerate(self.param_groups)
                       for i, p in enumerate(group["params"])}

    def state_layout(self, p: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
        """The names and zero values of the state tensors kept for `p` (an offloaded optimizer pages them)."""
        names = ["exp_avg", "exp_avg_sq"]
        return names, [torch.zeros((), dtype=self.layout.state_dtype, device=p.device).expand(p.shape) for _ in names]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Bf16MasterAdam steps without a closure")
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    for name in ("exp_avg", "exp_avg_sq"):
                        state[name] = torch.zeros(p.shape, dtype=self.layout.state_dtype, device=p.device)
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                state["step"] += 1
                spans = self._spans.get((g, i))
                if self.layout.rounding is not None and spans is None:
                    raise ValueError("stochastic rounding needs to know where each parameter lies in the stepped "
                                     "tensor (Note [keyed stochastic rounding]); build the optimizer through "
                                     "initialize()")
                for start in range(0, p.numel(), self.tile):
                    self._step_tile(p, state, group, start, min(self.tile, p.numel() - start), spans)

    def _step_tile(self, p: torch.Tensor, state: dict, group: dict, start: int, numel: int,
                   spans: list[KeySpan] | None) -> None:
        weights, grad = p.view(-1).narrow(0, start, numel), p.grad.view(-1).narrow(0, start, numel)
        moments = [state[name].view(-1).narrow(0, start, numel) for name in ("exp_avg", "exp_avg_sq")]
        wide = weights.float() if weights.dtype != torch.float32 else weights.clone()
        wide_moments = [m if m.dtype == torch.float32 else m.float() for m in moments]
        beta1, beta2 = group["betas"]
        step = int(state["step"].item())
        torch_adam.adam([wide], [grad.float()], wide_moments[:1], wide_moments[1:], [],
                        [torch.tensor(float(step - 1))], foreach=False, fused=False,
                        decoupled_weight_decay=group["decoupled"], amsgrad=False, beta1=beta1, beta2=beta2,
                        lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for moment, wide_moment in zip(moments, wide_moments):
            if moment is not wide_moment:
                moment.copy_(wide_moment)
        if self.layout.rounding is None:
            weights.copy_(wide)
        else:
            weights.copy_(round_stochastically(wide, self.layout.rounding.bits(step, spans, start, numel, wide.device)))
