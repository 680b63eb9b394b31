"""deepspeed.runtime.utils: see_memory_usage and set_random_seed."""

from __future__ import annotations

import gc
import logging
import random

import numpy as np
import psutil
import torch

logger = logging.getLogger("DeepSpeed")


def set_random_seed(seed: int) -> None:
    """Python's, numpy's and torch's generators (every device's), as DeepSpeed seeds them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Logs device and host memory on rank 0 when `force` (DeepSpeed logs nothing otherwise)."""
    if not force or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    gc.collect()
    gib = 2**30
    if torch.cuda.is_available():
        logger.info(f"{message} | MA {torch.cuda.memory_allocated() / gib:.2f} GB | Max_MA "
                    f"{torch.cuda.max_memory_allocated() / gib:.2f} GB | CA {torch.cuda.memory_reserved() / gib:.2f} "
                    f"GB | Max_CA {torch.cuda.max_memory_reserved() / gib:.2f} GB")
    memory = psutil.virtual_memory()
    logger.info(f"{message} | CPU Virtual Memory: used = {memory.used / gib:.2f} GB, percent = {memory.percent}%")
