"""A DeepSpeed-style config as the integrations read it before `initialize` loads it: a plain dict (from a dict or a
JSON file's path) whose "auto" values they fill, and what they must know of it before the engine exists."""

from __future__ import annotations

import copy
import json
import os

from engine.config import load_layout_sections


def read_config(config: str | os.PathLike | dict) -> dict:
    """A deep copy of `config` (a dict, or a JSON file's path)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    with open(config, encoding="utf-8") as f:
        return json.load(f)


def zero_stage(config: dict) -> int:
    """The config's ZeRO stage (0 when it names none), read as load_config reads it."""
    return load_layout_sections(config).zero_optimization.stage
