"""DeepSpeedEngine: DeepSpeed's engine API over a Tiers Engine (what deepspeed.initialize returns).

DeepSpeed names some things as methods that Tiers names as properties (train_batch_size(),
gradient_accumulation_steps(), ...); this facade answers with DeepSpeed's forms and hands the rest of the engine
API (forward, backward, step, no_sync, gathered_parameters, ...) to the Tiers engine. A DeepSpeed engine
attribute Tiers lacks is an error naming it.
"""

from __future__ import annotations

import contextlib
import os

import torch

from engine.compat.deepspeed.unsupported import refuse
from engine.engine import Engine


class DeepSpeedEngine:
    def __init__(self, engine: Engine, training_dataloader=None):
        self.engine = engine
        self.training_dataloader = training_dataloader
        self._step_applied = False

    # ---- identity ---------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.engine.topology.rank

    @property
    def world_size(self) -> int:
        return self.engine.topology.world_size

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def global_steps(self) -> int:
        return self.engine.global_step

    @property
    def global_samples(self) -> int:
        return self.engine.global_step * self.engine.train_batch_size

    # ---- the config, as DeepSpeed's methods ---------------------------------------------------
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.engine.train_batch_size

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def zero_optimization_stage(self) -> int:
        return self.engine.config.zero_optimization.stage

    def dataloader_drop_last(self) -> bool:
        return self.engine.config.dataloader_drop_last

    # ---- the loop ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Note [several backward passes per step]. scale_wrt_gas=False: the loss is not divided by the
        accumulation steps (the gradients are their sum, not their mean)."""
        gas = self.engine.gradient_accumulation_steps
        if not scale_wrt_gas and gas != 1:
            if self.engine.experts is not None:
                refuse("backward(scale_wrt_gas=False) with MoE layers", "backward(loss) (the engine adds the "
                       "router losses, which it averages over the accumulation steps)")
            loss = loss * gas  # engine.backward divides by gas again: the sum over micro-batches
        with self._reduced_at_step():
            self.engine.backward(loss, retain_graph=retain_graph)
        return loss

    def _reduced_at_step(self):
        """Note [several backward passes per step]
        DeepSpeed lets a script call backward more than once per micro-step (its GAN example backpropagates a
        discriminator's real and fake losses apart): under ZeRO 0 and 1 each backward at the boundary all-reduces
        the gradients accumulated so far, which adds up to the mean of the sum. The Tiers engine refuses a second
        reducing backward (it would reduce the first one's gradients twice), so here, without sharded gradients,
        every backward accumulates locally and the update reduces the gradients once: the same sum of means, and
        after backward, as DeepSpeed reduces at these stages. Stages 2 and 3 reduce each backward's gradients
        into their shards already."""
        runtime = self.engine.runtime
        if runtime.reducer is None or self.engine.chunked.sharded_grads is not None:
            return contextlib.nullcontext()
        return runtime.accumulate_locally()

    def step(self, lr_kwargs=None) -> None:
        if lr_kwargs is not None:
            refuse("step(lr_kwargs=...)", "a scheduler from the config's `scheduler` section")
        boundary = self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self._step_applied = False  # as DeepSpeed: true only after a step() that updated the model
        self.engine.step()
        if boundary:
            self._step_applied = self.engine.skipped_steps == skipped

    def was_step_applied(self) -> bool:
        """Whether the last update (at the last accumulation boundary) changed the model (an fp16 overflow skips
        it)."""
        return self._step_applied

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.engine.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        if exclude_frozen_parameters:
            refuse("save_checkpoint(exclude_frozen_parameters=True)", "save_checkpoint(...) (frozen parameters are "
                   "saved beside the chunks)")
        self.engine.save_checkpoint(save_dir, None if tag is None else str(tag), client_state or {}, save_latest)
        return True

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        if not load_module_strict or custom_load_fn is not None:
            refuse("load_checkpoint(load_module_strict=False / custom_load_fn=...)",
                   "load_checkpoint(...) on the model that saved it, or `tiers convert` and load_state_dict")
        return self.engine.load_checkpoint(load_dir, None if tag is None else str(tag), load_optimizer_states,
                                           load_lr_scheduler_states, load_module_only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False):
        if not save_filename.endswith(".safetensors") or exclude_frozen_parameters:
            refuse(f"save_16bit_model({save_filename!r}, exclude_frozen_parameters={exclude_frozen_parameters})",
                   "save_16bit_model(save_dir, 'model.safetensors') (Tiers writes safetensors, never pickles)")
        return self.engine.save_16bit_model(save_dir, save_filename)

    def release(self) -> None:
        """At exit (engine.compat.deepspeed.launch): the engine closed and let go, so that nothing keeps the
        process groups alive while the interpreter shuts down."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.close()

    # ---- everything else the Tiers engine has -------------------------------------------------
    def __getattr__(self, name: str):
        engine = self.__dict__.get("engine")
        if engine is not None and not name.startswith("_") and hasattr(engine, name):
            return getattr(engine, name)
        refuse(f"DeepSpeedEngine.{name}", "the engine API in docs/migrating-from-deepspeed.md")
