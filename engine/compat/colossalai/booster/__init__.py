"""colossalai.booster: Booster and its plugins on Tiers."""

from engine.compat.colossalai.booster import plugin
from engine.compat.colossalai.booster.booster import Booster

__all__ = ["Booster", "plugin"]
