"""deepspeed.runtime: the helpers scripts import from it."""

from engine.compat.deepspeed.runtime import utils, zero  # noqa: F401
