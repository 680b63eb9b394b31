"""deepspeed.moe.layer.MoE is engine.moe.MoE: the same arguments and outputs (Note [expert parallelism])."""

from engine.moe.layer import MoE  # noqa: F401
