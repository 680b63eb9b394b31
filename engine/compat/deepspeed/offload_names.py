"""Where states may be offloaded, and which states, by DeepSpeed's names (deepspeed.runtime.zero.offload_config's;
that module re-exports them, the engine imports them from here: deepspeed.runtime re-exports the engine)."""

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
