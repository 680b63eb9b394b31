"""What one update did, gathered over its micro-steps and turned into TensorBoard scalars (engine.monitor)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.comm import CommCounter

_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")


@dataclass(frozen=True)
class UpdateSummary:
    """The engine's side of an update's metrics, read when the update ends."""

    step: int
    lr: float
    loss_scale: float
    skipped_steps: int
    grad_norm: float | None
    samples: int  # train_batch_size: samples over all data-parallel ranks
    dp_world_size: int
    chunk_bytes: Callable[[], dict[str, int]]  # model state this rank holds, by kind (read only when logged)
    extra: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. the pipeline's bubble


class StepMetrics:
    """Counts an update's tokens, losses, phase times, collective bytes, recompute time and bytes the chunk
    manager moved; `collect` turns them into scalars and starts the next update's counts."""

    def __init__(self, comm: CommCounter, device: torch.device, wall_clock_breakdown: bool = False,
                 recompute_seconds: Callable[[], float] | None = None, offload_stats: Callable | None = None):
        """recompute_seconds: activation checkpointing's running recompute total, when profiled;
        offload_stats: reads the chunk manager's stats (offload.stats.ManagerStats), when there is one."""
        self.comm, self.device = comm, device
        self.wall_clock_breakdown = wall_clock_breakdown
        self.recompute_seconds, self.offload_stats = recompute_seconds, offload_stats
        self._phase_s = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._losses: list[torch.Tensor] = []
        self._tokens = 0
        self._step_start: float | None = None  # first training forward of the current update
        # the first update's counts start here: its moved bytes include the build's, so the per-update figures
        # add up to the manager's totals
        self._comm_at_start = dataclasses.replace(comm)
        self._recompute_at_start = 0.0
        self._moved_at_start: dict[str, int] = {}

    def exclude_traffic_so_far(self) -> None:
        """The collectives so far are not an update's traffic (the start-up broadcast)."""
        self._comm_at_start = dataclasses.replace(self.comm)

    def on_training_forward(self, args: tuple, kwargs: dict) -> None:
        self._tokens += _count_token_ids(args, kwargs)
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def on_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    @contextlib.contextmanager
    def timed(self, phase: str):
        """wall_clock_breakdown: time a phase (synchronizing the device so the time is the work's)."""
        if not self.wall_clock_breakdown:
            yield
            return
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(self.device)
            self._phase_s[phase] += time.perf_counter() - start

    def collect(self, summary: UpdateSummary, wanted: bool) -> dict[str, float] | None:
        """The update's scalars (None unless `wanted`: reading the loss would synchronize the device for
        nothing); the counts start again either way."""
        now = time.perf_counter()
        step_s = now - (self._step_start or now)
        comm, losses, tokens, phases = self._comm_at_start, self._losses, self._tokens, self._phase_s
        recompute_total = self.recompute_seconds() if self.recompute_seconds else 0.0
        recompute_s, self._recompute_at_start = recompute_total - self._recompute_at_start, recompute_total
        offload = self.offload_stats() if self.offload_stats is not None else None
        moved_total = dict(offload.moved_bytes) if offload is not None else {}
        moved = {k: v - self._moved_at_start.get(k, 0) for k, v in moved_total.items()}
        self._moved_at_start, self._comm_at_start = moved_total, dataclasses.replace(self.comm)
        self._step_start, self._losses, self._tokens = None, [], 0
        self._phase_s = dict.fromkeys(phases, 0.0)
        if not wanted:
            return None
        metrics = {
            "Train/loss": float(torch.stack(losses).float().mean()) if losses else float("nan"),
            "Train/lr": summary.lr,
            "Train/loss_scale": summary.loss_scale,
            "Train/skipped_steps": float(summary.skipped_steps),
            "Time/step_ms": step_s * 1000.0,
            "Comm/bytes_per_step": float(self.comm.total_bytes - comm.total_bytes),
            **{f"Comm/{kind}_bytes_per_step":
               float(getattr(self.comm, f"{kind}_bytes") - getattr(comm, f"{kind}_bytes"))
               for kind in _COLLECTIVES},
            **{f"Memory/chunk_bytes/{kind}": float(n) for kind, n in summary.chunk_bytes().items()},
            **_offload_scalars(offload, moved),
        }
        metrics.update(summary.extra)
        if summary.grad_norm is not None:
            metrics["Train/grad_norm"] = summary.grad_norm
        if self.recompute_seconds is not None:
            metrics["Time/recompute_ms"] = recompute_s * 1000.0
        if self.wall_clock_breakdown:
            metrics.update({f"Time/{phase}_ms": s * 1000.0 for phase, s in phases.items()})
        if step_s > 0:
            metrics["Throughput/samples_per_sec"] = summary.samples / step_s
            if tokens:
                metrics["Throughput/tokens_per_sec"] = tokens * summary.dp_world_size / step_s
        return metrics


def _offload_scalars(stats, moved: dict[str, int]) -> dict[str, float]:
    """The chunk manager's per-tier bytes and counters (Offload/...), and the bytes it moved between tiers
    during this update (Offload/moved_bytes_per_step/<from>-><to>)."""
    if stats is None:
        return {}
    return {**stats.as_scalars("Offload/"), **{f"Offload/moved_bytes_per_step/{k}": float(v) for k, v in moved.items()}}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count_token_ids(args: tuple, kwargs: dict) -> int:
    """Tokens in this micro-batch when the model takes integer token ids (first int tensor found)."""
    for value in (*args, *kwargs.values(), *(args[0].values() if args and isinstance(args[0], dict) else ())):
        if (isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() >= 1
                and value.dtype != torch.bool):
            return value.numel()
    return 0
