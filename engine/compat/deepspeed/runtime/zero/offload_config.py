"""deepspeed.runtime.zero.offload_config: where states may be offloaded, and which states, by DeepSpeed's names."""

from engine.compat.deepspeed.offload_names import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
