"""The step's gradient factors (the unscaling, the clipping) as the one `grad_scale` torch's fused Adam divides by.

Note [one gradient factor]
Before an update the gradients are multiplied by the loss scale's inverse (fp16) and by the clipping factor.
Done as multiplications, each is a pass that reads and writes every gradient element: a quarter of a fused
AdamW pass each, on the host. torch's fused Adam / AdamW take a `grad_scale` tensor and divide each gradient by
it as their one pass reads it (what torch's GradScaler sets on the optimizer as `optimizer.grad_scale`), so
where the stepped values and moments are fp32 and the optimizer is torch's fused Adam / AdamW, the factors
become one `grad_scale` = 1 / (their product), and no pass multiplies the gradients: in memory (whole tensors),
offloaded (a tensor at a time) and in tiles (Note [the host step in tiles]) alike, so the three give the same
values. The factors' product is taken in float64 and its inverse rounded once to fp32, and the kernel divides:
an fp16 loss scale alone (a power of two) gives the values its multiplication gave; a clipping factor gives
them to within an fp32 rounding of each gradient (g / (1/c) instead of g * c). The kernel writes the divided
gradient back where it read it, as the multiplications left it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch

FUSED_ADAM = (torch.optim.Adam, torch.optim.AdamW)


def plain_fused_adam(opt: torch.optim.Optimizer) -> bool:
    """torch's Adam / AdamW with fused=True and no amsgrad, nor differentiable steps, in every group."""
    groups = opt.param_groups or [opt.defaults]
    return type(opt) in FUSED_ADAM and all(bool(g.get("fused")) and not g.get("amsgrad")
                                           and not g.get("differentiable") for g in groups)


def folds_factors(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` takes the step's gradient factors as one `grad_scale` (Note [one gradient factor]): torch's
    plain fused Adam / AdamW over fp32 tensors."""
    return plain_fused_adam(opt) and all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])


def factored_norms(opt: torch.optim.Optimizer, chunked, staged_factor: float):
    """Where `opt` takes the factors of gradients held in memory by `chunked` (a ChunkedParams) as one grad_scale,
    what measures their norms given the unscaling (their 16-bit sources' for fp32 masters); None where the
    gradients are multiplied before the step (gradients the chunk manager holds, a staged factor, another
    optimizer)."""
    if chunked.grads_managed or staged_factor != 1.0 or not folds_factors(opt):
        return None
    return chunked.master_grad_norms if chunked.has_masters else chunked.in_memory_grad_norms


def kernel_grad_scale(factors: Sequence[float]) -> torch.Tensor | None:
    """What the fused kernel divides the gradients by to multiply them by `factors` (on the CPU: torch's Adam moves
    it beside each device's tensors); None for no scaling. A factor of 0 (clipping by an infinite norm, which bf16
    and fp32 do not skip) is a scale of inf: finite gradients become 0 and infinite ones NaN, as multiplied."""
    product = math.prod(f for f in factors if f != 1.0)
    if product == 1.0:
        return None
    return torch.tensor(1.0 / product if product != 0.0 else math.inf, dtype=torch.float32)


@contextlib.contextmanager
def scaled_by(opt: torch.optim.Optimizer, factors: Sequence[float]) -> Iterator[None]:
    """Around `opt.step()` (torch's fused Adam / AdamW): its gradients are multiplied by `factors` as it reads them,
    through the `grad_scale` attribute torch's optimizers read (and torch's GradScaler sets)."""
    scale = kernel_grad_scale(factors)
    if scale is None:
        yield
        return
    if getattr(opt, "grad_scale", None) is not None:
        raise RuntimeError("the optimizer already carries a grad_scale (set by torch's GradScaler?), and the engine "
                           "unscales and clips the gradients itself: step it through engine.step() only")
    opt.grad_scale = scale
    try:
        yield
    finally:
        del opt.grad_scale
