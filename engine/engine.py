"""Engine: a thin orchestrator of forward, backward and step over chunked parameters.

Note [micro-steps and boundaries]
`step()` is called after every micro-batch, as in DeepSpeed. `micro_step` counts those calls;
the update happens when `is_gradient_accumulation_boundary()`, i.e. on every
`gradient_accumulation_steps`-th call. `backward()` divides the loss by the accumulation steps
(DeepSpeed's convention, so accumulated gradients are a mean) and by the data-parallel size (so
the all-reduce's sum is already the mean; exact for power-of-two sizes, and one pass over the
gradients fewer than dividing afterwards) and, on the boundary micro-step outside `no_sync()`,
arms the reducer so gradient chunks are all-reduced during that backward.
When that backward returns, the gradients are reduced (as with DDP). At most one synchronized
backward may run per update (a second one would reduce the first loss's gradients twice); if
none ran (the boundary backward was inside `no_sync()`), `step()` reduces everything itself.
An overflowing fp16 step is skipped: no update, no LR-schedule step, `global_step` still
advances and `skipped_steps` counts it (as DeepSpeed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch
from torch import nn

from engine import whole_weights
from engine.activation_checkpointing import ActivationCheckpointing
from engine.checkpoint import Saver, load_checkpoint, write_state_dict
from engine.comm import CommCounter, all_gather_in_place, all_reduce_sum, broadcast_from
from engine.config import BatchSizes, Config
from engine.monitor import Monitor
from engine.precision import LossScaler, PrecisionPolicy
from engine.topology import Topology
from engine.tensor_parallel import TensorParallel
from engine.zero.chunked_params import ChunkedParams, weighted_square_sum
from engine.zero.grad_sync import GradReducer
from engine.zero.param_gather import ParamGatherer, Pass

_RELEASED_PARAMETER_HINT = (
    "a parameter was used while its ZeRO stage 3 chunk was released: stage 3 gathers a module's parameters "
    "around that module's own forward and backward, so a parameter read outside its module (e.g. "
    "`other.weight` used in a parent's forward) or after the pass is not there; call the owning module "
    "instead, wrap the read in engine.gathered_parameters([...]), or raise "
    "zero_optimization.stage3_param_persistence_threshold above its size so that it stays gathered")


class Engine:
    """Wraps a model and optimizer; built by `engine.initialize`."""

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        batch: BatchSizes,
        topology: Topology,
        chunked: ChunkedParams,
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        loss_scaler: LossScaler,
        precision: PrecisionPolicy,
        monitor: Monitor,
        tensor_parallel: TensorParallel | None = None,
        checkpointing: ActivationCheckpointing | None = None,
    ):
        self.module = module
        self.config = config
        self.batch = batch
        self.topology = topology
        self.chunked = chunked
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.precision = precision
        self.monitor = monitor
        self.tensor_parallel = tensor_parallel  # what the tp plan sharded (Note [tensor-parallel plans])
        # Note [activation checkpointing]: the config's options, for the wrapped modules and engine.checkpoint
        self.activation_checkpointing = checkpointing or ActivationCheckpointing(config.activation_checkpointing,
                                                                                 topology.device)
        self.comm = CommCounter()
        zero = config.zero_optimization
        self.gatherer: ParamGatherer | None = None  # stage 3 (Note [gathering around modules])
        if chunked.sharded_params is not None:
            prefetch = zero.stage3_prefetch_bucket_size if zero.stage3_prefetch_bucket_size != "auto" else 50_000_000
            self.gatherer = ParamGatherer(module, chunked.sharded_params, chunked.chunk_index(), topology.dp_group,
                                          self.comm, prefetch, zero.stage3_max_live_parameters)
        overlap = zero.overlap_comm is not False  # stage 0 overlaps unless told not to
        self.reducer = (GradReducer(chunked, topology.dp_group, self.comm, overlap, zero.reduce_scatter,
                                    self.gatherer.on_grads_complete if self.gatherer else None)
                        if topology.is_distributed else None)
        self.global_step = 0
        self.micro_step = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        # Note [stepping in backward]: the boundary backward updates each shard as it is reduced
        self._steps_in_backward = zero.offload_optimizer.step_in_backward
        self._early_grad_square: torch.Tensor | None = None  # their norm pieces, for TensorBoard
        self._inside_no_sync = False
        self._synchronized = False  # a synchronized backward ran since the last update
        self._phase_s = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # wall_clock_breakdown
        self._recompute_s_at_last_step = 0.0  # activation_checkpointing.profile
        self._losses: list[torch.Tensor] = []
        self._tokens = 0
        self._step_start: float | None = None  # first training forward of the current update
        if topology.is_distributed:
            self._broadcast_initial_state()
        if chunked.sharded_params is not None and not chunked.values_pending:  # zero_init wrote the shards
            chunked.sharded_params.take_shards()  # from here on each rank holds its shards only
        if chunked.masters is not None and not chunked.values_pending:
            chunked.masters.sync_from_params()  # the starting weights are rank 0's (Note [master weights])
        self._comm_at_last_step = dataclasses.replace(self.comm)  # the start-up broadcast is not a step's traffic
        self._moved_at_last_step: dict[str, int] = {}  # the chunk manager's bytes moved, per direction
        self._saver = Saver(self)  # Note [checkpoint commit]

    # ---- identity -------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank

    @property
    def dp_world_size(self) -> int:
        return self.topology.dp_world_size

    @property
    def dp_group(self):
        return self.topology.dp_group

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    @property
    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters (trainable and frozen) and buffers, as DDP does."""
        chunked = {id(p) for p in self.chunked.params}
        with torch.no_grad():
            # zero_init built the same values on every rank from the same recorded RNG states (Note [zero_init])
            for payload in self.chunked.param_payloads() if not self.chunked.values_pending else []:
                broadcast_from(payload, 0, self.dp_group, self.comm)
            for t in [p for p in self.module.parameters() if id(p) not in chunked] + list(self.module.buffers()):
                broadcast_from(t.data, 0, self.dp_group, self.comm)

    # ---- training loop --------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def __call__(self, *args, **kwargs):
        """The module's forward under the precision policy; tensor arguments are moved to the engine's device."""
        args, kwargs = _to_device((args, kwargs), self.device)
        if self.module.training and torch.is_grad_enabled():  # eval forwards are not training throughput
            self._tokens += _count_token_ids(args, kwargs)
            if self._step_start is None:
                self._step_start = time.perf_counter()
        with self._timed("forward"), self.precision.autocast(self.device), self._pass(Pass.FORWARD):
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def _pass(self, phase: Pass):
        """Stage 3: a forward or backward pass, after which no parameter chunk stays gathered."""
        if self.gatherer is None:
            yield
            return
        self.gatherer.begin(phase)
        try:
            yield
        except RuntimeError as e:
            if "for storage of size 0" in str(e) or "data is not allocated" in str(e):
                raise RuntimeError(_RELEASED_PARAMETER_HINT) from e
            raise
        finally:
            self.gatherer.end()

    @contextlib.contextmanager
    def _timed(self, phase: str):
        """wall_clock_breakdown: time a phase (synchronizing the device so the time is the work's)."""
        if not self.config.wall_clock_breakdown:
            yield
            return
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(self.device)
            self._phase_s[phase] += time.perf_counter() - start

    forward = __call__

    def checkpoint(self, function, *args, **kwargs):
        """A drop-in for torch.utils.checkpoint.checkpoint (non-reentrant) with the config's
        activation_checkpointing options: `function(*args, **kwargs)` keeps only its inputs, and backward runs
        it again, with the same dropout masks (Note [activation checkpointing])."""
        return self.activation_checkpointing.checkpoint(function, *args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_step + 1) % self.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip the gradient all-reduce (gradients accumulate locally)."""
        if self.chunked.sharded_grads is not None:
            raise RuntimeError("no_sync() is not possible with ZeRO stage 2: gradients are sharded, so every backward "
                               "reduce-scatters them (Note [sharded gradients]); use stage 0 or 1 for local "
                               "accumulation, or simply call backward without it")
        previous, self._inside_no_sync = self._inside_no_sync, True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Scales the loss (accumulation mean, fp16 loss scale) and runs autograd; see Note [micro-steps and boundaries]."""
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}; reduce it (e.g. .mean()) first")
        self._losses.append(loss.detach())
        factor = self.loss_scaler.scale / (self.gradient_accumulation_steps * self.dp_world_size)
        scaled = loss.float() * factor if factor != 1.0 else loss
        every_backward = self.chunked.sharded_grads is not None  # Note [sharded gradients]
        reduce_now = self.reducer is not None and (every_backward or (self.is_gradient_accumulation_boundary()
                                                                      and not self._inside_no_sync))
        if reduce_now:
            if self._synchronized and not every_backward:
                raise RuntimeError(
                    "a second synchronized engine.backward() before engine.step() would all-reduce the first loss's "
                    "gradients twice; add the losses and call backward once, or run the earlier backward calls "
                    "inside engine.no_sync()")
            if self._steps_in_backward and self.optimizer.stepped_early:
                raise RuntimeError(
                    "engine.backward() after the accumulation boundary's backward: with "
                    "offload_optimizer.step_in_backward that backward already updated the model; call engine.step() "
                    "after it (once per micro-batch), or add the losses and call backward once")
            self.reducer.arm()
            if self._steps_in_backward and self.is_gradient_accumulation_boundary():
                self._arm_steps_in_backward()
        with self._timed("backward"):
            try:
                with self._pass(Pass.BACKWARD):
                    scaled.backward(retain_graph=retain_graph)
                if reduce_now:
                    self.reducer.finish_backward()
                    self.reducer.wait()  # gradients are reduced when backward returns, as with DDP
                    self.reducer.raise_callback_error()
            except BaseException as e:
                if reduce_now:
                    self.reducer.disarm()  # also drops the step callback: nothing more is stepped
                    if self._steps_in_backward and self.optimizer.stepped_early:
                        raise RuntimeError(
                            f"backward failed after offload_optimizer.step_in_backward had updated "
                            f"{self.optimizer.stepped_early} parameter shard(s) with their final gradients: the model "
                            "is partly updated and cannot be rolled back; restore it from a checkpoint (build the "
                            "engine again from saved weights)") from e
                raise
            if reduce_now:
                self.reducer.on_shard_reduced = None
                self._synchronized = True
        return loss

    def _arm_steps_in_backward(self) -> None:
        """Note [stepping in backward]: each reduced shard of the coming backward is final; step it at once."""
        self.optimizer.grad_scale = 1.0 / self.loss_scaler.scale  # no clipping (refused by initialize)
        self._early_grad_square = torch.zeros((), dtype=torch.float64) if self._needs_grad_norm() else None
        managed = self.chunked.sharded_grads.managed

        def step_reduced_shard(index: int) -> None:
            if self._early_grad_square is not None:
                self._early_grad_square += self.chunked.grad_square_sum(index)
            self.optimizer.step_early(managed[index])

        self.reducer.on_shard_reduced = step_reduced_shard

    def step(self) -> None:
        """Called after every micro-batch; updates the model at the accumulation boundary."""
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync() would update from unreduced gradients; "
                               "leave the no_sync() block and run one synchronized backward first")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_step += 1
        if not boundary:
            return
        with self._timed("optimizer"):
            if self.reducer is not None and not self._synchronized and self.chunked.sharded_grads is None:
                self.reducer.reduce_all()  # the boundary backward ran inside no_sync()
            self._synchronized = False
            if self.chunked.sharded_grads is not None:
                self.chunked.sharded_grads.settle()  # shards no backward wrote (Note [sharded gradients])
            self.chunked.sync_views()
            masters = self.chunked.masters  # bf16 / fp16: Note [master weights]
            if masters is not None:
                masters.stage_grads()
            overflow = self._prepare_gradients()
            if overflow:
                self.skipped_steps += 1
            else:
                self.chunked.rebind_optimizer_grads()
                self.optimizer.step()
                if masters is not None:
                    masters.update_params()
                self._gather_updated_params()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            if masters is not None:
                masters.drop_grads()
            self.loss_scaler.update(overflow)
            self.chunked.zero_grads()
        self.global_step += 1
        self._log_step()

    def _gather_updated_params(self) -> None:
        """Sharded optimizer states: each rank updated its shard of every param chunk; all-gather them."""
        if not self.chunked.sharded:
            return
        works = [all_gather_in_place(payload, self.dp_group, self.chunked.shard_rank, self.chunked.shard_count,
                                     self.comm, async_op=True) for payload in self.chunked.payloads_gathered_after_step()]
        for work in works:
            work.wait()

    def _needs_grad_norm(self) -> bool:
        """The norm costs a pass over every gradient: only when clipping, overflow checks or TensorBoard use it."""
        return self.config.gradient_clipping > 0 or self.loss_scaler.checks_overflow or self.config.tensorboard.enabled

    def _prepare_gradients(self) -> bool:
        """Unscales, computes the global norm and clips; returns True on overflow."""
        if self.chunked.grads_managed:
            return self._prepare_streamed_gradients()
        grads = self.chunked.grad_shards()  # what the optimizer reads: the reduced shards
        if self.loss_scaler.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.loss_scaler.scale)
        if not self._needs_grad_norm():
            self._global_grad_norm = None
            return False
        # per-parameter norms, then the norm of those (as torch's clip_grad_norm_): one fp32
        # reduction over a whole multi-million-element chunk loses ~1e-5 of relative accuracy
        pieces = self.chunked.grad_norm_pieces()
        if not self.chunked.sharded and self.topology.tp_size == 1:
            norms = torch._foreach_norm([piece for piece, _ in pieces], 2.0)
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0).item()
        else:  # each rank holds a shard of the gradient: sum the squares over the groups
            total = math.sqrt(self._summed_over_ranks(weighted_square_sum(pieces)))
        overflow, coef = self._overflow_and_clip(total)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        return overflow

    def _summed_over_ranks(self, square: torch.Tensor) -> float:
        """A rank's (weighted) sum of squared gradient pieces, summed over the data-parallel shards and the
        tensor-parallel ranks (Note [global norm under tensor parallelism])."""
        square = square.to(self.device)
        if self.chunked.sharded:
            all_reduce_sum(square, self.dp_group, self.comm, async_op=False)
        if self.topology.tp_size > 1:
            all_reduce_sum(square, self.topology.tp_group, self.comm, async_op=False)
        return square.item()

    def _overflow_and_clip(self, total: float) -> tuple[bool, float]:
        """Records the global norm; (overflow, the clipping factor, 1.0 for none). bf16/fp32 never overflow:
        as in DeepSpeed the update proceeds (and shows the NaN)."""
        self._global_grad_norm = total
        overflow = not math.isfinite(total) and self.loss_scaler.checks_overflow
        clip = self.config.gradient_clipping
        coef = clip / (total + 1e-6) if clip > 0 and not overflow else 1.0
        return overflow, coef if coef < 1.0 else 1.0

    def _prepare_streamed_gradients(self) -> bool:
        """Note [offloaded gradient shards]: the gradients are in the chunk manager, read one shard at a time
        for the norm; unscaling and clipping become one factor the optimizer applies as it steps each shard."""
        scale = self.loss_scaler.scale
        self.optimizer.grad_scale = 1.0 / scale
        if not self._needs_grad_norm():
            self._global_grad_norm = None
            return False
        if self.optimizer.stepped_early:  # Note [stepping in backward]: the norm was summed as shards were stepped
            self._global_grad_norm = math.sqrt(self._summed_over_ranks(self._early_grad_square)) / scale
            return False
        square = self._summed_over_ranks(self.chunked.streamed_grad_square_sum())
        overflow, coef = self._overflow_and_clip(math.sqrt(square) / scale)
        self.optimizer.grad_scale *= coef
        return overflow

    def zero_grad(self) -> None:
        """Clears accumulated gradients (the engine also does this after every update)."""
        self.chunked.zero_grads()

    # ---- whole weights ------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The model's full state dict (keys as `module.state_dict()`), copied to CPU, on every rank; with
        rank0_only, on rank 0 only (the others get None). Stages 0-2 keep every parameter whole on every
        rank; stage 3 gathers one chunk at a time (every rank must call this). With bf16 / fp16 the
        parameters are their fp32 master weights."""
        keep = not rank0_only or self.topology.rank == 0
        if self.tensor_parallel is None:
            return whole_weights.full_state_dict(self.module, self.chunked, self.gatherer, self.dp_group, self.comm,
                                                 keep)
        # every tp rank contributes its shards (Note [tensor-parallel plans])
        local = whole_weights.full_state_dict(self.module, self.chunked, self.gatherer, self.dp_group, self.comm, True)
        whole = self.tensor_parallel.join_state_dict(local, self.device)
        return whole if keep else None

    # ---- checkpoints (engine/checkpoint/) -------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """Saves this engine's whole training state into save_dir/tag (default tag "global_step<N>") and points
        save_dir/latest at it; every rank must call it (Note [checkpoint commit]). client_state (JSON values and
        tensors, e.g. a data loader's state_dict()) comes back from load_checkpoint. Returns the checkpoint's path;
        with checkpoint.async_save the files are still being written when it returns (Note [asynchronous save])."""
        return self._saver.save(save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Loads load_dir/tag (default: the tag load_dir/latest names), saved under any data-parallel,
        tensor-parallel, ZeRO or offload layout (Note [reading a checkpoint anywhere]); every rank must call it.
        Returns (the checkpoint's path, its client_state), or (None, None) when load_dir has no `latest`."""
        self._saver.wait()
        return load_checkpoint(self, self._saver.control, load_dir, tag, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

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
        if self.chunked.sharded_params is not None and not zero.stage3_gather_16bit_weights_on_model_save:
            raise RuntimeError("save_16bit_model under ZeRO stage 3 gathers the whole model onto rank 0; set "
                               "zero_optimization.stage3_gather_16bit_weights_on_model_save to true (DeepSpeed saves "
                               "nothing without it), or save a checkpoint and run `tiers convert` on it")
        state = self.full_state_dict(rank0_only=True)
        if state is None:
            return None
        chunked = {key for key, t in self.module.state_dict(keep_vars=True).items()
                   if id(t) in self.chunked.chunk_index()}
        dtype = self.precision.compute_dtype
        state = {k: v.to(dtype) if k in chunked else v for k, v in state.items()}
        return write_state_dict(save_dir, save_filename, state)

    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Parameters (default all) readable inside the block; with `modifier_rank`, that rank may modify
        them and its values reach every rank on exit (DeepSpeed's GatheredParameters); without it,
        changes made inside are not kept under stage 3. Every rank must enter with the same parameters.
        Stages 0-2 keep parameters whole, so entering gathers nothing."""
        params = list(self.module.parameters()) if params is None else list(params)
        return whole_weights.gathered_parameters(params, self.chunked, self.gatherer, self.dp_group, self.comm,
                                                 modifier_rank, self.topology.is_distributed)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: parameter chunks, gradient chunks (and stage-2 shards),
        optimizer state tensors."""
        chunked = self.chunked
        params = sum(p.untyped_storage().nbytes() for p in chunked.param_payloads())
        if chunked.sharded_params is not None:
            params += chunked.sharded_params.shard_bytes()
        grads = sum(g.untyped_storage().nbytes() for g in chunked.grad_payloads())
        if chunked.sharded_grads is not None:
            grads += sum(s.untyped_storage().nbytes() for s in chunked.sharded_grads.shards)
        optim = sum(v.untyped_storage().nbytes() for state in self.optimizer.state.values() for v in state.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        if chunked.masters is not None:
            optim += chunked.masters.nbytes()
        return {"param": params, "grad": grads, "optim": optim}

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

    def _log_step(self) -> None:
        now = time.perf_counter()
        step_s = now - (self._step_start or now)
        self._step_start = None
        comm, self._comm_at_last_step = self._comm_at_last_step, dataclasses.replace(self.comm)
        losses, self._losses = self._losses, []
        tokens, self._tokens = self._tokens, 0
        phases, self._phase_s = self._phase_s, dict.fromkeys(self._phase_s, 0.0)
        recompute_s, self._recompute_s_at_last_step = (self.activation_checkpointing.recompute_seconds
                                                       - self._recompute_s_at_last_step,
                                                       self.activation_checkpointing.recompute_seconds)
        offload = self._offload_metrics()
        if not self.monitor.wants(self.global_step):
            return  # reading the loss would synchronize the device for nothing
        metrics = {
            "Train/loss": float(torch.stack(losses).float().mean()) if losses else float("nan"),
            "Train/lr": self.get_lr()[0],
            "Train/loss_scale": self.loss_scaler.scale,
            "Train/skipped_steps": float(self.skipped_steps),
            "Time/step_ms": step_s * 1000.0,
            "Comm/bytes_per_step": float(self.comm.total_bytes - comm.total_bytes),
            **{f"Comm/{kind}_bytes_per_step": float(getattr(self.comm, f"{kind}_bytes") - getattr(comm, f"{kind}_bytes"))
               for kind in ("all_reduce", "reduce_scatter", "all_gather")},
            **{f"Memory/chunk_bytes/{kind}": float(n) for kind, n in self.model_state_bytes().items()},
            **self.monitor.memory_metrics(),
            **offload,
        }
        if self._global_grad_norm is not None:
            metrics["Train/grad_norm"] = self._global_grad_norm
        if self.config.activation_checkpointing.profile:
            metrics["Time/recompute_ms"] = recompute_s * 1000.0
        if self.config.wall_clock_breakdown:
            metrics.update({f"Time/{phase}_ms": s * 1000.0 for phase, s in phases.items()})
        if step_s > 0:
            metrics["Throughput/samples_per_sec"] = self.train_batch_size / step_s
            if tokens:
                metrics["Throughput/tokens_per_sec"] = tokens * self.dp_world_size / step_s
        self.monitor.log_step(self.global_step, metrics)

    def _offload_metrics(self) -> dict[str, float]:
        """The chunk manager's per-tier bytes and counters (Offload/...), and the bytes it moved between
        tiers during this step (Offload/moved_bytes_per_step/<from>-><to>)."""
        manager = getattr(self.optimizer, "manager", None)
        if manager is None:
            return {}
        stats = manager.stats
        moved = dict(stats.moved_bytes)
        previous, self._moved_at_last_step = self._moved_at_last_step, moved
        return {**stats.as_scalars("Offload/"),
                **{f"Offload/moved_bytes_per_step/{k}": float(v - previous.get(k, 0)) for k, v in moved.items()}}

    def close(self) -> None:
        """Waits for a background save, flushes the monitor, removes the engine's hooks and closes an offloaded
        optimizer's chunk manager."""
        self._saver.wait()  # a background save commits (or raises) before anything closes
        self.monitor.close()
        if hasattr(self.optimizer, "close"):
            self.optimizer.close()
        if self.reducer is not None:
            self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to_device(value, device: torch.device):
    """Tensors in (nested tuples, lists, dicts of) forward arguments, moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True) if value.device != device else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _count_token_ids(args: tuple, kwargs: dict) -> int:
    """Tokens in this micro-batch when the model takes integer token ids (first int tensor found)."""
    for value in (*args, *kwargs.values(), *(args[0].values() if args and isinstance(args[0], dict) else ())):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() >= 1 and value.dtype != torch.bool:
            return value.numel()
    return 0
