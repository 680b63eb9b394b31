"""Where a checkpointed region keeps its inputs until the recompute: split over the tp ranks, in CPU memory.

Note [saved inputs of a checkpoint]
torch's non-reentrant checkpoint keeps the region's tensor arguments as saved tensors (through any
saved-tensor hooks around it) and hands them back to the recompute. To keep less, the region is
given stand-ins instead: a 1/tp piece of each input (partition_activations) and/or a copy in CPU
memory (cpu_checkpointing). The region turns a stand-in back into the whole input, except in the
first forward, which uses the input itself. Only activations get stand-ins: floating-point tensors
on the device that need a gradient (a mask shared by every block stays one shared tensor).
Partitioning assumes the input is the same on every rank of the tp group (a 1D block's input is):
the pieces all-gather back into it. The first input of each checkpointed site is checked for that
once (an elementwise max and min over the group), so that splitting a per-rank activation (say, an
attention module's heads) is an error rather than a silent mix of ranks' inputs.
The gradient must still reach the input whole, without keeping it: an *anchor*, a tensor of the
input's shape with zero strides (one element of storage), is made from the input by `_Anchor` and
joined to the restored value by `_Rejoin`. Backward passes the region's input gradient through
`_Rejoin` to the anchor and through `_Anchor` to the input, unchanged and without communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.comm import all_gather_into, all_reduce_max
from engine.tensor_parallel.mappings import TPGroup


class _Anchor(torch.autograd.Function):
    """forward: a zero-stride stand-in of x's shape (no copy of x); backward: the gradient, to x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(x.shape, [0] * x.dim(), dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Rejoin(torch.autograd.Function):
    """forward: the restored input's values; backward: the gradient, to the anchor."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass
class StoredInput:
    """What the region needs, besides the stand-in, to rebuild one input."""

    shape: torch.Size
    dtype: torch.dtype
    anchor: torch.Tensor  # Note [saved inputs of a checkpoint]
    copied: torch.cuda.Event | None = None  # cpu_checkpointing on CUDA: the copy to pinned memory is done


class InputStore:
    """Packs inputs into stand-ins and restores them (Note [saved inputs of a checkpoint])."""

    def __init__(self, device: torch.device, partition: TPGroup | None, to_cpu: bool):
        self.device = device
        self.partition = partition
        self.to_cpu = to_cpu and device.type == "cuda"  # on a CPU device the inputs are in CPU memory already
        self._side_stream = torch.cuda.Stream(device) if self.to_cpu else None
        self._checked_sites: set[str] = set()  # partitioned sites whose input was seen replicated

    @property
    def active(self) -> bool:
        return self.partition is not None or self.to_cpu

    def eligible(self, value) -> bool:
        """Activations: floating-point tensors on the device that need a gradient, large enough to split."""
        pieces = self.partition.size if self.partition is not None else 1
        return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad
                and value.device == self.device and value.numel() >= pieces)

    def pack(self, x: torch.Tensor, site: str) -> tuple[torch.Tensor, StoredInput]:
        """(stand-in, what restores it); neither holds x's storage. `site` names the checkpointed module or
        function, for the replication check and its error."""
        stored = StoredInput(x.shape, x.dtype, _Anchor.apply(x))
        payload = x.detach()
        if self.partition is not None:
            self._check_replicated(payload, site)
            payload = self._own_piece(payload)
        if self.to_cpu:
            payload, stored.copied = self._copy_to_cpu(payload)
        return payload, stored

    def restore(self, payload: torch.Tensor, stored: StoredInput) -> torch.Tensor:
        if self.to_cpu:
            torch.cuda.current_stream(self.device).wait_event(stored.copied)
            payload = payload.to(self.device, non_blocking=True)
        if self.partition is not None:
            payload = self._gathered(payload, stored)
        return payload

    def rejoin(self, value: torch.Tensor, stored: StoredInput) -> torch.Tensor:
        """The region's input: `value` carrying the gradient back to the original input."""
        return _Rejoin.apply(stored.anchor, value)

    def copies_done(self, stored: list[StoredInput]) -> None:
        """cpu_checkpointing: the compute stream waits for the copies to CPU before going on, so that nothing
        after the region writes over an input (in place) before its copy has read it."""
        for s in stored:
            if s.copied is not None:
                torch.cuda.current_stream(self.device).wait_event(s.copied)

    def _check_replicated(self, x: torch.Tensor, site: str) -> None:
        if site in self._checked_sites:
            return
        tp = self.partition
        bounds = torch.stack([x, -x])
        all_reduce_max(bounds, tp.group, tp.counter)
        high, low = bounds[0], -bounds[1]
        if not bool(((high == low) | (high.isnan() & low.isnan())).all()):
            raise RuntimeError(
                f"activation_checkpointing.partition_activations: the input of {site} differs between the "
                f"tensor-parallel ranks (it is split over them, not replicated), so its pieces would not all-gather "
                f"back into it; checkpoint modules whose input every tp rank holds whole (the transformer blocks, "
                f"the default), or set partition_activations to false")
        self._checked_sites.add(site)

    def _own_piece(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.partition
        piece = -(-x.numel() // tp.size)
        flat = x.reshape(-1)[tp.rank * piece:(tp.rank + 1) * piece]
        own = torch.zeros(piece, dtype=x.dtype, device=x.device)  # the last piece may be short
        own[:flat.numel()] = flat
        return own

    def _gathered(self, own: torch.Tensor, stored: StoredInput) -> torch.Tensor:
        tp = self.partition
        whole = torch.empty(own.numel() * tp.size, dtype=own.dtype, device=own.device)
        all_gather_into(whole, own, tp.group, tp.counter, async_op=False)
        return whole[:stored.shape.numel()].view(stored.shape)

    def _copy_to_cpu(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned copy made on a side stream, so that the copy overlaps the forward's compute."""
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        x.record_stream(side)  # x's memory is not reused before the copy has read it
        return host, copied
