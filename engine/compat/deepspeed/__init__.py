"""DeepSpeed's Python API on Tiers: `from engine.compat import deepspeed` in place of `import deepspeed`.

    parser = deepspeed.add_config_arguments(parser)
    deepspeed.init_distributed()
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)

The config is taken as DeepSpeed takes it (`config`, else `config_params`, else `args.deepspeed_config`; two of
them is an error), training_data gives DeepSpeed's batches (engine.compat.deepspeed.data), and the engine answers
DeepSpeed's calls (engine.compat.deepspeed.engine). What DeepSpeed has and Tiers does not raises, naming the call
and what to use (docs/migrating-from-deepspeed.md).
"""

from __future__ import annotations

import weakref

from engine.compat.deepspeed import (  # noqa: F401
    accelerator,
    checkpointing,
    client_objects,
    comm,
    moe,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)
from engine.compat.deepspeed.accelerator import get_accelerator
from engine.compat.deepspeed.config import DeepSpeedConfig
from engine.compat.deepspeed.data import DeepSpeedDataLoader
from engine.compat.deepspeed.engine import DeepSpeedEngine
from engine.compat.deepspeed.launch import add_config_arguments, init_distributed, release_at_exit
from engine.compat.deepspeed.pipe import PipelineModule
from engine.compat.deepspeed.unsupported import refuse

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "DeepSpeedConfig",
           "get_accelerator", "PipelineModule", "zero", "checkpointing", "accelerator", "comm", "moe", "ops", "pipe",
           "runtime", "utils"]

# DeepSpeed's version whose API this layer answers (release parsers read it; Tiers' own is the package's)
__version__ = "0.19.5"


def _config_of(args, config, config_params):
    """DeepSpeed's rule: `config`, else `config_params`, else args.deepspeed_config (or the older deepscale_config);
    the arguments and the call both naming one is an error."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("deepspeed.initialize: a config came in args.deepspeed_config and in the call "
                             "(config / config_params); give one of them")
        config = from_args
    if config is None:
        raise ValueError("deepspeed.initialize needs a config: pass config=... (a dict or a JSON path), or "
                         "--deepspeed_config FILE on the command line (deepspeed.add_config_arguments(parser))")
    return config


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required: bool | None = None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """(engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize returns them."""
    from engine.initialization import initialize as tiers_initialize

    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if mesh_param is not None:
        refuse("deepspeed.initialize(mesh_param=...)", "tensor_parallel / pipeline / sequence_parallel "
               "sections in the config (Tiers builds its own process groups)")
    config = client_objects.config_as_dict(_config_of(args, config, config_params))
    if mpu is not None:
        client_objects.check_mpu(mpu, config)
    given = config
    if optimizer is not None:
        config = client_objects.without_section(config, "optimizer", "a client optimizer was passed")
    if lr_scheduler is not None:
        config = client_objects.without_section(config, "scheduler", "a client lr_scheduler was passed")
    optimizer, model_parameters = client_objects.client_optimizer(optimizer, model_parameters, model)
    init_distributed(dist_init_required=dist_init_required)
    piped = isinstance(model, pipe.PipelineModule)  # Note [a PipelineModule on Tiers' pipeline]
    if piped:
        config = pipe.pipeline_config(config, model)
    engine = tiers_initialize(model, config, optimizer=optimizer,
                              lr_scheduler=client_objects.scheduler_for_engine(lr_scheduler),
                              model_parameters=model_parameters, loss_fn=pipe.engine_loss_fn(model) if piped else None)
    for p in engine.module.parameters():  # zero.GatheredParameters finds their engine (DeepSpeed tags them too)
        p.tiers_engine = weakref.ref(engine)
    runtime.zero.partition_parameters.mark_parameters(engine)  # ds_id, ds_status, ... (stage 3)
    loader = None
    if training_data is not None:
        loader = DeepSpeedDataLoader(training_data, engine.train_micro_batch_size_per_gpu, engine.dp_world_size,
                                     engine.dp_rank, collate_fn, engine.config.dataloader_drop_last)
    facade = pipe.PipelineEngine if piped else DeepSpeedEngine
    wrapped = facade(engine, loader, given if isinstance(given, dict) else None, optimizer is not None)
    release_at_exit(wrapped)
    return wrapped, engine.optimizer, loader, engine.lr_scheduler


def __getattr__(name: str):
    refuse(f"deepspeed.{name}", "the calls listed in docs/migrating-from-deepspeed.md")
