"""deepspeed.runtime: the helpers, schedules and engine class scripts import from it."""

from engine.compat.deepspeed.runtime import engine, lr_schedules, utils, zero  # noqa: F401
