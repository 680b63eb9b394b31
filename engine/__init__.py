"""Tiers: a training engine configured from one JSON file.

    from engine import initialize
    engine = initialize(model, "configs/dp.json")
"""

from engine.config import Config, ConfigError, load_config
from engine.engine import Engine
from engine.initialize import initialize

__all__ = ["initialize", "Engine", "Config", "ConfigError", "load_config"]
