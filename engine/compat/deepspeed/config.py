"""deepspeed.DeepSpeedConfig: a config read as initialize reads it, with DeepSpeed's attribute names."""

from __future__ import annotations

import os

import torch.distributed as dist

from engine.compat.deepspeed.client_objects import config_as_dict
from engine.compat.deepspeed.unsupported import refuse
from engine.config import load_config


class DeepSpeedConfig:
    """Batch sizes resolved over the data-parallel ranks of this job (the world over tensor, pipeline and
    sequence ranks), as DeepSpeed's resolves them."""

    def __init__(self, config, mpu=None, mesh_device=None):
        if mpu is not None or mesh_device is not None:
            refuse("DeepSpeedConfig(mpu=... / mesh_device=...)", "tensor_parallel / pipeline / sequence_parallel "
                   "sections in the config")
        self._param_dict = config_as_dict(config)
        cfg = load_config(self._param_dict)
        self.world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        model_parallel = cfg.tensor_parallel.size * cfg.pipeline.stages * cfg.sequence_parallel.size
        batch = cfg.batch_sizes(max(self.world_size // model_parallel, 1))
        self.train_batch_size = batch.train_batch_size
        self.train_micro_batch_size_per_gpu = batch.micro_batch_size
        self.gradient_accumulation_steps = batch.gradient_accumulation_steps
        self.steps_per_print = cfg.steps_per_print
        self.gradient_clipping = cfg.gradient_clipping
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = cfg.zero_optimization.stage > 0
        self.fp16_enabled = cfg.fp16.enabled
        self.bfloat16_enabled = cfg.bf16.enabled
        self.optimizer_name = None if cfg.optimizer is None else cfg.optimizer.type.lower()
        self.optimizer_params = None if cfg.optimizer is None else dict(cfg.optimizer.params)
        self.scheduler_name = None if cfg.scheduler is None else cfg.scheduler.type
        self.scheduler_params = None if cfg.scheduler is None else dict(cfg.scheduler.params)
        self.tiers_config = cfg

    def __getattr__(self, name: str):
        refuse(f"DeepSpeedConfig.{name}", "the attributes listed in docs/migrating-from-deepspeed.md, or "
               "DeepSpeedConfig(...).tiers_config (the whole config)")
