"""Pipeline parallelism on an unmodified model: cut into stages at its block list (model_split, partition,
block_timing), schedules as data checked and simulated before they run (schedules, simulate), a runner that executes
one rank's actions over the stage modules it holds (executor, p2p, weight_grads), and train_batch / eval_batch
driving a step through them (driver)."""

from engine.pipeline.executor import PipelineRunner, PipelineTimeout, StepResult
from engine.pipeline.schedules import SCHEDULES, Action, ActionKind, Schedule, build_schedule
from engine.pipeline.simulate import ScheduleError, Simulation, check, simulate

__all__ = ["SCHEDULES", "Action", "ActionKind", "PipelineRunner", "PipelineTimeout", "Schedule", "ScheduleError",
           "Simulation", "StepResult", "build_schedule", "check", "simulate"]
