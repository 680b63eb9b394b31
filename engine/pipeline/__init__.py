"""Pipeline parallelism (issue 22, in progress): schedules as data, checked and simulated before they run."""

from engine.pipeline.schedules import SCHEDULES, Action, ActionKind, Schedule, build_schedule
from engine.pipeline.simulate import ScheduleError, Simulation, check, simulate

__all__ = ["SCHEDULES", "Action", "ActionKind", "Schedule", "ScheduleError", "Simulation", "build_schedule", "check",
           "simulate"]
