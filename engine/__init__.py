"""Tiers: a training engine configured from one JSON file.

    from engine import initialize
    engine = initialize(model, "configs/dp.json")
"""

from engine.config import Config, ConfigError, load_config
from engine.engine import Engine
from engine.initialize import initialize
from engine.zero.zero_init import zero_init

__all__ = ["initialize", "zero_init", "Engine", "Config", "ConfigError", "load_config"]
