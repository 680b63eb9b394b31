"""colossalai.booster.plugin.dp_plugin_base.DPPluginBase: what every plugin shares, its data loader and the Tiers
config sections it asks for (each plugin maps its arguments onto them; what has no counterpart is refused)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from engine.compat.colossalai.unsupported import refuse


@dataclass(frozen=True)
class LossScaling:
    """ColossalAI's dynamic loss scaler settings (its DynamicGradScaler: the scale backs off at the hysteresis-th
    overflow and at every one after, until it grows again after growth_interval clean steps, up to max_scale), which
    is DeepSpeed's scaler with Tiers' fp16.max_loss_scale, for growth by 2 and back-off by half."""

    initial_scale: float = 2 ** 16
    min_scale: float = 1
    growth_factor: float = 2
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float | None = 2 ** 32
    cast_inputs: bool = False


def _fp16_section(plugin: str, scaling: LossScaling) -> dict:
    power = math.log2(scaling.initial_scale) if scaling.initial_scale > 0 else -1.0
    if not power.is_integer() or not 0 <= power <= 127:
        refuse(f"{plugin}(initial_scale={scaling.initial_scale})", "use a power of two, e.g. 2**16")
    if (scaling.growth_factor, scaling.backoff_factor) != (2, 0.5):
        refuse(f"{plugin}(growth_factor={scaling.growth_factor}, backoff_factor={scaling.backoff_factor})",
               "use growth_factor=2 and backoff_factor=0.5 (the scaler Tiers runs doubles and halves)")
    return {"fp16": {"enabled": True, "initial_scale_power": int(power), "loss_scale_window": scaling.growth_interval,
                     "hysteresis": max(1, scaling.hysteresis), "min_loss_scale": scaling.min_scale,
                     "max_loss_scale": scaling.max_scale or 0, "auto_cast": scaling.cast_inputs}}


def precision_section(plugin: str, precision: str, scaling: LossScaling) -> dict:
    """The Tiers config section of ColossalAI's precision name ("fp16" with the plugin's loss scaling)."""
    if precision == "fp16":
        return _fp16_section(plugin, scaling)
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp32":
        return {}
    raise ValueError(f"{plugin}: precision {precision!r} is one of fp16, bf16, fp32")


def clipping_section(max_norm: float) -> dict:
    """ColossalAI's max_norm (0: no clipping) as DeepSpeed's gradient_clipping."""
    if max_norm < 0:
        raise ValueError(f"max_norm {max_norm} must be 0 (no clipping) or more")
    return {"gradient_clipping": float(max_norm)} if max_norm > 0 else {}


def refuse_batch_norm(plugin: str, model: torch.nn.Module, data_parallel: int) -> None:
    """BatchNorm over more than one data-parallel rank: ColossalAI's DDP converts it to SyncBatchNorm (statistics
    over the global batch, rank 0's buffers broadcast every forward); Tiers normalizes by each rank's batch."""
    norms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms and data_parallel > 1:
        refuse(f"{plugin} on a model with BatchNorm ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) "
               f"over {data_parallel} data-parallel ranks (SyncBatchNorm)", "use GroupNorm or LayerNorm, or "
               "LowLevelZeroPlugin / GeminiPlugin, which normalize by each rank's batch in ColossalAI too")


def refuse_changed(plugin: str, given: dict, defaults: dict) -> None:
    """Arguments given another value than their default (`defaults`, by name) where Tiers has nothing that does what
    that value asks."""
    for name, default in defaults.items():
        if given[name] != default:
            refuse(f"{plugin}({name}={given[name]!r})", f"leave {name} at {default!r} "
                   "(docs/migrating-from-colossalai.md lists what each plugin argument maps to)")


def _seed_worker(worker_id: int, seed: int) -> None:
    worker_seed = seed + worker_id
    random.seed(worker_seed)
    np.random.seed(worker_seed)
    torch.manual_seed(worker_seed)


class _WorkerSeed:
    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self, worker_id: int) -> None:
        _seed_worker(worker_id, self.seed)


class DPPluginBase:
    """A plugin: the Tiers config its arguments ask for (`tiers_config`), the clipping norm, and the loader."""

    name = "DPPluginBase"
    max_norm = 0.0

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs the process group: call colossalai.launch_from_torch() "
                               "first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def tiers_config(self) -> dict:
        raise NotImplementedError

    def batch_section(self, batch_size: int | None) -> dict:
        """The config's batch keys for a loader of `batch_size` (None: no loader given): one micro-batch a step."""
        return {"train_micro_batch_size_per_gpu": batch_size or 1, "gradient_accumulation_steps": 1}

    @property
    def pipelined(self) -> bool:
        """Whether the model trains through Booster.execute_pipeline (pipeline stages)."""
        return False

    def check_model(self, model: torch.nn.Module) -> None:
        """What the plugin cannot train as ColossalAI would, refused before the engine is built."""

    def data_parallel(self) -> tuple[int, int]:
        """(the ranks that see different samples, this rank's place among them)."""
        return self.world_size, self.rank

    def support_no_sync(self) -> bool:
        return True

    def controls_precision(self) -> bool:
        """False: the Booster's mixed_precision sets it (TorchDDPPlugin); True: the plugin's own precision does."""
        return True

    def prepare_dataloader(self, dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           distributed_sampler_cls=None, **kwargs) -> DataLoader:
        """ColossalAI's loader: a distributed sampler over the data-parallel ranks (its own seed, 0: `seed` seeds
        the workers, as in ColossalAI; call sampler.set_epoch yourself)."""
        replicas, rank = self.data_parallel()
        sampler = (distributed_sampler_cls or DistributedSampler)(dataset, num_replicas=replicas, rank=rank,
                                                                   shuffle=shuffle)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, worker_init_fn=_WorkerSeed(seed),
                          drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers, **kwargs)
