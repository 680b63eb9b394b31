"""TorchDDPPlugin: data parallelism without sharding (ZeRO stage 0); the precision is the Booster's
mixed_precision."""

from __future__ import annotations

from engine.compat.colossalai.booster.plugin.dp_plugin_base import DPPluginBase, refuse_changed


class TorchDDPPlugin(DPPluginBase):
    """DistributedDataParallel's bucket and graph options tune torch's reducer, which Tiers replaces by its chunk
    all-reduce (every chunk is reduced whole, so unused parameters need no flag either): they are accepted and have
    nothing to tune here."""

    def __init__(self, broadcast_buffers: bool = True, bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 fp8_communication: bool = False):
        refuse_changed("TorchDDPPlugin", locals(), {"broadcast_buffers": True, "fp8_communication": False})
        super().__init__()

    def tiers_config(self) -> dict:
        return {"zero_optimization": {"stage": 0}}

    def controls_precision(self) -> bool:
        return False
