"""The compute device's memory as offload sees it: the device itself, whether its memory is its own, and the
copies that cross between it and the host.

Note [separate device memory]
On CUDA the device has memory of its own: a chunk on the device tier and one on the CPU tier are different
memory, every move between them crosses the bus, and an optimizer state homed on the CPU is stepped there
(ZeRO-Offload). On a CPU-only machine the compute device *is* host memory. Every offload decision branches on
`DeviceMemory.separate`, never on the device's type, so one switch gives a CPU run the CUDA code path: with
`separate=True` on the CPU (the seam: `TIERS_SEPARATE_DEVICE_MEMORY=1`, or a device budget on a CPU-only
machine) the chunk manager's device tier is host memory accounted apart, the engine's tensors on the compute
device count as device memory, and the copies between them are real copies, counted as bus bytes — what tests,
benchmarks and `gpu_check.py --simulate` measure. It is a seam for those, not a user setting.
Copies the engine makes across the bus (a gradient shard sent down to its CPU home, an updated parameter shard
sent up) go through `down`, `down_async` and `up`, or the host step's StagingRing (Note [staged copies]), which
count them; the chunk manager counts its own moves (`ManagerStats.moved_bytes`).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import psutil
import torch
from torch.profiler import record_function

from offload.chunk import Location
from offload.copy_engine import CopyDone

SEPARATE_ENV = "TIERS_SEPARATE_DEVICE_MEMORY"
CAPACITY_ENV = "TIERS_DEVICE_MEMORY_BYTES"  # the seam's device size (default: this machine's RAM)
HOST_TO_DEVICE, DEVICE_TO_HOST = "host->device", "device->host"


@dataclass
class BusCounter:
    """Payload bytes the engine copied between the device and the host, each way."""

    host_to_device: int = 0
    device_to_host: int = 0

    @property
    def total(self) -> int:
        return self.host_to_device + self.device_to_host


class DeviceMemory:
    """The compute device and whether its memory is separate from the host's (Note [separate device memory])."""

    def __init__(self, device: torch.device | str, separate: bool | None = None):
        """separate: None = the device's own answer (CUDA and other accelerators yes, the CPU no, unless
        TIERS_SEPARATE_DEVICE_MEMORY=1 asks for the seam)."""
        self.device = torch.device(device)
        if separate is None:
            separate = self.device.type != "cpu" or os.environ.get(SEPARATE_ENV, "") == "1"
        self.separate = separate
        self.bus = BusCounter()
        # copies across the bus by (direction, pinned host memory, non_blocking): Note [staged copies]
        # (pinned: the host memory is pinned, or asked to be where nothing can be)
        self.requests: Counter[tuple[str, bool, bool]] = Counter()
        self.sampled_peak = 0  # the most device bytes any `sample` saw

    def sample(self, nbytes: int) -> None:
        """Records the bytes held on the device now (a CPU seam has no allocator to ask; on CUDA the allocator's own
        peak is the truth, and this is what the engine's state accounts for of it)."""
        self.sampled_peak = max(self.sampled_peak, nbytes)

    def __repr__(self) -> str:
        return f"DeviceMemory({self.device}, separate={self.separate})"

    def capacity(self) -> int:
        """The device's memory in bytes: CUDA's total; elsewhere TIERS_DEVICE_MEMORY_BYTES, else this machine's RAM."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[1]
        return int(os.environ.get(CAPACITY_ENV) or psutil.virtual_memory().total)

    def allocated(self) -> int | None:
        """Bytes the device's allocator has handed out now; None where there is no allocator to ask (CPU)."""
        if self.device.type != "cuda":
            return None
        # the allocator's nested stats: torch.cuda.memory_allocated flattens all of them first (~0.4 ms a call, and
        # the chunk manager asks at every access)
        stats = torch.cuda.memory.memory_stats_as_nested_dict(self.device)
        return stats.get("allocated_bytes", {}).get("all", {}).get("current", 0)

    def peak_allocated(self) -> int | None:
        """The most bytes the allocator has handed out at once (since start or the last reset), or None."""
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def process_rss(self) -> int:
        """This process's resident memory (where no allocator can be asked, the stand-in for what is in use)."""
        return psutil.Process(os.getpid()).memory_info().rss

    def reset_peak(self) -> None:
        """Starts a new peak for `peak_allocated` (CUDA: torch's peak memory stats of this device)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    def count(self, direction: str, nbytes: int, pinned: bool, non_blocking: bool) -> None:
        """Counts a copy across the bus (`direction`: HOST_TO_DEVICE or DEVICE_TO_HOST): its bytes, and the request
        (whether its host memory is pinned and whether it was issued non-blocking; Note [staged copies])."""
        if direction == HOST_TO_DEVICE:
            self.bus.host_to_device += nbytes
        else:
            self.bus.device_to_host += nbytes
        self.requests[(direction, pinned, non_blocking)] += 1

    def _pinned(self, host: torch.Tensor) -> bool:
        return self.device.type == "cuda" and host.is_pinned()

    def down(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor, counted; the tensor itself where the device is the host."""
        if not self.separate:
            return tensor
        with record_function("tiers.copy.device->host"):
            self.count(DEVICE_TO_HOST, tensor.numel() * tensor.element_size(), pinned=False, non_blocking=False)
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.host)
            out.copy_(tensor)
        return out

    def down_into(self, host: torch.Tensor, tensor: torch.Tensor) -> None:
        """host.copy_(device tensor), counted (the conversion to host's dtype happens on the host)."""
        if self.separate:
            self.count(DEVICE_TO_HOST, tensor.numel() * tensor.element_size(), self._pinned(host), False)
        with record_function("tiers.copy.device->host"):
            host.copy_(tensor)

    def down_async(self, host: torch.Tensor, tensor: torch.Tensor, pinned: bool) -> CopyDone:
        """host.copy_(device tensor), counted, issued non-blocking on the current (compute) stream: after the work
        queued there before it, before any queued after. `pinned`: whether `host` is pinned memory, or asked to be
        (recorded: Note [staged copies]). The host may read `host` only once the returned copy is done."""
        self.count(DEVICE_TO_HOST, tensor.numel() * tensor.element_size(), pinned, non_blocking=True)
        with record_function("tiers.copy.device->host"):
            if self.device.type != "cuda":
                host.copy_(tensor)
                return CopyDone()
            host.copy_(tensor, non_blocking=True)
            return CopyDone(torch.cuda.current_stream(self.device).record_event(), self.device)

    def copy(self, dst: torch.Tensor, dst_tier: Location, src: torch.Tensor, src_tier: Location) -> None:
        """dst.copy_(src) between tensors on the given tiers (CPU: the host), through `up` / `down_into` when they
        are apart, so that a copy across the bus is counted."""
        if dst_tier is src_tier or not self.separate:
            dst.copy_(src)
        elif dst_tier is Location.DEVICE:
            self.up(dst, src)
        else:
            self.down_into(dst, src)

    def up(self, device_tensor: torch.Tensor, host: torch.Tensor) -> None:
        """device_tensor.copy_(host tensor), converted to the device tensor's dtype on the host first, so that
        only its bytes cross the bus."""
        if host.dtype != device_tensor.dtype:
            host = host.to(device_tensor.dtype)
        if self.separate:
            self.count(HOST_TO_DEVICE, host.numel() * host.element_size(), self._pinned(host), False)
        with record_function("tiers.copy.host->device"):
            device_tensor.copy_(host)
