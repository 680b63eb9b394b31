"""Adam's moments quantized block-wise to 8 or 4 bits (torchao's AdamW8bit / AdamW4bit states), held as plain bytes.

Note [block-wise optimizer states]
`optimizer.type` "AdamW8bit" / "AdamW4bit" (and "Adam8bit" / "Adam4bit": L2 weight decay) keep exp_avg and
exp_avg_sq as torchao's OptimState8bit / OptimState4bit do: codes of 8 (or 4, two to a byte) bits into torchao's
quantization maps (its dynamic-tree maps; 4-bit exp_avg_sq linear without zero) and one fp32 scale (the absmax)
per block of `block_size` elements (256; 128 for 4-bit). torchao quantizes a parameter's states only when it has at
least 4096 elements and a whole number of blocks, in blocks from its first element; the others keep plain moments.
Tiers follows the same rule and makes quantization independent of the sharding:
- parameters torchao would quantize are packed into chunks of their own (every member a whole number of blocks,
  so each starts on a block boundary), and those chunks are sized to a multiple of block_size x the shard count,
  so every rank's shard is a whole number of the same blocks, at any data-parallel size or ZeRO stage;
- the other parameters' chunks keep plain moments (fp32, or bf16 beside bf16 masters with bf16_optimizer_states).
A quantized stepped tensor of n elements has 4 state tensors, all uint8 so that a chunk manager pages them as one
chunk: `exp_avg.codes`, `exp_avg.scale` (the fp32 scales' bytes, 4 x n / block_size), and the same for
exp_avg_sq: n x (2 x bits / 8 + 8 / block_size) bytes, 2.03 per element at 8 bits and 1.06 at 4. The update
(TiledAdam) wraps a tile's slices of them in torchao's own state classes and runs torchao's `single_param_adam`
on them eagerly: torchao's arithmetic, bit for bit (its optimizer compiles the same function per shape, which
rounds the last bit of a few values differently). Checkpoints save the codes and scale bytes as they are, by
parameter range like any state (Note [checkpoint layout]), so a resharded load is exact.
Eager torchao arithmetic costs ~500 ns per element on a 2-core CPU; `optimizer.params.compile: true` compiles the
update (torch.compile, as torchao's optimizer does) on tiles of one shape, the last one padded with zero blocks
(they quantize alone, to zero), so it compiles once per state format: 8-bit states by Tiers' fused kernel, bit for
bit torchao's compiled function in less than a third of its time (Note [fused 8-bit update]: ~6 ns per element on
1 M-element tiles here, against ~21), 4-bit ones by torchao's function. A compiled kernel rounds a few values
differently from the eager ops (fp32's last bits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
SMALLEST = 4096  # torchao quantizes states of parameters at least this large


def import_torchao():
    """torchao's optim package, or an error that says how to install it."""
    try:
        from torchao.optim import subclass_4bit, subclass_8bit
    except ImportError as e:
        raise ImportError("optimizer.type AdamW8bit / AdamW4bit keeps torchao's block-wise states; install torchao "
                          "(pip install 'torchao>=0.18', or Tiers' `hf` extra)") from e
    return subclass_8bit, subclass_4bit


@dataclass(frozen=True)
class BlockwiseStates:
    """The block-wise format of one optimizer's moments: `bits` per element (8 or 4) in blocks of `block`."""

    bits: int
    block: int

    def quantizes(self, numel: int) -> bool:
        """torchao's rule: a parameter's states are quantized when it has >= 4096 elements in whole blocks."""
        return numel >= SMALLEST and numel % self.block == 0

    def names(self) -> list[str]:
        return [f"{m}.{part}" for m in MOMENTS for part in ("codes", "scale")]

    def entries_per_element(self, name: str) -> Fraction:
        """Bytes of state tensor `name` per stepped element (a checkpoint slices them by element ranges)."""
        return Fraction(self.bits, 8) if name.endswith(".codes") else Fraction(4, self.block)

    def zeros(self, numel: int, device: torch.device) -> list[torch.Tensor]:
        """The state tensors of a stepped tensor of `numel` elements (whole blocks), as zeros: all moments 0."""
        return [torch.zeros(int(numel * self.entries_per_element(n)), dtype=torch.uint8, device=device)
                for n in self.names()]

    def moments(self, states: dict[str, torch.Tensor], start: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """torchao state objects over elements [start, start + numel) (whole blocks) of the byte tensors `states`:
        writing them (copy_) writes the bytes in place."""
        subclass_8bit, subclass_4bit = import_torchao()
        out = []
        for moment, signed in zip(MOMENTS, (True, False)):
            codes_per, scale_per = (self.entries_per_element(f"{moment}.{p}") for p in ("codes", "scale"))
            codes = states[f"{moment}.codes"].narrow(0, int(start * codes_per), int(numel * codes_per))
            scale = states[f"{moment}.scale"].narrow(0, int(start * scale_per), int(numel * scale_per))
            scale = scale.view(torch.float32)
            if self.bits == 8:
                qmap = subclass_8bit.get_qmap_signed() if signed else subclass_8bit.get_qmap_unsigned()
                out.append(subclass_8bit.OptimState8bit(codes, scale, _qmap(qmap, codes.device), signed))
            else:
                qmap = subclass_4bit.get_qmap_signed() if signed else subclass_4bit.get_qmap_unsigned()
                out.append(subclass_4bit.OptimState4bit(codes, scale, _qmap(qmap, codes.device), signed, (numel,)))
        return out[0], out[1]


@functools.cache
def _qmap(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """torchao's map as an fp32 tensor on `device`, made once."""
    return torch.tensor(values, dtype=torch.float32, device=device)
