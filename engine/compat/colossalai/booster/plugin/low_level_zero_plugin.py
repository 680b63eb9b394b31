"""LowLevelZeroPlugin: ZeRO stage 1 or 2, the optimizer states (with cpu_offload) on the host."""

from __future__ import annotations

from engine.compat.colossalai.booster.plugin.dp_plugin_base import (
    DPPluginBase,
    LossScaling,
    clipping_section,
    precision_section,
    refuse_changed,
)


class LowLevelZeroPlugin(DPPluginBase):
    """The loss-scaling arguments set precision "fp16"'s scaler (LossScaling; cast_inputs casts the floating
    positional arguments of the forward to fp16, as fp16.auto_cast); the bucket and overlap options tune
    ColossalAI's reducer, which Tiers' chunk reduction replaces."""

    def __init__(self, stage: int = 1, precision: str = "fp16", initial_scale: float = 2 ** 32, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 2 ** 32, max_norm: float = 0.0, norm_type: float = 2.0,
                 reduce_bucket_size_in_m: int = 12, communication_dtype=None, overlap_communication: bool = True,
                 overlap_allgather: bool = False, cpu_offload: bool = False, master_weights: bool = True,
                 verbose: bool = False, cast_inputs: bool = True, fp8_communication: bool = False,
                 use_fp8: bool = False, extra_dp_size: int = 1):
        if stage not in (1, 2):
            raise ValueError(f"LowLevelZeroPlugin: stage {stage} is 1 or 2 (GeminiPlugin is ZeRO stage 3)")
        refuse_changed("LowLevelZeroPlugin", locals(), {"communication_dtype": None, "master_weights": True,
                                                          "fp8_communication": False, "use_fp8": False,
                                                          "extra_dp_size": 1, "norm_type": 2.0})
        super().__init__()
        self.stage, self.cpu_offload, self.max_norm = stage, cpu_offload, max_norm
        scaling = LossScaling(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                              max_scale, cast_inputs)
        self.precision = precision_section("LowLevelZeroPlugin", precision, scaling)

    def tiers_config(self) -> dict:
        zero = {"stage": self.stage}
        if self.cpu_offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        return {"zero_optimization": zero, **self.precision, **clipping_section(self.max_norm)}
