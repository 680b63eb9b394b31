"""Error-compensated 1-bit averaging over the data-parallel group (DeepSpeed's compressed_allreduce).

Note [compressed allreduce]
Each rank's tensor is sent as its signs (1 bit per element, packed 8 to a byte) and one scale per parameter,
the scale being the parameter's root mean square, so sign * scale keeps its norm. What compression drops is kept
as error feedback and added to the next message, so over many steps the sum of what was sent tracks the sum of
the true values. Two rounds, as in DeepSpeed:
  worker  x += worker_error; scale = |x| / sqrt(n); worker_error = x - scale * sign(x)
          all_to_all: rank r receives every rank's signs of its slice r; all_gather: every rank's scales
  server  (rank r, for its slice) y = mean over ranks of sign * scale, + server_error; scale' = |y| / sqrt(slice);
          server_error = y - scale' * sign(y); all_gather: every rank's slice signs and scales
  result  slice r = sign(y_r) * scale'_r: every rank ends with the same average.
sign(0) is +1. Each parameter is padded to a multiple of world * lcm(world, 8) elements (the padding enters its
scale, as in DeepSpeed), so every rank's slice of it is whole bytes. All parameters of one stepped tensor share
the four collectives: the padded values are laid out rank-major, [world, slice columns], with each parameter's
slice in its own columns, so the row for rank r is exactly what goes to r.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.profiler import record_function

from engine.comm import CommCounter

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """uint8 bytes holding (values >= 0) as bits, the first element in the highest bit (numpy's packbits order);
    the last dimension must divide by 8."""
    bits = (values >= 0).to(torch.uint8).unflatten(-1, (-1, 8))
    return (bits * _BIT_WEIGHTS.to(values.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values from pack_signs' bytes (8 per byte)."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2).to(dtype).mul_(2).sub_(1)


class CompressedAverager:
    """Averages the parameters held in one stepped tensor over the data-parallel group, 1-bit compressed with error
    feedback (Note [compressed allreduce]); the worker and server errors live here, one set per tensor."""

    def __init__(self, segments: list[tuple[int, int]], device: torch.device, group: dist.ProcessGroup | None,
                 rank: int, world: int, counter: CommCounter):
        self.group, self.rank, self.world, self.counter = group, rank, world, counter
        unit = world * (8 * world // math.gcd(world, 8))
        padded = [-(-numel // unit) * unit for _, numel in segments]
        self.columns = [p // world for p in padded]  # each parameter's slice width
        self.width = sum(self.columns)  # columns of the rank-major layout
        starts = [sum(self.columns[:i]) for i in range(len(segments))]
        source, target, column_owner = [], [], []
        for i, (offset, numel) in enumerate(segments):
            k = torch.arange(numel)
            source.append(offset + k)
            target.append((k // self.columns[i]) * self.width + starts[i] + k % self.columns[i])
            column_owner.append(torch.full((self.columns[i],), i))
        self.source = torch.cat(source).to(device)  # element of the stepped tensor
        self.target = torch.cat(target).to(device)  # its place in the flat [world, width] layout
        self.owner = torch.cat(column_owner).to(device)  # parameter of each column
        self.count = len(segments)
        self.padded = torch.tensor(padded, dtype=torch.float32, device=device)
        self.worker_error = torch.zeros(world, self.width, device=device)
        self.server_error = torch.zeros(self.width, device=device)

    def reset_errors(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    @torch.no_grad()
    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replaces the parameters' elements of `tensor` with their compressed average over the ranks."""
        with record_function("tiers.comm.compressed_average"):
            flat = tensor.view(-1)
            laid = torch.zeros(self.world * self.width, device=flat.device)
            laid[self.target] = flat[self.source].float()
            laid = laid.view(self.world, self.width).add_(self.worker_error)
            scales = self._scales(laid.square().sum(0), self.padded)
            self.worker_error.copy_(laid - scales[self.owner] * torch.where(laid >= 0, 1.0, -1.0))
            signs = self._all_to_all(pack_signs(laid))
            all_scales = self._all_gather(scales)
            server = (unpack_signs(signs) * all_scales[:, self.owner]).sum(0).div_(self.world).add_(self.server_error)
            server_scales = self._scales(server.square(), self.padded / self.world)
            self.server_error.copy_(server - server_scales[self.owner] * torch.where(server >= 0, 1.0, -1.0))
            result = unpack_signs(self._all_gather(pack_signs(server)))
            result.mul_(self._all_gather(server_scales)[:, self.owner])
            flat[self.source] = result.view(-1)[self.target].to(flat.dtype)
            return tensor

    def _scales(self, squares: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Per parameter: sqrt(sum of its columns' squares / its element count)."""
        sums = torch.zeros(self.count, device=squares.device).index_add_(0, self.owner, squares)
        return sums.div_(sizes).sqrt_()

    def _all_to_all(self, rows: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(rows)
        self.counter.all_to_all_bytes += rows.numel() * rows.element_size()
        dist.all_to_all_single(received, rows.contiguous(), group=self.group)
        return received

    def _all_gather(self, piece: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world * piece.numel(), dtype=piece.dtype, device=piece.device)
        self.counter.all_gather_bytes += out.numel() * out.element_size()
        self.counter.collectives.all_gather(out, piece.reshape(-1), group=self.group)
        return out.view(self.world, *piece.shape)
