"""TorchFSDPPlugin: FullyShardedDataParallel's full sharding as ZeRO stage 3."""

from __future__ import annotations

import torch

from engine.compat.colossalai.booster.plugin.dp_plugin_base import DPPluginBase, clipping_section, refuse_changed
from engine.compat.colossalai.unsupported import refuse


def _precision_of(mixed_precision) -> dict:
    """FSDP's MixedPrecision with bf16 parameters (reduced and buffered in bf16 or left alone) as Tiers' bf16;
    anything else (fp32 parameters with a bf16 reduction, fp16) is refused."""
    if mixed_precision is None:
        return {}
    rest = {getattr(mixed_precision, name, None) for name in ("reduce_dtype", "buffer_dtype")}
    if getattr(mixed_precision, "param_dtype", None) is torch.bfloat16 and rest <= {None, torch.bfloat16}:
        return {"bf16": {"enabled": True}}
    refuse(f"TorchFSDPPlugin(mixed_precision={mixed_precision})", "use MixedPrecision(param_dtype=torch.bfloat16, "
           "reduce_dtype=torch.bfloat16), or none")


class TorchFSDPPlugin(DPPluginBase):
    """max_norm is Tiers' argument (FSDP clips in the script: give the norm here, see OptimizerWrapper)."""

    def __init__(self, process_group=None, sharding_strategy=None, cpu_offload=None, auto_wrap_policy=None,
                 backward_prefetch=None, mixed_precision=None, ignored_modules=None, param_init_fn=None,
                 sync_module_states: bool = False, fp8_communication: bool = False, *, max_norm: float = 0.0):
        refuse_changed("TorchFSDPPlugin", locals(), {"process_group": None, "ignored_modules": None,
                                                     "param_init_fn": None, "fp8_communication": False})
        if sharding_strategy is not None and getattr(sharding_strategy, "name", None) != "FULL_SHARD":
            refuse(f"TorchFSDPPlugin(sharding_strategy={sharding_strategy})", "use FULL_SHARD (ZeRO stage 3), or "
                   "LowLevelZeroPlugin(stage=2) for SHARD_GRAD_OP")
        super().__init__()
        self.offload = bool(getattr(cpu_offload, "offload_params", False))
        self.precision = _precision_of(mixed_precision)
        self.max_norm = max_norm

    def support_no_sync(self) -> bool:
        return False

    def tiers_config(self) -> dict:
        zero: dict = {"stage": 3}
        if self.offload:
            zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
        return {"zero_optimization": zero, **self.precision, **clipping_section(self.max_norm)}
