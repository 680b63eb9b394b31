"""deepspeed.ops: DeepSpeed's optimizers, as torch's with DeepSpeed's argument names."""

from engine.compat.deepspeed.ops import adam  # noqa: F401
