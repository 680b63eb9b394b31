"""engine.tput_timer: DeepSpeed's ThroughputTimer, timed from each forward to the step() after it."""

from __future__ import annotations

import time


class ThroughputTimer:
    """Samples per second over the updates after the first `start_step` (DeepSpeed's warm-up of 2)."""

    def __init__(self, batch_size: int, start_step: int = 2):
        self.batch_size, self.start_step = batch_size, start_step
        self.global_step_count = self.micro_step_count = 0
        self.total_elapsed_time = 0.0
        self.started = False
        self.start_time = 0.0

    def start(self) -> None:
        if self.started:  # a second forward before step(): the micro-step began at the first
            return
        self.started = True
        self.start_time = time.perf_counter() if self.global_step_count >= self.start_step else 0.0

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.total_elapsed_time += time.perf_counter() - self.start_time

    def avg_samples_per_sec(self) -> float:
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")  # DeepSpeed's answer before any timed update
        return self.batch_size / (self.total_elapsed_time / timed_steps)
