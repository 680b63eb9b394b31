"""colossalai.booster.Booster on Tiers: boost() builds one engine from the plugin's config (engine.initialize), and
the boosted model and optimizer drive it (engine.compat.colossalai.interface)."""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from torch import nn

from engine.checkpoint.whole_states import read_whole_states
from engine.compat.colossalai.booster.checkpoint_io import load_state_dict, save_state_dict
from engine.compat.colossalai.booster.client_optimizer import as_config_optimizer
from engine.compat.colossalai.booster.optimizer_io import load_optimizer_file, save_optimizer_file
from engine.compat.colossalai.booster.optimizer_states import colossalai_states, tiers_states
from engine.compat.colossalai.booster.plugin.dp_plugin_base import DPPluginBase
from engine.compat.colossalai.booster.plugin.torch_ddp_plugin import TorchDDPPlugin
from engine.compat.colossalai.interface import ModelWrapper, OptimizerWrapper
from engine.compat.colossalai.unsupported import refuse
from engine.compat.deepspeed.client_objects import scheduler_for_engine
from engine.initialization import initialize


def _amp_section(mixed_precision) -> dict:
    if mixed_precision is None:
        return {}
    if mixed_precision == "bf16":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if mixed_precision in ("fp16", "fp16_apex", "fp16_naive", "fp8") or not isinstance(mixed_precision, str):
        refuse(f"Booster(mixed_precision={mixed_precision!r}) (torch AMP's fp16: autocast with fp32 weights and a "
               "GradScaler)", "use mixed_precision=\"bf16\", or LowLevelZeroPlugin(precision=\"fp16\") (fp16 "
               "weights with fp32 masters and ColossalAI's loss scaler)")
    raise ValueError(f"Booster: mixed_precision {mixed_precision!r} is one of fp16, fp16_apex, fp16_naive, bf16, "
                     "fp8 (as in ColossalAI)")


def _batch_size(dataloader) -> int | None:
    return getattr(dataloader, "batch_size", None)


class _Criterion:
    """The loss function a pipelined engine calls on the last stage (loss_fn(output, micro-batch)): the criterion
    execute_pipeline was last given, as ColossalAI calls it (criterion(outputs, inputs))."""

    def __init__(self, criterion=None):
        self.criterion = criterion

    def __call__(self, output, micro_batch):
        if self.criterion is None:
            raise ValueError("execute_pipeline: pass the criterion (criterion(outputs, inputs) -> loss)")
        return self.criterion(output, micro_batch)


def _split_batch(batch, count: int) -> list:
    """A step's batch (a tensor, or a dict of them) as `count` micro-batches along dim 0, as ColossalAI's schedule
    cuts it."""
    def parts(t: torch.Tensor) -> list:
        if t.shape[0] % count:
            raise ValueError(f"execute_pipeline: a batch of {t.shape[0]} does not split into {count} micro-batches")
        return list(t.chunk(count, dim=0))
    if isinstance(batch, torch.Tensor):
        return parts(batch)
    if isinstance(batch, dict):
        cut = {k: parts(v) if isinstance(v, torch.Tensor) else [v] * count for k, v in batch.items()}
        return [{k: v[i] for k, v in cut.items()} for i in range(count)]
    raise TypeError(f"execute_pipeline: the data iterator gives {type(batch).__name__}; give a tensor or a dict")


def _engine_of(model) -> object:
    if not isinstance(model, ModelWrapper):
        raise TypeError(f"expected the model booster.boost returned, got {type(model).__name__}")
    return model.engine


