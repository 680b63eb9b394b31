"""AdamW8bit's compiled update: dequantize, Adam, quantize by a 16-bit prefix table.

Note [fused 8-bit update]
With `optimizer.params.compile: true` the 8-bit states (Note [block-wise optimizer states]) are stepped by a
compiled function of Tiers' own, `adam8bit`: it reads a tile's weights, gradients, codes and scales and writes
them back, with torchao's `single_param_adam` arithmetic op for op, so inductor compiles the same float operations
as it does for torchao's function, and the two give the same weights, codes and scales bit for bit (tested on the
same tiles). It runs as two compiled graphs with the new fp32 moments written between them: one graph recomputes
them in each of its loops over the tile, which costs more.
What differs is how a normalized moment x finds its code. torchao runs an 8-step binary search over its 256-entry
map and compares with the midpoint: eight gathers per element, most of its compiled update's time. That code is a
monotone step function of x, so it changes at most 255 times along the fp32 line, and no two changes fall within
one 16-bit prefix of x's bit pattern (the map's neighbours are more than 1% apart; a prefix spans less than 0.8%).
So a table indexed by the top 16 bits of x holds, per prefix, the code below and at or above one threshold on the
low 16 bits: one gather and one comparison give torchao's code. The table is made from torchao's own
`quantize_8bit_with_qmap`: the codes at each prefix's two ends and, where they differ, the threshold found among
its 65536 patterns, where the code must change exactly once. At initialize the two halves, run eagerly on one
tile, must also give torchao's eager `single_param_adam` bits (AdamW and Adam's L2 decay), so that a torchao whose
arithmetic has changed is not stepped by a copy of the old one. If either check fails, a warning says so and
torchao's compiled function steps instead. Across all 2^32 fp32 patterns the table gives torchao's codes for
both maps (torchao 0.18; `scripts/check_qmap_table.py` reruns that check). bf16 weights and gradients are
widened outside the kernel: inductor's bf16 loads on CPUs without bf16 units cost more than the whole update.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

PREFIXES = 1 << 16  # tables are indexed by the top 16 bits of an fp32 pattern


def _as_fp32(patterns: torch.Tensor) -> torch.Tensor:
    """fp32 values with the given bit patterns (int64 in [0, 2^32))."""
    return (patterns - ((patterns >= 1 << 31).long() << 32)).to(torch.int32).view(torch.float32)


def prefix_table(qmap: tuple[float, ...]) -> torch.Tensor | None:
    """int32 per 16-bit prefix: threshold on the low 16 bits (bits 0-15), code below it (16-23), code at or above
    it (24-31), with torchao's 8-bit quantization to `qmap` (Note [fused 8-bit update]); None where a prefix holds
    two changes of code."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap

    values = torch.tensor(qmap, dtype=torch.float32)
    prefixes = torch.arange(PREFIXES, dtype=torch.int64) << 16
    lowest = quantize_8bit_with_qmap(_as_fp32(prefixes), values).long()
    highest = quantize_8bit_with_qmap(_as_fp32(prefixes + 0xFFFF), values).long()
    threshold, above = torch.zeros(PREFIXES, dtype=torch.int64), lowest.clone()
    low = torch.arange(PREFIXES, dtype=torch.int64)
    for prefix in torch.nonzero(lowest != highest).flatten().tolist():
        codes = quantize_8bit_with_qmap(_as_fp32((prefix << 16) + low), values).long()
        changes = torch.nonzero(codes[1:] != codes[:-1]).flatten()
        if changes.numel() != 1:
            return None
        threshold[prefix] = int(changes[0]) + 1
        above[prefix] = codes[threshold[prefix]]
    packed = threshold | (lowest << 16) | (above << 24)
    return (packed - ((above >= 128).long() << 32)).to(torch.int32)  # bits 24-31 as int32's sign and high bits


class Maps(NamedTuple):
    """torchao's 8-bit maps (fp32) and their prefix tables, on one device."""

    signed: torch.Tensor
    unsigned: torch.Tensor
    signed_table: torch.Tensor
    unsigned_table: torch.Tensor


@functools.cache
def tables(device: torch.device) -> Maps | None:
    """torchao's signed and unsigned 8-bit maps and their prefix tables on `device`, made once per process; None
    when a table cannot be made, or when the fused update does not give torchao's bits (`matches_torchao`)."""
    if device.type != "cpu":
        on_host = tables(torch.device("cpu"))
        return None if on_host is None else Maps(*(t.to(device) for t in on_host))
    from engine.optimizers.blockwise_states import import_torchao

    subclass_8bit, _ = import_torchao()
    maps = (subclass_8bit.get_qmap_signed(), subclass_8bit.get_qmap_unsigned())
    made = [prefix_table(qmap) for qmap in maps]
    if any(table is None for table in made):
        logger.warning("AdamW8bit: a torchao map has two changes of code within one 16-bit prefix, so the "
                       "compiled update runs torchao's function instead of Tiers' fused one")
        return None
    found = Maps(*(torch.tensor(qmap, dtype=torch.float32) for qmap in maps), *made)
    if not matches_torchao(found):
        logger.warning("AdamW8bit: the fused update's eager arithmetic differs from this torchao's "
                       "single_param_adam, so the compiled update runs torchao's function instead")
        return None
    return found


