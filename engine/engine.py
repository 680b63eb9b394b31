"""Engine: a thin orchestrator of forward, backward and step over chunked parameters.

Note [micro-steps and boundaries]
`step()` is called after every micro-batch, as in DeepSpeed. `micro_step` counts those calls;
the update happens when `is_gradient_accumulation_boundary()`, i.e. on every
`gradient_accumulation_steps`-th call. `backward()` divides the loss by the accumulation steps
(DeepSpeed's convention, so accumulated gradients are a mean) and by the data-parallel size (so
the all-reduce's sum is already the mean; exact for power-of-two sizes, and one pass over the
gradients fewer than dividing afterwards) and, on the boundary micro-step outside `no_sync()`,
arms the reducer so gradient chunks are all-reduced during that backward.
When that backward returns, the gradients are reduced (as with DDP). Several synchronized backward
passes may run per update, and local ones after them (Note [several synchronized backward passes]);
if none ran (the boundary backward was inside `no_sync()`), `step()` reduces everything itself.
After a backward that failed once some of its chunks were reduced, `step()` is refused until
`zero_grad()`.
An overflowing fp16 step is skipped: no update, no LR-schedule step, `global_step` still
advances and `skipped_steps` counts it (as DeepSpeed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine import whole_weights
from engine.activation_checkpointing import ActivationCheckpointing
from engine.checkpoint import Saver, load_checkpoint, write_state_dict
from engine.checkpoint.whole_states import load_whole_states, load_whole_weights
from engine.compat.deepspeed_names import DeepSpeedNames
from engine.config import BatchSizes, Config
from engine.coordinates import ParallelCoordinates
from engine.features import Features
from engine.mesh import Mesh
from engine.moe.plan import ExpertParallel
from engine.monitor import Monitor
from engine.outputs import find_loss
from engine.pipeline.driver import PipelineDriver, pull_microbatches
from engine.plan import RunPlan
from engine.precision import LossScaler
from engine.progress import TrainingProgress
from engine.sequence_parallel.runtime import SequenceSplit
from engine.step_metrics import UpdateSummary
from engine.tensor_backward import TensorBackward
from engine.tensor_parallel import TensorParallel
from engine.zero.device_bytes import device_state_bytes
from engine.zero.runtime import ZeroRuntime


@dataclass
class EngineParts:
    """What initialize() builds around the ZeRO runtime for an Engine to drive."""

    mesh: Mesh
    lr_scheduler: object
    loss_scaler: LossScaler
    monitor: Monitor
    checkpointing: ActivationCheckpointing
    features: Features  # Note [feature objects]: each parallelism's part in the calls below
    progress: TrainingProgress
    saver: Saver  # Note [checkpoint commit]
    plan: RunPlan  # the batch sizes and the precision, resolved once


class Engine(ParallelCoordinates, DeepSpeedNames):
    """Wraps a model and optimizer; built by `engine.initialize`. The data-parallel work of each call runs in
    the ZeRO runtime's phases (Note [step phases]); what each parallelism adds, in its feature object (Note
    [feature objects]); dp_rank and the other coordinates come from ParallelCoordinates (Note [data-parallel
    coordinates])."""

    def __init__(self, module: nn.Module, config: Config, runtime: ZeroRuntime, parts: EngineParts):
        self.module, self.config, self.mesh = module, config, parts.mesh
        self.batch: BatchSizes = parts.plan.batch
        self.runtime, self.optimizer, self.lr_scheduler = runtime, runtime.optimizer, parts.lr_scheduler
        self.loss_scaler, self.monitor, self.features = parts.loss_scaler, parts.monitor, parts.features
        self.precision = parts.plan.precision
        # Note [activation checkpointing]: the config's options, for the wrapped modules and activation_checkpoint
        self.activation_checkpointing = parts.checkpointing
        self.progress, self._saver = parts.progress, parts.saver
        # the last update's norm, and the last forward's loss (logged for a loss.backward(): Note [tensor backward])
        self._global_grad_norm: float | None = None
        self._forward_loss: torch.Tensor | None = None
        runtime.start(module)
        # Note [tensor backward]: loss.backward() runs through the runtime's backward phase (a schedule runs its own)
        self._tensor_backward = self.features.tensor_backward(
            lambda: TensorBackward(module, runtime.chunked.params, runtime, self))
        parts.monitor.step_metrics.exclude_traffic_so_far()  # the start-up broadcast is not a step's traffic

    # ---- parallelisms (Note [feature objects]) ---------------------------------------------
    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """What the tp plan sharded (Note [tensor-parallel plans]); None without tensor parallelism."""
        return self.features.parallel("tensor_parallel")

    @property
    def pipeline(self) -> PipelineDriver | None:
        """The driver of train_batch / eval_batch (Note [a pipelined step]); None without a pipeline."""
        return self.features.parallel("pipeline")

    @property
    def sequence(self) -> SequenceSplit | None:
        """This rank's part of each sequence (Note [sequence parallelism]); None without sequence parallelism."""
        return self.features.parallel("sequence")

    @property
    def experts(self) -> ExpertParallel | None:
        """The MoE layers, their traffic and router losses (Note [expert parallelism]); None without any."""
        return self.features.parallel("experts")

    # ---- identity -------------------------------------------------------------------------
    @property
    def chunked(self):
        return self.runtime.chunked

    @property
    def comm(self):
        return self.runtime.comm

    @property
    def gatherer(self):
        return self.runtime.gatherer

    @property
    def reducer(self):
        return self.runtime.reducer

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    @property
    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @property
    def micro_step(self) -> int:
        return self.progress.micro_step

    @property
    def skipped_steps(self) -> int:
        return self.progress.skipped_steps

    # ---- training loop --------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def __call__(self, *args, **kwargs):
        """The module's forward under the precision policy; tensor arguments are moved to the engine's device."""
        self.features.check_micro_batch_call("forward")
        self._tensor_backward.settle()
        args, kwargs = to_device((args, kwargs), self.device)
        args = self.precision.forward_args(args)
        if self.module.training and torch.is_grad_enabled():  # eval forwards are not training throughput
            self.monitor.step_metrics.on_training_forward(args, kwargs)
        args, kwargs = self.features.split_inputs(args, kwargs)
        with (self.monitor.step_metrics.timed("forward"), self.precision.autocast(self.device),
              self.runtime.forward(), self.features.around_forward()):
            output = self.module(*args, **kwargs)
        output = self.features.output(output)
        self._forward_loss = find_loss(output)  # logged for a loss.backward() (Note [tensor backward])
        return output

    forward = __call__

    def activation_checkpoint(self, function, *args, **kwargs):
        """A drop-in for torch.utils.checkpoint.checkpoint (non-reentrant) with the config's
        activation_checkpointing options: `function(*args, **kwargs)` keeps only its inputs, and backward runs
        it again, with the same dropout masks (Note [activation checkpointing])."""
        return self.activation_checkpointing.checkpoint(function, *args, **kwargs)

    checkpoint = activation_checkpoint  # the earlier name (DeepSpeed's is deepspeed.checkpointing.checkpoint)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.progress.is_boundary()

    def no_sync(self):
        """Backward passes inside skip the gradient all-reduce (gradients accumulate locally)."""
        return self.runtime.no_sync()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Scales the loss (accumulation mean, fp16 loss scale) and runs autograd (Note [micro-steps and
        boundaries])."""
        self.features.check_micro_batch_call("backward")
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}; reduce it "
                             "(e.g. .mean()) first")
        self._tensor_backward.settle()
        self.monitor.step_metrics.on_loss(loss)
        self._forward_loss = None
        aux = self.features.take_aux_loss()  # e.g. engine.moe.MoE's weighted router losses
        total = loss if aux is None else loss + aux.to(loss.device)
        factor = self.loss_scaler.scale * self._gradient_factor()
        scaled = total.float() * factor if factor != 1.0 else total
        with (self.monitor.step_metrics.timed("backward"),
              self.runtime.backward(self.is_gradient_accumulation_boundary(), self.loss_scaler.scale)):
            scaled.backward(retain_graph=retain_graph)
        return loss

    def _gradient_factor(self) -> float:
        """What a micro-batch's loss is multiplied by (besides the loss scale): the accumulation and
        data-parallel mean (gradients are summed over the ZeRO group, sequence ranks included), and under
        sequence parallelism this rank's share of the sample's tokens (Note [sequence parallelism])."""
        return self.features.loss_weight() / (self.gradient_accumulation_steps * self.mesh.zero.size)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as engine.backward scales it (the fp16 loss scale, the accumulation and data-parallel mean),
        for `engine.scale(loss).backward()` in place of engine.backward(loss) (Note [tensor backward])."""
        self.features.check_micro_batch_call("scale")
        return self._tensor_backward.scaled(loss, self.loss_scaler.scale * self._gradient_factor())

    def _on_tensor_backward(self) -> None:
        """A loss.backward() started: its loss for the step's log is the last forward's, if it returned one."""
        if self._forward_loss is not None:
            self.monitor.step_metrics.on_loss(self._forward_loss)
            self._forward_loss = None

    def step(self) -> None:
        """Called after every micro-batch; updates the model at the accumulation boundary."""
        self.features.check_micro_batch_call("step")
        self._tensor_backward.settle()
        self.runtime.check_steppable()
        if not self.progress.end_micro_step():
            return
        self._update()

    def train_batch(self, data_iter=None) -> float:
        """Under a pipeline config (Note [a pipelined step]) or offload_param.layer_major (Note [layer-major
        accumulation]): takes the step's gradient_accumulation_steps micro-batches from `data_iter` (each a dict of
        the model's keyword arguments, a tensor, or a tuple), runs them through the pipeline schedule (or block by
        block) and updates the model; returns the step's mean loss on every rank. Every rank of a pipeline passes
        an iterator over the same micro-batches (its data-parallel rank's)."""
        pipeline = self.features.schedule("train_batch")
        microbatches = self._microbatches(data_iter)
        self.runtime.check_steppable()
        for mb in microbatches:
            args, kwargs = ((), mb) if isinstance(mb, dict) else ((mb,), {})
            self.monitor.step_metrics.on_training_forward(args, kwargs)
        loss = pipeline.train(microbatches, self.loss_scaler.scale)
        self.monitor.step_metrics.on_loss(torch.tensor(loss))
        for _ in microbatches:
            self.progress.end_micro_step()
        self._update()
        return loss

    def eval_batch(self, data_iter=None) -> float:
        """Under a pipeline config or offload_param.layer_major: the forwards of gradient_accumulation_steps
        micro-batches from `data_iter` in eval mode, without gradients; returns their mean loss on every rank."""
        return self.features.schedule("eval_batch").evaluate(self._microbatches(data_iter))

    def _microbatches(self, data_iter) -> list:
        return to_device(pull_microbatches(data_iter, self.gradient_accumulation_steps), self.device)

    def _update(self) -> None:
        """The update at an accumulation boundary: reduce, unscale, clip, step, log."""
        with self.monitor.step_metrics.timed("optimizer"), self.runtime.step(self.loss_scaler.scale) as grads:
            if not grads.overflow:
                self.runtime.update(grads)
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            self.loss_scaler.update(grads.overflow)
        self._global_grad_norm = grads.norm
        self.progress.end_update(skipped=grads.overflow)
        extra = self.features.metrics()
        self.monitor.end_update(UpdateSummary(
            self.global_step, self.get_lr()[0], self.loss_scaler.scale, self.skipped_steps, grads.norm,
            self.train_batch_size, self.dp_world_size, self.model_state_bytes, extra))

    def zero_grad(self) -> None:
        """Clears accumulated gradients (the engine also does this after every update)."""
        self.runtime.zero_grads()

    # ---- whole weights ------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = False, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The model's full state dict (keys as `module.state_dict()`; under a pipeline, the unsplit model's,
        gathered from the stages), copied to CPU, on every rank; with rank0_only, on rank 0 only (the others get
        None). Stages 0-2 keep every parameter whole on every rank; stage 3 gathers one chunk at a time (every
        rank must call this). With bf16 / fp16 the parameters are their fp32 master weights. trainable_only: the
        parameters that train, nothing else (adapters without their frozen base: PEFT's save_pretrained takes it)."""
        if trainable_only and self.features.joins_state_dict:
            raise ValueError("full_state_dict(trainable_only=True) under tensor, expert or pipeline parallelism: take "
                             "full_state_dict() and keep the trainable entries")
        keep = not rank0_only or self.mesh.world.rank == 0
        # each rank gathers its part; the features join the parts (Note [feature objects])
        whole = whole_weights.full_state_dict(self.module, self.chunked, self.gatherer, self.mesh.shard.group,
                                              self.comm, keep or self.features.joins_state_dict, trainable_only)
        whole = self.features.join_state_dict(whole, keep)
        return whole if keep else None

    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """The model's whole state dict (keys as full_state_dict's, the same on every rank; every rank must call
        this) into its parameters and buffers, the fp32 masters taking the values whole rather than the 16-bit
        parameters' rounding of them. Key and shape errors are raised before anything is copied. Under tensor,
        pipeline or expert parallelism each rank takes its part of the tensors it holds (Note [whole optimizer
        states])."""
        if self.features.joins_state_dict:
            self._saver.wait()
            load_whole_weights(self._saver.state, state, strict)
            return
        params = list(self.module.parameters())
        with self.gathered_parameters(params, modifier_rank=0):  # gathered: stage 3's released shapes are whole
            whole_weights.check_loadable(state, self.module.state_dict(), strict)
            self.module.load_state_dict(state, strict=strict)
        named = dict(self.module.named_parameters())
        self.chunked.load_masters([(p, state[n].float()) for n, p in named.items() if n in state])

    # ---- checkpoints (engine/checkpoint/) -------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Saves this engine's whole training state into save_dir/tag (default tag "global_step<N>") and points
        save_dir/latest at it; every rank must call it (Note [checkpoint commit]). client_state (JSON values and
        tensors, e.g. a data loader's state_dict()) comes back from load_checkpoint. Returns the checkpoint's path;
        with checkpoint.async_save the files are still being written when it returns (Note [asynchronous save]).
        exclude_frozen_parameters: leave the frozen parameters out (an adapter-only checkpoint); loading it keeps the
        frozen values the loading engine holds (its pretrained base)."""
        return self._saver.save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Loads load_dir/tag (default: the tag load_dir/latest names), saved under any data-parallel,
        tensor-parallel, ZeRO or offload layout (Note [reading a checkpoint anywhere]); every rank must call it.
        Returns (the checkpoint's path, its client_state), or (None, None) when load_dir has no `latest`."""
        self._saver.wait()
        return load_checkpoint(self._saver.state, self._saver.control, load_dir, tag, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def load_whole_optimizer_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Optimizer states given whole, by parameter name ({name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}},
        another framework's optimizer file) into this engine's chunks, each rank its piece (Note [whole optimizer
        states]); `engine.checkpoint.whole_states.read_whole_states` reads them out of a checkpoint."""
        self._saver.wait()
        load_whole_states(self._saver.state, states)

    def wait_for_checkpoint(self) -> str | None:
        """Waits for a background save (checkpoint.async_save) to commit and raises its error, if any; returns the
        path of the last checkpoint committed."""
        return self._saver.wait()

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> str | None:
        """The model's state dict with parameters in the compute dtype (bf16 / fp16, or fp32), whole, written by
        rank 0 as one safetensors file (every rank must call it: stage 3 gathers). Returns its path on rank 0.
        Under ZeRO stage 3, as in DeepSpeed, zero_optimization.stage3_gather_16bit_weights_on_model_save must be
        true (a checkpoint and `tiers convert` need no gather)."""
        zero = self.config.zero_optimization
        if self.chunked.gathers_params and not zero.stage3_gather_16bit_weights_on_model_save:
            raise RuntimeError("save_16bit_model under ZeRO stage 3 gathers the whole model onto rank 0; set "
                               "zero_optimization.stage3_gather_16bit_weights_on_model_save to true (DeepSpeed saves "
                               "nothing without it), or save a checkpoint and run `tiers convert` on it")
        state = self.full_state_dict(rank0_only=True)
        chunked = whole_weights.chunked_keys(self.module, self.chunked, self.mesh)  # (a collective) every stage's
        if state is None:
            return None
        chunked |= self.features.chunked_keys(state)  # e.g. every ep rank's experts
        dtype = self.precision.compute_dtype
        state = {k: v.to(dtype) if k in chunked else v for k, v in state.items()}
        return write_state_dict(save_dir, save_filename, state)

    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Parameters (default all) readable inside the block; with `modifier_rank`, that rank may modify
        them and its values reach every rank on exit (DeepSpeed's GatheredParameters); without it,
        changes made inside are not kept under stage 3. Every rank must enter with the same parameters.
        Stages 0-2 keep parameters whole, so entering gathers nothing."""
        params = list(self.module.parameters()) if params is None else list(params)
        return whole_weights.gathered_parameters(params, self.chunked, self.gatherer, self.mesh.zero.group, self.comm,
                                                 modifier_rank, self.mesh.zero.size > 1)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: parameter chunks, gradient chunks (and stage-2 shards),
        optimizer state tensors."""
        chunked = self.chunked
        params = sum(p.untyped_storage().nbytes() for p in chunked.param_payloads())
        params += chunked.sharded_params.shard_bytes()  # 0 under the degenerate layout (Note [stage predicates])
        grads = sum(g.untyped_storage().nbytes() for g in chunked.grad_payloads()) + chunked.sharded_grads.shard_bytes()
        optim = sum(v.untyped_storage().nbytes() for state in self.optimizer.state.values() for v in state.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        if chunked.has_masters:
            optim += chunked.masters.nbytes()
        return {"param": params, "grad": grads, "optim": optim}

    def device_state_bytes(self) -> dict[str, int]:
        """Bytes of model state on the compute device, by kind ("param", "grad", "optim", "master"): in memory and
        on an offloaded optimizer's device tier (Note [separate device memory])."""
        return device_state_bytes(self.chunked, self.optimizer)

    # ---- queries ----------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the full averaged gradient before clipping, at the last update.

        None before the first update, and when nothing needed it (no clipping, no fp16, no TensorBoard).
        """
        return self._global_grad_norm

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale

    def close(self) -> None:
        """Waits for a background save, flushes the monitor, removes the engine's hooks and closes an offloaded
        optimizer's chunk manager; then raises the background save's error, if any."""
        try:
            self._saver.wait()  # a background save commits (or fails) before anything closes
        finally:
            self.monitor.close()
            if hasattr(self.optimizer, "close"):
                self.optimizer.close()
            self._tensor_backward.remove_hooks()
            self.features.close()
            self.runtime.close()


def to_device(value, device: torch.device):
    """Tensors in (nested tuples, lists, dicts of) forward arguments, moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True) if value.device != device else value
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
