"""deepspeed.runtime.engine: the engine class, for the isinstance checks integrations make."""

from engine.compat.deepspeed.engine import DeepSpeedEngine  # noqa: F401
