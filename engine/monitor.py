"""Per-step metrics to TensorBoard (one rank) and to stdout every `steps_per_print` steps.

TensorBoard tags (README lists them):
  Train/loss, Train/lr, Train/loss_scale, Train/grad_norm, Train/skipped_steps,
  Throughput/samples_per_sec, Throughput/tokens_per_sec (when token ids are seen),
  Time/step_ms, Memory/rss_bytes, Memory/device_allocated_bytes and
  Memory/device_peak_bytes (CUDA), Memory/chunk_bytes/{param,grad,optim} (model state held by this
  rank), Comm/bytes_per_step and Comm/{all_reduce,reduce_scatter,all_gather,all_to_all,p2p}_bytes_per_step;
  under a pipeline Pipeline/bubble_fraction and Pipeline/bubble_fraction_formula; with
  wall_clock_breakdown also
  Time/forward_ms, Time/backward_ms, Time/optimizer_ms (summed over the update's micro-steps); with
  activation_checkpointing.profile also Time/recompute_ms (the update's recomputes, summed); with MoE layers
  (Note [expert parallelism]) MoE/<layer>/tokens_expert_<e> (assignments each expert received, every rank's),
  MoE/<layer>/drop_rate (assignments dropped by capacity / routed) and MoE/<layer>/all_to_all_bytes (this rank's
  token exchanges, forward and backward).
"""

from __future__ import annotations

import os

import psutil
import torch

from engine.config_sections import TensorBoardConfig
from engine.step_metrics import StepMetrics, UpdateSummary


class Monitor:
    """Writes metrics only on the rank that owns it; other ranks get a monitor that does nothing."""

    def __init__(self, config: TensorBoardConfig, steps_per_print: int, is_writer_rank: bool, device: torch.device,
                 step_metrics: StepMetrics):
        self.step_metrics = step_metrics  # what each update did, counted as it runs
        self.steps_per_print = steps_per_print
        self.is_writer_rank = is_writer_rank
        self.device = device
        self._process = psutil.Process(os.getpid())
        self._writer = None
        if config.enabled and is_writer_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir = config.log_dir
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = SummaryWriter(log_dir=self.log_dir)

    def memory_metrics(self) -> dict[str, float]:
        metrics = {"Memory/rss_bytes": float(self._process.memory_info().rss)}
        if self.device.type == "cuda":
            metrics["Memory/device_allocated_bytes"] = float(torch.cuda.memory_allocated(self.device))
            metrics["Memory/device_peak_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
        return metrics

    def wants(self, step: int) -> bool:
        """Whether this step's metrics go anywhere (TensorBoard, or a print on this step)."""
        return self.is_writer_rank and (self._writer is not None or step % self.steps_per_print == 0)

    def end_update(self, summary: UpdateSummary) -> None:
        """The update's metrics, written where this monitor writes them (the counts restart either way)."""
        metrics = self.step_metrics.collect(summary, self.wants(summary.step))
        if metrics is not None:
            self.log_step(summary.step, {**metrics, **self.memory_metrics()})

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_writer_rank:
            return
        if self._writer is not None:
            for tag, value in metrics.items():
                self._writer.add_scalar(tag, value, step)
        if step % self.steps_per_print == 0:
            shown = ", ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items() if not k.startswith("Memory"))
            print(f"[tiers] step {step}: {shown}", flush=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
