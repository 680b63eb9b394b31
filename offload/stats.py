"""Counters of a ChunkManager, for the monitor (a snapshot; the manager keeps the live one)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ManagerStats:
    """What the memory manager did.

    resident_bytes / peak_bytes: bytes held per tier ("device", "cpu": payloads, buffers of copies in
    flight and kept free buffers; "nvme": payloads whose only copy is a swap file).
    moved_bytes: payload bytes per direction ("cpu->nvme", "nvme->cpu", "device->cpu", ...), counted when
    issued (a transfer that failed and was rolled back is in `failed_transfers` as well); nvme_written_bytes: the
    "cpu->nvme" bytes by chunk kind ("param", "frozen", "optim", ...), nvme_read_bytes the "nvme->cpu" ones;
    clean_drops_by_kind: `clean_drops` by chunk kind.
    prefetch_hits: accesses that found their chunk brought (or being brought) by a prefetch;
    prefetch_misses: accesses that had to start a transfer themselves.
    blocking_waits / io_wait_seconds: accesses that waited for a transfer still in flight, and how long.
    disk_bytes / peak_disk_bytes: the size of the swap files now and at most (Note [bytes on disk]), which the
    "nvme" resident bytes are not: those count payloads whose only copy is on disk, once.
    """

    resident_bytes: dict[str, int] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    moved_bytes: Counter = field(default_factory=Counter)
    nvme_written_bytes: Counter = field(default_factory=Counter)  # payload bytes written to NVMe, by chunk kind
    evictions: int = 0
    nvme_read_bytes: Counter = field(default_factory=Counter)  # payload bytes read from NVMe, by chunk kind
    clean_drops: int = 0  # evictions to NVMe that needed no write (Note [clean chunks])
    clean_drops_by_kind: Counter = field(default_factory=Counter)
    prefetches: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    blocking_waits: int = 0
    io_wait_seconds: float = 0.0
    trace_divergences: int = 0
    failed_transfers: int = 0  # rolled back in the background (their error reached a later demand, if any)
    peak_non_chunk_bytes: int = 0
    disk_bytes: int = 0
    peak_disk_bytes: int = 0

    def as_scalars(self, prefix: str = "Offload/") -> dict[str, float]:
        """Flat name → value pairs (TensorBoard scalars)."""
        out = {f"{prefix}resident_bytes/{k}": v for k, v in self.resident_bytes.items()}
        out.update({f"{prefix}moved_bytes/{k}": v for k, v in self.moved_bytes.items()})
        for name in ("evictions", "clean_drops", "prefetches", "prefetch_hits", "prefetch_misses", "blocking_waits",
                     "io_wait_seconds", "trace_divergences", "failed_transfers", "peak_non_chunk_bytes", "disk_bytes",
                     "peak_disk_bytes"):
            out[f"{prefix}{name}"] = getattr(self, name)
        return out
