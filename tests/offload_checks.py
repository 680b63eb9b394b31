"""Shared checks of the randomized ChunkManager tests: arbitrary bit patterns, exact byte equality, and
what the manager really holds per tier, recounted from its buffers (not from its own counters)."""

from __future__ import annotations

import torch

from offload.chunk import Location
from offload.manager import ChunkManager

_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.int64: torch.int64}


def random_bits(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, subnormals included): only exact bytes compare equal."""
    int_dtype = _INT_OF[dtype]
    info = torch.iinfo(int_dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=int_dtype).view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def held_bytes(m: ChunkManager) -> dict[Location, int]:
    """Bytes per tier: payload buffers, source buffers of transfers in flight, kept free host buffers."""
    held = {Location.DEVICE: 0, Location.CPU: m.pool.free_bytes}
    for entry in m._chunks.entries:
        if entry.chunk.payload is not None:
            held[entry.chunk.location] += entry.chunk.payload.untyped_storage().nbytes()
        if entry.transfer is not None and entry.transfer.frees is not None:
            location, buf = entry.transfer.frees
            held[location] += buf.untyped_storage().nbytes()
    return held
