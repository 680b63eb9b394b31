"""DeepSpeedEngine: DeepSpeed's engine API over a Tiers Engine (what deepspeed.initialize returns).

As DeepSpeed's, the engine is an nn.Module whose one submodule is `module`: `engine.parameters()`,
`engine.named_parameters()` (names prefixed `module.`), `engine.state_dict()`, hooks and `engine(...)` behave as
on DeepSpeed's. DeepSpeed names some things as methods that Tiers names as properties (train_batch_size(),
gradient_accumulation_steps(), ...); this facade answers with DeepSpeed's forms and hands the rest of the engine
API (backward, step, no_sync, gathered_parameters, ...) to the Tiers engine, then, as DeepSpeed's engine does,
whatever the model has (`engine.gradient_checkpointing_enable()`, `engine.config_class`, ...) to the model. A name
neither has is an error naming it.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

import engine.compat.deepspeed.saving as saving
from engine.compat.deepspeed.offload_names import OffloadDeviceEnum, OffloadStateTypeEnum
from engine.compat.deepspeed.throughput import ThroughputTimer
from engine.compat.deepspeed.unsupported import refuse
from engine.engine import Engine
from engine.whole_weights import check_loadable
from engine.zero.state_offload import MovedStates, StateKind
from offload.device_memory import DeviceMemory

logger = logging.getLogger("DeepSpeed")


class DeepSpeedEngine(nn.Module):
    def __init__(self, engine: Engine, training_dataloader=None, config: dict | None = None,
                 client_optimizer: bool = False):
        super().__init__()
        self.__dict__["engine"] = engine  # not a submodule: the model is (as in DeepSpeed)
        self.module = engine.module
        self.training_dataloader = training_dataloader
        self._config_dict = config if config is not None else engine.config.to_dict()
        self._client_optimizer = client_optimizer
        self._step_applied = False
        self._moved_states = MovedStates()  # Note [states moved off the device]
        self.tput_timer = ThroughputTimer(engine.train_batch_size)

    # ---- identity ---------------------------------------------------------------------------
    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    @property
    def config(self) -> dict:
        """The config as given to initialize (DeepSpeed keeps the dict)."""
        return self._config_dict

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.engine.mesh.world.rank

    @property
    def world_size(self) -> int:
        return self.engine.mesh.world.size

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

    def optimizer_name(self) -> str | None:
        """DeepSpeed's answer: the client optimizer's class name, else the config's type, lower-cased."""
        if self._client_optimizer:
            return type(self.engine.optimizer).__name__
        section = self.engine.config.optimizer
        return None if section is None else section.type.lower()

    # ---- the loop ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._refuse_while_offloaded("forward")
        self.tput_timer.start()
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Several calls per step add up (Note [several synchronized backward passes]). scale_wrt_gas=False:
        the loss is not divided by the accumulation steps (the gradients are their sum, not their mean)."""
        self._refuse_while_offloaded("backward")
        gas = self.engine.gradient_accumulation_steps
        if not scale_wrt_gas and gas != 1:
            if self.engine.experts is not None:
                refuse("backward(scale_wrt_gas=False) with MoE layers", "backward(loss) (the engine adds the "
                       "router losses, which it averages over the accumulation steps)")
            loss = loss * gas  # engine.backward divides by gas again: the sum over micro-batches
        self.engine.backward(loss, retain_graph=retain_graph)
        return loss


    def step(self, lr_kwargs=None) -> None:
        if lr_kwargs is not None:
            refuse("step(lr_kwargs=...)", "a scheduler from the config's `scheduler` section")
        self._refuse_while_offloaded("step")
        boundary = self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self._step_applied = False  # as DeepSpeed: true only after a step() that updated the model
        self.engine.step()
        if boundary:
            self._step_applied = self.engine.skipped_steps == skipped
        self.tput_timer.stop(global_step=boundary)

    def was_step_applied(self) -> bool:
        """Whether the last update (at the last accumulation boundary) changed the model (an fp16 overflow skips
        it)."""
        return self._step_applied

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Accepted where it agrees with the engine's count of micro-steps (accelerate and the HF Trainer set it
        so); a boundary elsewhere would move the update, which the engine's count decides."""
        if bool(is_boundary) != self.engine.is_gradient_accumulation_boundary():
            raise ValueError(
                f"set_gradient_accumulation_boundary({is_boundary}) at micro-step {self.engine.micro_step} with "
                f"gradient_accumulation_steps {self.engine.gradient_accumulation_steps}: Tiers updates on every "
                "gradient_accumulation_steps-th step() call; set gradient_accumulation_steps in the config to the "
                "accumulation the loop runs")

    def compile(self, *args, **kwargs) -> None:
        refuse("engine.compile()", "the engine uncompiled (its chunk hooks and stage-3 gathers are not traced by "
               "torch.compile), or torch.compile on submodules that hold no engine parameters")

    @property
    def is_compiled(self) -> bool:
        return False

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.engine.train(mode)
        self.training = mode
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients cleared where the engine keeps them (its chunks); nn.Module's would drop the parameters'
        .grad views and leave the chunks holding them."""
        self._refuse_while_offloaded("zero_grad")
        self.engine.zero_grad()

    # ---- states and saving --------------------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's (keys prefixed `module.`), with every parameter gathered and its fp32 master following the
        loaded value (a plain copy into the parameters would be undone by the next update from the masters, or
        land in released stage-3 storage). Every rank must call it with the same state dict."""
        self._refuse_while_offloaded("load_state_dict")
        if assign:
            refuse("engine.load_state_dict(assign=True)", "load_state_dict(state_dict) (the parameters live in "
                   "the engine's chunks and must stay there)")
        check_loadable(state_dict, self.state_dict(), strict)  # before anything is copied: nothing half-loaded
        with self.engine.gathered_parameters(modifier_rank=0):
            return super().load_state_dict(state_dict, strict=strict)

    def save_checkpoint(self, save_dir: str, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        self._refuse_while_offloaded("save_checkpoint")
        self.engine.save_checkpoint(save_dir, None if tag is None else str(tag), client_state or {}, save_latest,
                                    exclude_frozen_parameters)
        return True

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        self._refuse_while_offloaded("load_checkpoint")
        if not load_module_strict or custom_load_fn is not None:
            refuse("load_checkpoint(load_module_strict=False / custom_load_fn=...)",
                   "load_checkpoint(...) on the model that saved it, or `tiers convert` and load_state_dict")
        return self.engine.load_checkpoint(load_dir, None if tag is None else str(tag), load_optimizer_states,
                                           load_lr_scheduler_states, load_module_only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's file: the 16-bit state dict written by torch.save (a `.safetensors` name writes
        safetensors); every rank must call it."""
        self._refuse_while_offloaded("save_16bit_model")
        return saving.save_16bit_model(self.engine, save_dir, save_filename, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole model's state dict in the compute dtype on rank 0 (None elsewhere); every rank must call it."""
        self._refuse_while_offloaded("_zero3_consolidated_16bit_state_dict")
        return saving.consolidated_16bit_state_dict(self.engine, exclude_frozen_parameters)

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        """Moves the model states of the kinds in `include` (OffloadStateTypeEnum values; None: all) off the compute
        device to host memory, to free it between phases (Note [states moved off the device]); forward, backward
        and step are refused until reload_states(). Where the compute device is the host nothing moves. The copies
        are synchronous (non_blocking is accepted and changes nothing)."""
        if OffloadDeviceEnum(device) is not OffloadDeviceEnum.cpu:
            raise ValueError(f"offload_states(device={device!r}): DeepSpeed offloads states to the CPU only")
        kinds = [StateKind(OffloadStateTypeEnum(k).value) for k in include] if include is not None else list(StateKind)
        if DeviceMemory(self.engine.device).separate:
            self._moved_states.move_off(kinds, self.engine.chunked, self.engine.optimizer, pin_memory)
        else:
            self._moved_states.kinds.update(kinds)  # in host memory already

    def reload_states(self, non_blocking: bool = False) -> None:
        """Puts back on the device what offload_states moved off it."""
        self._moved_states.put_back()

    def _refuse_while_offloaded(self, call: str) -> None:
        if self._moved_states.any:
            kinds = sorted(k.value for k in self._moved_states.kinds)
            raise RuntimeError(f"engine.{call} while the model states {kinds} are offloaded (offload_states): "
                               "call engine.reload_states() first")

    def empty_partition_cache(self) -> None:
        """DeepSpeed releases the stage-3 parameters it holds gathered. Tiers' gatherer releases every
        non-persistent chunk when a pass ends (Note [gathering around modules]), so between passes there is
        nothing to release; persistent chunks stay whole, as DeepSpeed's persistent parameters do."""

    def destroy(self) -> None:
        """Closes the engine and lets go of it (its hooks, chunks and optimizer), as DeepSpeed's destroy()."""
        self.release()

    def release(self) -> None:
        """At exit (engine.compat.deepspeed.launch): the engine closed and let go, so that nothing keeps the
        process groups alive while the interpreter shuts down."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.close()

    # ---- everything else the Tiers engine or the model has ---------------------------------------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # submodules, parameters, buffers
        except AttributeError:
            pass
        engine = self.__dict__.get("engine")
        if engine is None:
            refuse(f"DeepSpeedEngine.{name} after destroy()", "a new deepspeed.initialize(...)")
        if not name.startswith("_") and hasattr(engine, name):
            return getattr(engine, name)
        module = self._modules.get("module")
        if module is not None and not name.startswith("_") and hasattr(module, name):
            return getattr(module, name)
        refuse(f"DeepSpeedEngine.{name}", "the engine API in docs/migrating-from-deepspeed.md")
