"""GeminiPlugin: ZeRO stage 3 over chunks, ColossalAI's placement fractions on Tiers' offload.

"static": shard_param_frac 1.0 shards every chunk (stage 3), 0.0 none (stage 2: parameters stay gathered);
offload_optim_frac is the share of chunks whose fp32 masters, gradients and optimizer states live on the host
(Tiers' offload_optimizer with `ratio`, stage 3); offload_param_frac 1.0 keeps the parameter chunks on the host
too, and counts only with the other two at 1.0, as in ColossalAI (any other value there is refused here rather
than ignored). "auto": everything offloaded, the chunk manager placing chunks on the device as memory allows
(Tiers' placement "auto"); the fractions do not apply and must stay at their defaults.
"""

from __future__ import annotations

from engine.compat.colossalai.booster.plugin.dp_plugin_base import (
    DPPluginBase,
    LossScaling,
    clipping_section,
    precision_section,
    refuse_changed,
)
from engine.compat.colossalai.unsupported import refuse

_FRACTIONS = {"shard_param_frac": 1.0, "offload_optim_frac": 0.0, "offload_param_frac": 0.0}


def _static_zero(shard_param_frac: float, offload_optim_frac: float, offload_param_frac: float) -> dict:
    if shard_param_frac not in (0.0, 1.0):
        refuse(f"GeminiPlugin(shard_param_frac={shard_param_frac}) (a share of the chunks kept gathered)",
               "use 1.0 (every chunk sharded, ZeRO-3) or 0.0 (none, ZeRO-2)")
    if not 0.0 <= offload_optim_frac <= 1.0:
        raise ValueError(f"GeminiPlugin: offload_optim_frac {offload_optim_frac} is a fraction in [0, 1]")
    if shard_param_frac == 0.0 and offload_optim_frac not in (0.0, 1.0):
        refuse(f"GeminiPlugin(shard_param_frac=0.0, offload_optim_frac={offload_optim_frac}) (a share of the "
               "states offloaded with the parameters kept gathered)", "use offload_optim_frac 0.0 or 1.0 with "
               "shard_param_frac=0.0, or shard_param_frac=1.0 for a share")
    if offload_param_frac and (shard_param_frac, offload_optim_frac, offload_param_frac) != (1.0, 1.0, 1.0):
        refuse(f"GeminiPlugin(offload_param_frac={offload_param_frac}) with shard_param_frac={shard_param_frac}, "
               f"offload_optim_frac={offload_optim_frac} (ColossalAI ignores it then; Tiers offloads parameter "
               "chunks only all together, with every optimizer state)",
               "use offload_param_frac=1.0 with the other two at 1.0, or 0.0")
    zero: dict = {"stage": 3 if shard_param_frac == 1.0 else 2}
    if offload_optim_frac:
        zero["offload_optimizer"] = {"device": "cpu", "ratio": float(offload_optim_frac)}
    if offload_param_frac:
        zero["offload_param"] = {"device": "cpu"}
    return zero


class GeminiPlugin(DPPluginBase):
    """Chunk sizes, prefetch depth, pinning, memory-statistics ratios and the fused-kernel switches tune
    ColossalAI's own chunk manager and kernels; Tiers' chunk manager sizes and places its chunks itself, so they are
    accepted and change nothing. Arguments that would change what is trained are mapped or refused."""

    def __init__(self, chunk_config_dict: dict | None = None, chunk_init_device=None, placement_policy: str = "static",
                 enable_gradient_accumulation: bool = False, max_prefetch: int = 0, shard_param_frac: float = 1.0,
                 offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0,
                 warmup_non_model_data_ratio: float = 0.8, steady_cuda_cap_ratio: float = 0.9,
                 precision: str = "fp16", master_weights: bool = True, pin_memory: bool = False,
                 force_outputs_fp32: bool = False, strict_ddp_mode: bool = False, search_range_m: int = 32,
                 hidden_dim: int | None = None, min_chunk_size_m: float = 32, memstats=None,
                 gpu_margin_mem_ratio: float = 0.0, initial_scale: float = 2 ** 16, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 2 ** 32, max_norm: float = 0.0, norm_type: float = 2.0,
                 tp_size: int = 1, extra_dp_size: int = 1, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_sequence_parallelism: bool = False, enable_jit_fused: bool = False,
                 enable_async_reduce: bool = True, use_fp8: bool = False, verbose: bool = False,
                 fp8_communication: bool = False):
        given = locals()
        refuse_changed("GeminiPlugin", given, {"master_weights": True, "strict_ddp_mode": False,
                                               "force_outputs_fp32": False, "extra_dp_size": 1, "norm_type": 2.0,
                                               "use_fp8": False, "fp8_communication": False})
        if placement_policy == "static":
            self.zero = _static_zero(shard_param_frac, offload_optim_frac, offload_param_frac)
        elif placement_policy == "auto":
            refuse_changed("GeminiPlugin", given, _FRACTIONS)  # (ColossalAI ignores them under "auto")
            self.zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                         "placement": "auto"}
        else:
            raise ValueError(f"GeminiPlugin: placement_policy {placement_policy!r} is \"static\" or \"auto\"")
        if enable_sequence_parallelism and tp_size == 1:
            raise ValueError("GeminiPlugin(enable_sequence_parallelism=True) splits the sequence over the tensor-"
                             "parallel ranks, and tp_size is 1; set tp_size to 2 or more")
        super().__init__()
        self.tp_size, self.sequence_parallel, self.max_norm = tp_size, enable_sequence_parallelism, max_norm
        if precision not in ("fp16", "bf16"):
            raise ValueError(f"GeminiPlugin: precision {precision!r} is fp16 or bf16 (as in ColossalAI)")
        scaling = LossScaling(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                              max_scale)
        self.precision = precision_section("GeminiPlugin", precision, scaling)

    def support_no_sync(self) -> bool:
        return False

    def data_parallel(self) -> tuple[int, int]:
        return self.world_size // self.tp_size, self.rank // self.tp_size

    def tiers_config(self) -> dict:
        config = {"zero_optimization": dict(self.zero), **self.precision, **clipping_section(self.max_norm)}
        if self.tp_size > 1:
            config["tensor_parallel"] = {"size": self.tp_size, "sequence_parallel": self.sequence_parallel}
        return config
