"""deepspeed.checkpointing: activation checkpointing with DeepSpeed's options (Note [activation checkpointing]);
`configure` takes DeepSpeed's arguments, `checkpoint` is torch's non-reentrant checkpoint under them (the same
dropout masks in the recompute)."""

from __future__ import annotations

import dataclasses

import torch

from engine.activation_checkpointing import ActivationCheckpointing
from engine.compat.deepspeed.rng_tracker import get_cuda_rng_tracker, model_parallel_cuda_manual_seed  # noqa: F401
from engine.compat.deepspeed.unsupported import refuse
from engine.config import load_config
from engine.config_sections import ActivationCheckpointingConfig


class _Configured:
    # DeepSpeed's checkpointing API is module state by design (configure() once, checkpoint() anywhere): this is
    # the one place the compat layer keeps such state
    checkpointing: ActivationCheckpointing | None = None


def configure(mpu_=None, deepspeed_config=None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints=None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> None:
    """The activation_checkpointing section of `deepspeed_config` (defaults without one), overridden by the
    arguments given."""
    if mpu_ is not None:
        refuse("checkpointing.configure(mpu_=...)", "tensor_parallel in the config")
    section = load_config(deepspeed_config).activation_checkpointing if deepspeed_config is not None \
        else ActivationCheckpointingConfig()
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                 contiguous_checkpointing, "number_checkpoints": num_checkpoints, "cpu_checkpointing":
                 checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    section = dataclasses.replace(section, **{k: v for k, v in overrides.items() if v is not None})
    if section.partition_activations:
        refuse("checkpointing.configure(partition_activations=True)", "activation_checkpointing.partition_activations "
               "in the config of a tensor-parallel engine (model_engine.activation_checkpoint)")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    _Configured.checkpointing = ActivationCheckpointing(section, device)


def checkpoint(function, *args):
    """function(*args), keeping only its inputs; backward runs it again."""
    if _Configured.checkpointing is None:
        configure()
    return _Configured.checkpointing.checkpoint(function, *args)


def is_configured() -> bool:
    return _Configured.checkpointing is not None
