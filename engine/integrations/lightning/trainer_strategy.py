"""Lightning's Trainer over a Tiers engine: TiersStrategy and its precision plugin.

Note [Lightning's Trainer over an engine]
The Trainer keeps its loop (data, hooks, logging, callbacks, validation, checkpoint files); the strategy swaps what
touches the model's training state:
- setup (fit): the config is completed from the Trainer's arguments (Note [Lightning's arguments in the config]) and
  the LightningModule is wrapped once with `initialize`, with the optimizer of `configure_optimizers` (or the
  config's `optimizer` section, not both). The engine points that optimizer at its shards, so the schedulers
  `configure_optimizers` built on it keep working; Lightning steps them (interval, frequency, monitor), the engine
  does not. The Trainer then holds stand-ins: the model it calls runs the engine's forward (training_step and
  validation_step are redirected through it, as through DDP), its optimizer's zero_grad does nothing.
- each micro-batch: the loop runs the optimizer step every batch (`handles_gradient_accumulation`): the closure
  runs training_step and the backward, whose loss Lightning already divided by accumulate_grad_batches, so it goes
  to engine.backward multiplied by the engine's accumulation steps (engine.backward divides by them and by the
  data-parallel size, which DDP's gradient mean does too); then engine.step(), which updates at the boundary.
  Lightning's accumulation boundaries must be the engine's: an epoch whose batches the accumulation does not divide
  is refused at its first batch (an unsized loader's at its last), and every batch checks that the engine's
  micro-step agrees with batch_idx and that accumulate_grad_batches has not changed.
- clipping is the engine's (gradient_clip_val goes to the config's gradient_clipping); clipping by value and an
  overridden configure_gradient_clipping or backward are refused, as is manual optimization.
- checkpoints: a Trainer checkpoint path becomes a directory holding the engine's checkpoint (every state, any
  layout) with Lightning's own state (loops, callbacks, schedulers, hyperparameters) beside it (Note [Lightning's
  state beside the engine's checkpoint]); a resume loads it into the engine (restore after setup). A weights-only
  checkpoint is one file with the full weights, written by rank 0. `lightning_module_state_dict` is the engine's
  full_state_dict (every process gathers its part).
- configure_model runs under zero_init when the config is ZeRO stage 3 (`model_sharded_context`).
- validate/test/predict after fit run the engine's forward (of the fitted module only); before any fit they run the
  plain module.
Not built yet, refused: a second fit on one strategy, tensor/pipeline/sequence parallelism, layer-major
accumulation, half ("-true") and 64-bit precision, more than one optimizer, sync_batchnorm and DDP's own arguments,
callbacks that change the run outside the engine (OUTSIDE_THE_ENGINE), and under ZeRO-2/3 gradient hooks of the
module (its parameters' .grad are shards there).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager, nullcontext

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BatchSizeFinder,
    Callback,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from engine.initialization import initialize
from engine.integrations.config_dict import read_config, zero_stage
from engine.integrations.lightning.checkpoint_state import load_with_state, save_with_state
from engine.integrations.lightning.settings import lightning_config, precision_flag
from engine.integrations.stand_ins import EngineModule, EngineOptimizer
from engine.zero.zero_init import zero_init

# callbacks that change the accumulation, the weights, the trainable parameters or the run outside the engine
OUTSIDE_THE_ENGINE = (GradientAccumulationScheduler, StochasticWeightAveraging, WeightAveraging, ModelPruning,
                      BaseFinetuning, BatchSizeFinder, LearningRateFinder)


class TiersPrecision(Precision):
    """Lightning's precision plugin under TiersStrategy: the engine casts, autocasts, scales and clips, as the config's
    precision sections say (completed from the precision flag: Note [Lightning's arguments in the config]); this
    keeps Lightning's hooks around the engine's backward and step."""

    def __init__(self, precision: str = "32-true"):
        self.precision = precision
        self.engine = None

    @classmethod
    def replacing(cls, plugin: Precision) -> TiersPrecision:
        if isinstance(plugin, cls):
            return plugin
        return cls(precision_flag(plugin, (Precision, MixedPrecision), "TiersStrategy"))

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        # Lightning divided the loss by accumulate_grad_batches; engine.backward divides by them again
        self.engine.backward(tensor * self.engine.gradient_accumulation_steps)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        result = closure()
        if model.automatic_optimization and result is None:
            raise ValueError("training_step returned None (a skipped backward), which TiersStrategy cannot skip: every "
                             "process must reach the engine's gradient reduction; return a loss")
        boundary = self.engine.is_gradient_accumulation_boundary()
        if model.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and not boundary:
            raise RuntimeError(f"the epoch's last batch ends a partial accumulation (accumulate_grad_batches "
                               f"{self.engine.gradient_accumulation_steps}), where DDP would update early and the "
                               "engine would not; make the batches per epoch a multiple of accumulate_grad_batches")
        if boundary:
            self._after_closure(model, optimizer)  # on_before_optimizer_step, once per update as under DDP
        self.engine.step()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        pass  # the engine clips at its update, by the config's gradient_clipping (from gradient_clip_val)


class TiersStrategy(DDPStrategy):
    """Note [Lightning's Trainer over an engine]: `Trainer(strategy=TiersStrategy("ds_config.json"), ...)`.

    config: a DeepSpeed-style config (a JSON file's path or a dict). The other arguments are DDPStrategy's
    (process_group_backend, timeout, start_method, cluster_environment, ...); Lightning starts the processes."""

    strategy_name = "tiers"

    def __init__(self, config: str | os.PathLike | dict, **kwargs):
        super().__init__(**kwargs)
        ddp_only = {name: value for name, value in [*self._ddp_kwargs.items(), ("ddp_comm_hook", self._ddp_comm_hook),
                    ("ddp_comm_state", self._ddp_comm_state), ("ddp_comm_wrapper", self._ddp_comm_wrapper),
                    ("model_averaging_period", self._model_averaging_period)] if value not in (None, False)}
        if ddp_only:
            raise ValueError(f"TiersStrategy: {', '.join(sorted(ddp_only))} configure DDP's wrapper, which the engine "
                             "replaces (it reduces the gradients itself); leave them out")
        self.config = config
        self.engine = None
        self._fitted = False

    @property
    def precision_plugin(self) -> TiersPrecision:
        return self._precision_plugin if self._precision_plugin is not None else TiersPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # the Trainer's precision flag, kept as the config's bf16/fp16 sections; the engine casts and scales
        self._precision_plugin = None if plugin is None else TiersPrecision.replacing(plugin)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer's states

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            if self.engine is not None and self.lightning_module is not self.engine.module:
                raise ValueError("this TiersStrategy's engine wraps the module it fitted; evaluate that one, or give "
                                 "the other module a Trainer and strategy of its own")
            if self.engine is None:
                self.model_to_device()
            self.model = EngineModule(self.engine) if self.engine is not None else self.lightning_module
            return
        if self._fitted:
            raise ValueError("fit once per TiersStrategy: its engine holds the last fit's optimizer and schedule; make "
                             "a new Trainer and TiersStrategy (ckpt_path=... to go on from a checkpoint)")
        config = lightning_config(self.config, precision=self.precision_plugin.precision,
                                  accumulation=trainer.accumulate_grad_batches, clipping=trainer.gradient_clip_val,
                                  micro_batch=_loader_batch_size(trainer))
        self._check_module(trainer, zero_stage(config))
        optimizer, scheduler_configs = self._module_optimizer(config)
        self.engine = initialize(self.lightning_module, config, optimizer=optimizer)
        self._fitted = True
        self.model = EngineModule(self.engine)
        self.optimizers = [EngineOptimizer(self.engine)]
        self.lr_scheduler_configs = scheduler_configs
        self.precision_plugin.engine = self.engine

    def _check_module(self, trainer: pl.Trainer, stage: int) -> None:
        module = self.lightning_module
        outside = [type(c).__name__ for c in trainer.callbacks if isinstance(c, OUTSIDE_THE_ENGINE)]
        if outside:
            raise ValueError(f"{', '.join(outside)} under TiersStrategy is not built: it changes the accumulation, the "
                             "weights, the trainable parameters or the run itself outside the engine; remove it")
        if self._layer_sync is not None:
            raise ValueError("sync_batchnorm=True under TiersStrategy is not built; leave it out")
        if not module.automatic_optimization:
            raise ValueError("manual optimization (automatic_optimization = False) under TiersStrategy is not built "
                             "yet; let Lightning run the optimization")
        if str(trainer.gradient_clip_algorithm) in ("value", "GradClipAlgorithmType.VALUE"):
            raise ValueError("gradient_clip_algorithm=\"value\": the engine clips by the global norm only; use "
                             "\"norm\"")
        for hook in ("configure_gradient_clipping", "backward"):
            if is_overridden(hook, module, pl.LightningModule):
                raise ValueError(f"{type(module).__name__} overrides {hook}, which TiersStrategy would not run (the "
                                 "engine runs the backward and clips by the config's gradient_clipping); remove it")
        hooked = [(module, pl.LightningModule)] + [(c, Callback) for c in trainer.callbacks]
        for hook, (owner, base) in ((h, o) for h in ("on_after_backward", "on_before_optimizer_step") for o in hooked):
            if stage >= 2 and is_overridden(hook, owner, base):
                raise ValueError(f"{type(owner).__name__} overrides {hook}, where under ZeRO stage {stage} the "
                                 "parameters' .grad are not whole (the engine reduces them into shards as backward "
                                 "runs), so reading or changing them would not act on the update; remove it (the "
                                 "engine's norm: self.trainer.strategy.engine.get_global_grad_norm())")

    def _module_optimizer(self, config: dict) -> tuple[Optimizer | None, list]:
        """The optimizer and scheduler configs of configure_optimizers, or none when the config has an optimizer."""
        module = self.lightning_module
        overridden = is_overridden("configure_optimizers", module, pl.LightningModule)
        if "optimizer" in config:
            if overridden:
                raise ValueError(f"an optimizer both in the config and in {type(module).__name__}.configure_optimizers;"
                                 " keep one")
            return None, []
        optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1 or not isinstance(optimizers[0], Optimizer):
            raise ValueError(f"TiersStrategy trains with one optimizer, and configure_optimizers gave {len(optimizers)}"
                             " (or none); return one, or give the config an optimizer section")
        if scheduler_configs and "scheduler" in config:
            raise ValueError("a scheduler both in the config and in configure_optimizers; keep one")
        return optimizers[0], scheduler_configs

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        trainer, engine = self.lightning_module.trainer, self.engine
        accumulation = engine.gradient_accumulation_steps
        if trainer.accumulate_grad_batches != accumulation:
            raise RuntimeError(f"accumulate_grad_batches changed to {trainer.accumulate_grad_batches} during fit, and "
                               f"the engine accumulates {accumulation} (fixed when it was built); keep it fixed")
        batches = trainer.num_training_batches
        if batch_idx == 0 and batches != math.inf and batches % accumulation:
            raise ValueError(f"an epoch of {batches} batches ends with a partial accumulation of "
                             f"{batches % accumulation} (accumulate_grad_batches {accumulation}), where DDP would "
                             "update early and the engine would not; make the batches per epoch a multiple of it "
                             "(the dataset's size, the batch size, drop_last, limit_train_batches)")
        if engine.micro_step % accumulation != batch_idx % accumulation:
            raise RuntimeError(f"batch {batch_idx} is micro-step {engine.micro_step % accumulation} of the engine's "
                               f"accumulation of {accumulation}: the last epoch ended inside an accumulation; make "
                               "each epoch's batches a multiple of accumulate_grad_batches")

    @contextmanager
    def model_sharded_context(self):
        with zero_init() if zero_stage(read_config(self.config)) == 3 else nullcontext():
            yield

    def model_to_device(self) -> None:
        if self.engine is None:  # the engine places the model's chunks (offloaded, sharded) itself
            super().model_to_device()

    def lightning_module_state_dict(self) -> dict:
        if self.engine is None:
            return super().lightning_module_state_dict()
        return self.engine.full_state_dict(rank0_only=True)  # every process gathers its part

    def optimizer_state(self, optimizer) -> dict:
        return {}  # the engine's checkpoint holds it

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if self.engine is None or "optimizer_states" not in checkpoint:  # weights only: one file, full weights
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("storage_options: TiersStrategy writes the engine's checkpoint itself, not through "
                            "CheckpointIO; leave it out")
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_with_state(self.engine, self.broadcast(str(filepath)), state, self.is_global_zero)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        if self.engine is None:
            raise ValueError("a Tiers checkpoint loads into the engine, which exists from fit on; resume with "
                             "trainer.fit(..., ckpt_path=...), or evaluate from full weights (a weights-only "
                             "checkpoint or engine.full_state_dict())")
        if os.path.isfile(checkpoint_path):
            raise ValueError(f"{checkpoint_path} is a file (a weights-only checkpoint); resume from a TiersStrategy "
                             "checkpoint directory, or load these weights with LightningModule.load_from_checkpoint")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return load_with_state(self.engine, checkpoint_path, weights_only, load_optimizer_states=fitting,
                               load_lr_scheduler_states=fitting)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the engine's weights

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # and its optimizer's states

    def teardown(self) -> None:
        # unlike DDP's, nothing moves to the CPU: the engine's chunks hold the parameters and optimizer states
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _loader_batch_size(trainer: pl.Trainer) -> int | None:
    """The training loader's batch size, as Lightning's DeepSpeed strategy reads it (None when unknown)."""
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return None
    loader = source.dataloader()
    sampler = getattr(loader, "batch_sampler", None)
    return getattr(sampler, "batch_size", None)
