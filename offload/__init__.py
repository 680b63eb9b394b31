"""Heterogeneous memory manager: chunks of tensors paged between device, CPU and NVMe.

Stands alone (imports nothing from `engine/`):

    from offload import Budgets, ChunkManager, Location, NvmeSettings
    with ChunkManager("cuda", Budgets(device=8 << 30, cpu=32 << 30), nvme=NvmeSettings("/nvme")) as manager:
        refs = manager.register("param", [p.data for p in model.parameters()])
        weight = manager.access(refs[0].chunk, Location.DEVICE)[refs[0].index]
        ...
        manager.release(refs[0].chunk)
        manager.end_iteration()
"""

from offload.chunk import DEFAULT_CHUNK_CAPACITY, Chunk, ChunkList, Location, plan_slots
from offload.device_tier import MeasuredPlacement
from offload.errors import OffloadError, SwapDirectoryError, SwapIntegrityError, SwapUsageError, SwapWriteError
from offload.manager import BudgetError, Budgets, ChunkManager, TensorRef
from offload.nvme import NvmeSettings, NvmeStore
from offload.states import IllegalTransition, TensorState
from offload.stats import ManagerStats

__all__ = [
    "DEFAULT_CHUNK_CAPACITY", "BudgetError", "Budgets", "Chunk", "ChunkList", "ChunkManager", "IllegalTransition",
    "Location", "ManagerStats", "MeasuredPlacement", "NvmeSettings", "NvmeStore", "OffloadError",
    "SwapDirectoryError", "SwapIntegrityError", "SwapUsageError", "SwapWriteError", "TensorRef", "TensorState",
    "plan_slots",
]
