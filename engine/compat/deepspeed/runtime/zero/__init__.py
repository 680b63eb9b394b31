"""deepspeed.runtime.zero: the offload config's enums."""

from engine.compat.deepspeed.runtime.zero import offload_config  # noqa: F401
