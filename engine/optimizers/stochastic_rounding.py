"""Stochastic rounding of fp32 values to bf16, with random bits keyed on (seed, step, parameter, element).

Note [keyed stochastic rounding]
`bf16.stochastic_rounding` (Tiers' key) rounds each updated fp32 value to one of its two bf16 neighbours, away
from zero with probability (the 16 low bits bf16 drops) / 2^16, so the rounding is unbiased and updates smaller
than bf16's last place still move the weight on average. It adds 0xFFFF minus 16 uniform random bits r to the fp32
bit pattern and truncates: the carry reaches bf16's last place exactly when r < the low bits, which is torchao's
`_fp32_to_bf16_sr` rule (a test checks the two agree on the same draws); the draws differ. torchao draws them from the
global generator, which would make the weights depend on how the tensor is cut. Here the bits of element i of a
parameter at optimizer step t are a function of (seed, t, the parameter's name, i) alone:
- the elements of a parameter are cut into blocks of 65536 from its start; block b's bits are the 16-bit pieces, in
  memory order, of the first full-range 64-bit draws of a torch.Generator seeded with a hash of (seed, t, crc32 of
  the name, b) (a prefix of the block when fewer are needed, which are the same draws; four pieces a draw cost a
  third of drawing each 16-bit value alone);
- a stepped tensor (a chunk, or this rank's shard of one) knows where each parameter lies in it (`KeySpan`),
  so any data-parallel size, ZeRO stage, tile size or resharded resume gives every element the same bits, and a
  run's weights are the same. Padding gets no bits (it stays zero).
`seed` is the config's top-level `seed` (0 when absent); t is the optimizer's own step count, which checkpoints
keep. The draws are always the CPU generator's (then copied to the tensor's device), so a tensor stepped on the
host or on an accelerator, which offload placements decide, rounds the same way. Under tensor parallelism a slice
of a parameter is keyed by the name and the element's index in the slice.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

BLOCK = 1 << 16  # elements per generator seed
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class KeySpan:
    """Elements [offset, offset + numel) of a stepped tensor are elements [first, first + numel) of the parameter
    whose key is `key`."""

    offset: int
    numel: int
    key: int
    first: int


def parameter_key(name: str) -> int:
    """A parameter's key: the crc32 of its name in the whole model."""
    return zlib.crc32(name.encode())


def _mix(x: int) -> int:
    """splitmix64's finalizer: 64 well-mixed bits of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class KeyedBits:
    """The random bits of Note [keyed stochastic rounding] for one run's seed."""

    def __init__(self, seed: int):
        self.seed = seed

    def block_seed(self, step: int, key: int, block: int) -> int:
        return _mix(_mix(_mix(self.seed ^ _mix(step)) ^ key) ^ block)

    def bits(self, step: int, spans: list[KeySpan], start: int, numel: int, device: torch.device) -> torch.Tensor:
        """Random 16-bit values (int32 in [0, 65536)) for elements [start, start + numel) of a stepped tensor whose
        parameters lie as `spans` say; elements no span covers get 0."""
        covered = sum(max(0, min(span.offset + span.numel, start + numel) - max(span.offset, start)) for span in spans)
        # every element gets its draw where the spans cover the range (they never overlap), else 0 first
        out = torch.empty(numel, dtype=torch.int32) if covered == numel else torch.zeros(numel, dtype=torch.int32)
        generator = torch.Generator()
        for span in spans:
            lo, hi = max(span.offset, start), min(span.offset + span.numel, start + numel)
            element, end = span.first + lo - span.offset, span.first + hi - span.offset  # the parameter's indices
            while element < end:
                block = element // BLOCK
                first, upto = element - block * BLOCK, min(end - block * BLOCK, BLOCK)
                generator.manual_seed(self.block_seed(step, span.key, block))
                at = lo - start + element - (span.first + lo - span.offset)
                out[at:at + upto - first].copy_(_draws(generator, upto)[first:])
                element += upto - first
        return out.to(device)


def _draws(generator: torch.Generator, count: int) -> torch.Tensor:
    """`count` uniform 16-bit values (uint16): the pieces of full-range 64-bit draws in memory order, so the first
    values of more draws are these."""
    words = torch.empty(-(-count // 4), dtype=torch.int64).random_(-(1 << 63), None, generator=generator)
    return words.view(torch.uint16)[:count]


def _carry_and_truncate_(pattern: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns, in place: + 0xFFFF - bits, then the 16 low bits cleared (what bf16 keeps). The carry
    reaches bf16's last place exactly when bits < the low 16 bits: torchao's rule on the same draws."""
    return pattern.add_(0xFFFF).sub_(bits).bitwise_and_(-65536)


def round_stochastically(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 `values`, each rounded away from zero when its 16 low bits plus `bits` carry (Note [keyed
    stochastic rounding]); NaN stays NaN (the carry could otherwise wrap a NaN's pattern into a number)."""
    rounded = _carry_and_truncate_(values.view(torch.int32).clone(), bits).view(torch.float32).to(torch.bfloat16)
    return torch.where(values.isnan(), values.to(torch.bfloat16), rounded)


def round_stochastically_into(out: torch.Tensor, values: torch.Tensor, bits: torch.Tensor) -> None:
    """out.copy_(round_stochastically(values, bits)) with fewer passes: the rounding happens in the storage of
    `values` (an fp32 scratch tile: it is overwritten), and the NaN guard only runs where a NaN is present (found
    by one max reduction, which propagates NaN, with no mask written)."""
    if bool(values.amax().isnan()):
        out.copy_(round_stochastically(values, bits))
        return
    _carry_and_truncate_(values.view(torch.int32), bits)
    out.copy_(values)  # exact: the 16 low bits are zero

