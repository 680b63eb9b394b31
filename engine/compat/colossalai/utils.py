"""colossalai.utils: the current device and the seed."""

from __future__ import annotations

import torch

from engine.compat.colossalai.accelerator import get_accelerator
from engine.compat.colossalai.launch import set_seed

__all__ = ["get_current_device", "set_seed"]


def get_current_device() -> torch.device:
    return get_accelerator().get_current_device()
