"""TorchDDPPlugin: data parallelism without sharding (ZeRO stage 0); the precision is the Booster's
mixed_precision."""

from __future__ import annotations

from engine.compat.colossalai.booster.plugin.dp_plugin_base import (
    DPPluginBase,
    clipping_section,
    refuse_batch_norm,
    refuse_changed,
)


class TorchDDPPlugin(DPPluginBase):
    """DistributedDataParallel's bucket and graph options tune torch's reducer, which Tiers replaces by its chunk
    all-reduce (every chunk is reduced whole, so unused parameters need no flag either): they are accepted and have
    nothing to tune here. ColossalAI converts BatchNorm to SyncBatchNorm, which Tiers does not: a model with
    BatchNorm is refused over more than one rank (see check_model). max_norm is Tiers' argument (DDP scripts clip
    with optimizer.clip_grad_by_norm: give the norm here, see OptimizerWrapper)."""

    def __init__(self, broadcast_buffers: bool = True, bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 fp8_communication: bool = False, *, max_norm: float = 0.0):
        refuse_changed("TorchDDPPlugin", locals(), {"fp8_communication": False})
        super().__init__()
        self.max_norm = max_norm

    def tiers_config(self) -> dict:
        return {"zero_optimization": {"stage": 0}, **clipping_section(self.max_norm)}

    def check_model(self, model) -> None:
        refuse_batch_norm(type(self).__name__, model, self.data_parallel()[0])

    def controls_precision(self) -> bool:
        return False
