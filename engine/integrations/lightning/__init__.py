"""Lightning over a Tiers engine: `TiersStrategy` for lightning.Trainer (Note [Lightning's Trainer over an engine])
and `TiersFabricStrategy` for lightning.Fabric (Note [Fabric's loop over an engine])."""

from engine.integrations.lightning.fabric_strategy import TiersFabricPrecision, TiersFabricStrategy
from engine.integrations.lightning.settings import lightning_config
from engine.integrations.lightning.trainer_strategy import TiersPrecision, TiersStrategy

__all__ = ["lightning_config", "TiersFabricPrecision", "TiersFabricStrategy", "TiersPrecision", "TiersStrategy"]
