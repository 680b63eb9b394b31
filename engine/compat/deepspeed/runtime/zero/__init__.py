"""deepspeed.runtime.zero: the offload config's enums, ZeroParamStatus."""

from engine.compat.deepspeed.runtime.zero import offload_config, partition_parameters  # noqa: F401
