"""deepspeed.moe: the MoE layer on Tiers (engine.moe)."""

from engine.compat.deepspeed.moe import layer, utils  # noqa: F401
