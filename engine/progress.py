"""The run's counters: micro-steps, updates and skipped updates (what a checkpoint saves and restores)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingProgress:
    """Note [micro-steps and boundaries]: `micro_step` counts engine.step() calls; every
    `gradient_accumulation_steps`-th one is a boundary, where the model is updated and `global_step` advances
    (also for an fp16 update skipped for overflow, which `skipped_steps` counts)."""

    gradient_accumulation_steps: int
    global_step: int = 0
    micro_step: int = 0
    skipped_steps: int = 0

    def is_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation."""
        return (self.micro_step + 1) % self.gradient_accumulation_steps == 0

    def end_micro_step(self) -> bool:
        """Counts a micro-step; returns whether it was the boundary."""
        boundary = self.is_boundary()
        self.micro_step += 1
        return boundary

    def end_update(self, skipped: bool) -> None:
        self.global_step += 1
        self.skipped_steps += int(skipped)
