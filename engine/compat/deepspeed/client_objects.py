"""What deepspeed.initialize does with the objects a script passes beside the config, in DeepSpeed's terms.

- A client optimizer wins over the config's `optimizer` section and over `model_parameters` (DeepSpeed uses the
  client's and logs it); a callable optimizer is called with the model parameters, as DeepSpeed calls it.
- A client scheduler wins over the config's `scheduler` section. A scheduler object drives whatever optimizer the
  engine steps: under ZeRO >= 1 and bf16/fp16 that is the client itself, its groups pointed at this rank's shards
  or fp32 masters; pipeline stages rebuild the client over the stage's parameters, so there the scheduler is
  re-pointed at the rebuilt one. Its state (step count, base learning rates) is kept; the rebuilt optimizer's
  groups carry the learning rates the scheduler set when it was built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import torch

from engine.config import Config, ConfigError

logger = logging.getLogger("DeepSpeed")


def config_as_dict(config):
    """A JSON path read into a dict (a copy of a dict), so that sections can be taken out; a Config stays one."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {os.fspath(config)!r}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{os.fspath(config)}: not valid JSON: {e}") from None
    return dict(config) if isinstance(config, dict) else config


def without_section(config, section: str, why: str):
    """The config without `section` (logged on rank 0 when it had one)."""
    present = config.get(section) is not None if isinstance(config, dict) else getattr(config, section) is not None
    if not present:
        return config
    _log_rank0(f"deepspeed.initialize: the config's `{section}` section is not used: {why} (as in DeepSpeed)")
    if isinstance(config, Config):
        return dataclasses.replace(config, **{section: None})
    return {k: v for k, v in config.items() if k != section}


def client_optimizer(optimizer, model_parameters, model: torch.nn.Module):
    """(the optimizer initialize builds on, the model_parameters left for the config's optimizer)."""
    if optimizer is None:
        return None, model_parameters
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed calls it
        return optimizer(model_parameters if model_parameters is not None else model.parameters()), None
    if model_parameters is not None:
        _log_rank0("deepspeed.initialize: model_parameters are not used: the client optimizer names its parameters")
    return optimizer, None


def scheduler_for_engine(lr_scheduler):
    """A scheduler object as the callable initialize takes: re-pointed at the optimizer the engine steps."""
    if lr_scheduler is None or not hasattr(lr_scheduler, "step"):
        return lr_scheduler

    def repointed(optimizer):
        if lr_scheduler.optimizer is not optimizer:
            lr_scheduler.optimizer = optimizer
            # torch's schedulers check that the optimizer's step was wrapped at their construction; a scheduler
            # that leaves the learning rates as they are wraps the rebuilt one's the same way
            torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        return lr_scheduler

    return repointed


def check_mpu(mpu, config) -> None:
    """A Megatron-style `mpu` is accepted where its groups are the ones Tiers builds: no model parallelism, every
    rank data-parallel, in rank order. Other layouts are refused: Tiers builds its tensor, pipeline and sequence
    groups from the config, and an mpu laying ranks out otherwise would shard the data differently."""
    from engine.compat.deepspeed.unsupported import refuse
    from engine.config import load_config

    cfg = load_config(config)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    model_parallel = cfg.tensor_parallel.size * cfg.pipeline.stages * cfg.sequence_parallel.size
    seen = (mpu.get_model_parallel_world_size(), mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank())
    if model_parallel != 1 or seen != (1, world, rank):
        refuse(f"deepspeed.initialize(mpu=...) with model-parallel size {seen[0]}, data-parallel size {seen[1]} "
               f"and rank {seen[2]} (of {world})", "tensor_parallel / pipeline / sequence_parallel sections in the "
               "config (Tiers builds its own groups), and no mpu")
    _log_rank0("deepspeed.initialize: the mpu's groups are Tiers' own (no model parallelism, every rank "
               "data-parallel); Tiers uses its own process groups")


def _log_rank0(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info(message)
