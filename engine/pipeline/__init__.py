"""Pipeline parallelism: schedules as data, checked and simulated before they run, and a
runner that executes one rank's actions over the stage modules it holds."""

from engine.pipeline.executor import PipelineRunner, PipelineTimeout, StepResult
from engine.pipeline.schedules import SCHEDULES, Action, ActionKind, Schedule, build_schedule
from engine.pipeline.simulate import ScheduleError, Simulation, check, simulate

__all__ = ["SCHEDULES", "Action", "ActionKind", "PipelineRunner", "PipelineTimeout", "Schedule", "ScheduleError",
           "Simulation", "StepResult", "build_schedule", "check", "simulate"]