class Booster:
    """Booster(device=None, mixed_precision=None, plugin=None), as ColossalAI's (its first argument is `device`:
    pass plugin= by name). mixed_precision is for TorchDDPPlugin, as torch AMP: "bf16" runs the forward under
    autocast with fp32 weights, gradients and optimizer (Tiers' torch_autocast); AMP's "fp16" (autocast with
    torch's GradScaler) is not built and is refused. The other plugins take their own `precision`."""

    def __init__(self, device: str | None = None, mixed_precision=None, plugin: DPPluginBase | None = None):
        if plugin is not None and not isinstance(plugin, DPPluginBase):
            raise TypeError(f"Booster(plugin=...) takes a plugin, got {type(plugin).__name__}; "
                            "note that Booster's first positional argument is `device`")
        if plugin is None and dist.is_initialized() and dist.get_world_size() > 1:
            refuse("Booster() without a plugin over several processes (ColossalAI then trains each rank on its own, "
                   "with no gradient sync)", "pass plugin=TorchDDPPlugin() for data parallelism")
        self.plugin = plugin if plugin is not None else TorchDDPPlugin()
        if mixed_precision is not None and self.plugin.controls_precision():
            raise ValueError(f"Booster(mixed_precision={mixed_precision!r}) with {type(self.plugin).__name__}, which "
                             "sets its own precision: pass precision= to the plugin instead")
        self.precision = _amp_section(mixed_precision)
        self.device = device

    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, criterion=None,
              dataloader=None, lr_scheduler=None):
        """(model, optimizer, criterion, dataloader, lr_scheduler), each boosted where it takes part in training."""
        if isinstance(model, ModelWrapper):
            raise ValueError("boost(model): this model was boosted already")
        if optimizer is None:
            refuse("boost(model) without an optimizer (an engine for inference only)",
                   "pass the optimizer the model trains with, or run the unboosted model under torch.no_grad()")
        self.plugin.check_model(model)
        names = {id(p): n for n, p in model.named_parameters()}
        client_groups = [([names[id(p)] for p in g["params"] if id(p) in names],
                          {k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
        config = {**self.plugin.tiers_config(), **self.precision, **self.plugin.batch_section(_batch_size(dataloader))}
        pipeline_criterion = _Criterion(criterion) if self.plugin.pipelined else None
        extra = {"loss_fn": pipeline_criterion} if pipeline_criterion is not None else {}
        section = as_config_optimizer(optimizer, model)
        if section is not None:
            config["optimizer"], groups = section
            if groups is not None and config.get("tensor_parallel", {}).get("size", 1) > 1:
                refuse(f"tp_size > 1 with an optimizer of {len(groups)} param groups (tensor parallelism replaces "
                       "the layers, and the groups would name the old parameters)",
                       "build the optimizer over model.parameters() in one group")
            engine = initialize(model, config, model_parameters=groups, **extra)
        else:
            engine = initialize(model, config, optimizer=optimizer, **extra)
        if lr_scheduler is not None:  # stepped by the script, so the engine is not given it
            scheduler_for_engine(lr_scheduler)(engine.optimizer)
        boosted = ModelWrapper(engine)
        boosted.pipeline_criterion = pipeline_criterion  # execute_pipeline's criterion goes here
        return (boosted, OptimizerWrapper(engine, self.plugin.max_norm, client_groups), criterion, dataloader,
                lr_scheduler)

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        optimizer.backward(loss)

    def no_sync(self, model: ModelWrapper | None = None, optimizer: OptimizerWrapper | None = None):
        if not self.plugin.support_no_sync():
            raise AssertionError(f"{type(self.plugin).__name__} does not support no_sync (as in ColossalAI)")
        engine = _engine_of(model) if model is not None else optimizer.engine
        return engine.no_sync()

    def execute_pipeline(self, data_iter, model: ModelWrapper, criterion, optimizer: OptimizerWrapper | None = None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        """One step's batch from `data_iter` through the pipeline stages, cut into the plugin's micro-batches, each
        loss criterion(outputs, micro-batch) on the last stage; with an optimizer, its backward and Tiers' update (the
        script's optimizer.step() and zero_grad() after it do nothing more), without one the forwards alone under
        torch.no_grad(). Returns {"loss": the micro-batches' mean loss (every rank), "outputs": None}."""
        if not self.plugin.pipelined:
            raise AssertionError("execute_pipeline needs a plugin with pp_size > 1 (as in ColossalAI)")
        if return_outputs:
            refuse("execute_pipeline(return_outputs=True)", "compute what the outputs are for inside the criterion")
        engine = _engine_of(model)
        model.pipeline_criterion.criterion = criterion
        batches = iter(_split_batch(next(data_iter), engine.gradient_accumulation_steps))
        if optimizer is None:
            if torch.is_grad_enabled():
                raise AssertionError("execute_pipeline without an optimizer runs the forwards only: call it under "
                                     "torch.no_grad() (as ColossalAI asks)")
            loss = engine.eval_batch(batches)
        else:
            loss = engine.train_batch(batches)
            optimizer.stepped_by_pipeline()
        return {"loss": torch.tensor(loss) if return_loss else None, "outputs": None}

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_model(self, model: ModelWrapper, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """The whole model's state dict (its fp32 weights), written by rank 0 as ColossalAI writes it; every rank
        must call it."""
        state = _engine_of(model).full_state_dict(rank0_only=True)
        if state is not None:
            save_state_dict(state, checkpoint, shard, size_per_shard, use_safetensors or use_async,
                                          prefix)
        if dist.is_initialized():
            dist.barrier()

    def load_model(self, model: ModelWrapper, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1) -> None:
        """Every rank reads the state dict and loads it into the model, the engine's fp32 masters following (under
        tensor, pipeline or expert parallelism each rank its pieces of the tensors it holds)."""
        _engine_of(model).load_full_state_dict(load_state_dict(checkpoint), strict=strict)

    def save_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, shard: bool = False,
                       gather_dtensor: bool = True, prefix: str | None = None, size_per_shard: int = 1024,
                       use_async: bool = False) -> None:
        """The optimizer's states whole, numbered as the script's optimizer numbers its parameters, written by rank 0
        in ColossalAI's format (one file, or a sharded directory with its index); every rank must call it. The
        states are gathered through a Tiers checkpoint written beside `checkpoint` and removed after (Note [whole
        optimizer states])."""
        if use_async:
            refuse("booster.save_optimizer(use_async=True)", "save with use_async=False")
        staging = checkpoint.rstrip("/") + ".tiers-staging"
        path = optimizer.engine.save_checkpoint(staging, tag="optimizer", save_latest=False)
        optimizer.engine.wait_for_checkpoint()
        if not dist.is_initialized() or dist.get_rank() == 0:
            state, groups = colossalai_states(read_whole_states(path), optimizer)
            save_optimizer_file(state, groups, checkpoint, shard, size_per_shard, prefix)
            shutil.rmtree(staging)
        if dist.is_initialized():
            dist.barrier()

    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, low_cpu_mem_mode: bool = True,
                       num_threads: int = 1) -> None:
        """Every rank reads a ColossalAI optimizer file (or sharded directory) and loads its piece of each state;
        the param groups' options (lr, betas, eps, weight_decay) follow."""
        state, groups = load_optimizer_file(checkpoint)
        whole, options = tiers_states(state, groups, optimizer)
        optimizer.engine.load_whole_optimizer_states(whole)
        for group, saved in zip(optimizer.param_groups, options):
            group.update(saved)

    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(lr_scheduler.state_dict(), checkpoint)
        if dist.is_initialized():
            dist.barrier()

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        lr_scheduler.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False))

    def enable_lora(self, model: nn.Module, pretrained_dir: str | None = None, lora_config=None,
                    bnb_quantization_config=None, quantize: bool = False) -> nn.Module:
        """PEFT's LoRA on the model, before boost (as ColossalAI: get_peft_model, or the adapter in
        pretrained_dir made trainable)."""
        if quantize or bnb_quantization_config is not None:
            refuse("enable_lora(quantize=True) (bitsandbytes 4-bit)", "train LoRA on an int8 base with a Tiers "
                   "config (zero_optimization.quantize_frozen \"int8\"), or without quantize")
        if isinstance(model, ModelWrapper):
            raise ValueError("enable_lora: call it before booster.boost, on the model itself")
        import peft

        if pretrained_dir is not None:
            return peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)
        if lora_config is None:
            raise ValueError("enable_lora needs lora_config (a peft.LoraConfig) or pretrained_dir")
        return peft.get_peft_model(model, lora_config)
