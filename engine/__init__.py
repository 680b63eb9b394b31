"""Tiers: a training engine configured from one JSON file.

    from engine import initialize
    engine = initialize(model, "configs/dp.json")
"""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562), so that tools which never touch a tensor (`tiers launch`, `tiers config`) start
# without importing torch: the launcher's start-up is part of every job's.
_EXPORTS = {"initialize": "engine.initialization", "zero_init": "engine.zero.zero_init", "Engine": "engine.engine",
            "Config": "engine.config", "ConfigError": "engine.config", "load_config": "engine.config"}

__all__ = ["initialize", "zero_init", "Engine", "Config", "ConfigError", "load_config"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
