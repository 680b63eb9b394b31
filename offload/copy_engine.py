"""Copies between the device tier and host memory: on CUDA on a side stream with events, else inline.

Note [side-stream copies]
On CUDA a device↔host copy of a chunk is issued on one side stream, after that stream waits for
the compute stream (the source or destination was allocated, or last written, there). An event
recorded after the copy is the transfer's completion: the compute stream waits on it (no host
block) before it uses a chunk brought to the device; the host waits on it (`wait_host`) before
a host buffer is read by the NVMe store or reused. `record_stream` tells the caching allocator
that the side stream used a device buffer, so freeing it on the compute stream stays safe.
Host buffers are pinned (Note [host buffer pool]), so the copies are truly asynchronous.
On a CPU-only machine the device tier is CPU memory: the copy is an ordinary copy, finished on
return, and every path above the copy engine runs unchanged.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function


class CopyDone:
    """A copy in flight (CUDA: its event) or already finished (None)."""

    def __init__(self, event: torch.cuda.Event | None = None, device: torch.device | None = None):
        self._event, self._device = event, device

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait_host(self) -> None:
        """Blocks the calling thread until the copy finished."""
        if self._event is not None:
            self._event.synchronize()

    def wait_stream(self) -> None:
        """Makes the current stream wait for the copy (no host block)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)


class CopyEngine:
    """Issues device↔host copies of chunk payloads (Note [side-stream copies])."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> CopyDone:
        """Starts `dst.copy_(src)`; `direction` names the profiler range ("device->cpu", ...)."""
        with record_function(f"tiers.copy.{direction}"):
            if self.side_stream is None:
                dst.copy_(src)
                return CopyDone()
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side_stream):
                dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self.side_stream)
            event = torch.cuda.Event()
            event.record(self.side_stream)
            return CopyDone(event, self.device)
