"""deepspeed.runtime.lr_schedules: DeepSpeed's schedules, which Tiers implements (engine.lr_schedules)."""

from engine.compat.deepspeed.unsupported import refuse
from engine.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401


def __getattr__(name: str):
    refuse(f"deepspeed.runtime.lr_schedules.{name}", "WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle")