def matches_torchao(maps: Maps, numel: int = 4096) -> bool:
    """Whether the two halves, eagerly, give torchao's eager `single_param_adam` bits on one tile (AdamW and
    Adam's L2 decay), so that a torchao whose arithmetic changed is never stepped by a copy of the old one."""
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

    g = torch.Generator().manual_seed(0)
    weights, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g) / 100
    states = (torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8), torch.rand(numel // 256, generator=g),
              torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8), torch.rand(numel // 256, generator=g))
    step, lr = torch.tensor(3.0), torch.tensor(1e-3)
    for decoupled in (True, False):
        ours, theirs = [weights.clone(), *(t.clone() for t in states)], [weights.clone(), *(t.clone() for t in states)]
        adam8bit(ours[0], grad, step, tuple(ours[1:]), maps, lr, 0.9, 0.999, 0.01, 1e-8, decoupled, compiled=False)
        moments = (OptimState8bit(theirs[1], theirs[2], maps.signed, True),
                   OptimState8bit(theirs[3], theirs[4], maps.unsigned, False))
        single_param_adam(theirs[0], grad, step, *moments, None, lr, 0.9, 0.999, 0.01, 1e-8, decoupled, False)
        if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
            return False
    return True


def quantize_by_table(normalized: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """torchao's 8-bit code of each normalized fp32 value: one gather and one comparison."""
    pattern = normalized.view(torch.int32)
    entry = table[(pattern >> 16) & 0xFFFF]
    return torch.where((pattern & 0xFFFF) >= (entry & 0xFFFF), (entry >> 24) & 0xFF, (entry >> 16) & 0xFF
                       ).to(torch.uint8)


def _dequantized(codes: torch.Tensor, qmap: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torchao's dequant_with_qmap, flat."""
    return (qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)).view(-1)


def _quantize_into(values: torch.Tensor, table: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """torchao's scale_tensor then quantize_8bit_with_qmap (by the table), written into codes and scale."""
    blocks = values.view(scale.shape[0], -1)
    absmax = blocks.abs().amax(-1).clip(1e-12)
    codes.copy_(quantize_by_table((blocks / absmax.view(-1, 1)).view(-1), table))
    scale.copy_(absmax)


def new_moments(weights: torch.Tensor, grad: torch.Tensor, exp_avg_codes: torch.Tensor, exp_avg_scale: torch.Tensor,
                exp_avg_sq_codes: torch.Tensor, exp_avg_sq_scale: torch.Tensor, signed_map: torch.Tensor,
                unsigned_map: torch.Tensor, beta1: float, beta2: float, weight_decay: float,
                decoupled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of the update: the moments dequantized and moved toward the gradient (plus the L2 term when
    not decoupled), in fp32."""
    if not decoupled:
        grad = grad + weight_decay * weights
    exp_avg = _dequantized(exp_avg_codes, signed_map, exp_avg_scale).lerp(grad, 1 - beta1)
    exp_avg_sq = _dequantized(exp_avg_sq_codes, unsigned_map, exp_avg_sq_scale).lerp(grad.square(), 1 - beta2)
    return exp_avg, exp_avg_sq


def quantize_and_step(weights: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: torch.Tensor,
                      exp_avg_codes: torch.Tensor, exp_avg_scale: torch.Tensor, exp_avg_sq_codes: torch.Tensor,
                      exp_avg_sq_scale: torch.Tensor, signed_table: torch.Tensor, unsigned_table: torch.Tensor,
                      lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float, eps: float,
                      decoupled: bool) -> None:
    """The second half: the new moments quantized into their codes and scales, the weights stepped in place."""
    p_f32 = weights - lr * weight_decay * weights if decoupled else weights
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    _quantize_into(exp_avg, signed_table, exp_avg_codes, exp_avg_scale)
    _quantize_into(exp_avg_sq, unsigned_table, exp_avg_sq_codes, exp_avg_sq_scale)
    denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()) + eps
    weights.copy_(p_f32 - lr * (exp_avg / bias_correction1) / denom)


def adam8bit(weights: torch.Tensor, grad: torch.Tensor, step: torch.Tensor, states: tuple[torch.Tensor, ...],
             maps: Maps, lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float, eps: float,
             decoupled: bool, compiled: bool = True) -> None:
    """torchao's single_param_adam on fp32 `weights` and `grad` with 8-bit moments held as `states` (exp_avg's
    codes and fp32 scales, then exp_avg_sq's), in place, in its op order (Note [fused 8-bit update]); eagerly
    with compiled=False (what `matches_torchao` checks)."""
    first, second = _compiled_halves() if compiled else (new_moments, quantize_and_step)
    # one graph per shape and flags, as torchao's optimizer compiles its own: never fall back to eager ops (other
    # last bits) when a model has more flag combinations than dynamo's default limit
    with torch._dynamo.utils.disable_cache_limit():
        exp_avg, exp_avg_sq = first(weights, grad, *states, maps.signed, maps.unsigned, beta1, beta2, weight_decay,
                                    decoupled)
        second(weights, exp_avg, exp_avg_sq, step, *states, maps.signed_table, maps.unsigned_table, lr, beta1,
               beta2, weight_decay, eps, decoupled)


@functools.cache
def _compiled_halves():
    """Both halves compiled. Two graphs, not one: in one, inductor recomputes the dequantized moments in each of
    its loops over the tile, which costs more than writing them once."""
    return (torch.compile(new_moments, fullgraph=True, dynamic=False),
            torch.compile(quantize_and_step, fullgraph=True, dynamic=False))
