"""The data-parallel side of one training step, as phases around the user's forward, backward and update.

Note [step phases]
One training step, as the engine runs it:
  pre_forward    stage 3: the forward pass begins (modules gather their chunks as they run)
  post_forward   stage 3: every chunk still gathered is released
  pre_backward   the reducer is armed when this backward reduces (Note [micro-steps and boundaries]);
                 with step_in_backward, each reduced shard is stepped at once (Note [stepping in backward])
  post_backward  stage 3 releases; the launched reductions are waited for (gradients are reduced when
                 backward returns, as with DDP)
  pre_step       what no backward reduced is reduced; gradient shards settle; fp16/bf16 gradients are
                 staged into fp32 masters; unscale, global norm, clip (Note [global norm, unscaling and clipping])
  update         the optimizer steps its chunks (or shards); masters are rounded into the model's chunks;
                 sharded updates are all-gathered
  post_step      fp32 master gradients are dropped; the gradient chunks are zeroed
Each phase runs inside a `torch.profiler.record_function("tiers.zero.<phase>")` range. `TrainingPhase`
says which of forward, backward and the update is running; entering one while another runs raises (an
engine call from inside a forward hook, say). Values flow through arguments and results: pre_backward
returns whether this backward reduces, pre_step returns the gradient stats the update and the
monitor use.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from engine.comm import CommCounter, all_gather_in_place, broadcast_from
from engine.mesh import Mesh
from engine.optimizers.compressed import CompressedOptimizer
from engine.zero.chunk_norms import square_sum_of_norms
from engine.zero.chunked_params import ChunkedParams
from engine.zero.device_bytes import device_state_bytes
from engine.zero.fused_tiles import MastersFromSources
from engine.zero.grad_clip import GradientClipper, GradStats
from engine.zero.grad_sync import GradReducer
from engine.zero.gradient_factor import factored_norms, scaled_by
from engine.zero.hooks import ZeroHooks
from engine.zero.param_gather import ParamGatherer
from engine.zero.training_phase import LEGAL_MOVES, TrainingPhase

_RELEASED_PARAMETER_HINT = (
    "a parameter was used while its ZeRO stage 3 chunk was released: stage 3 gathers a module's parameters "
    "around that module's own forward and backward, so a parameter read outside its module (e.g. "
    "`other.weight` used in a parent's forward) or after the pass is not there; call the owning module "
    "instead, wrap the read in engine.gathered_parameters([...]), or raise "
    "zero_optimization.stage3_param_persistence_threshold above its size so that it stays gathered")


class GradientsHeld(enum.Enum):
    """What the gradient chunks hold between backward passes (stages 0 and 1; Note [micro-steps and boundaries])."""

    LOCAL = "local"  # each rank's own: the update reduces them
    REDUCED = "reduced"  # a synchronized backward reduced them
    PARTLY_REDUCED = "partly reduced"  # a synchronized backward failed after some of its chunks were reduced


@dataclass(frozen=True)
class StepParts:
    """What a step's communication runs through: the parameter gatherer, the gradient reducer (None: one rank with
    nothing to reduce), the gradient clipper, and the hooks the gatherer and reducer installed."""

    gatherer: ParamGatherer
    reducer: GradReducer | None
    clipper: GradientClipper
    hooks: ZeroHooks


class ZeroRuntime:
    """Runs the phases of Note [step phases] over the chunks: gathering (stage 3), reduction, the update."""

    def __init__(self, chunked: ChunkedParams, optimizer: torch.optim.Optimizer, mesh: Mesh,
                 comm: CommCounter, parts: StepParts, steps_in_backward: bool = False):
        self.chunked, self.optimizer, self.mesh, self.comm = chunked, optimizer, mesh, comm
        self.clipper, self.gatherer, self.reducer = parts.clipper, parts.gatherer, parts.reducer
        self.hooks = parts.hooks  # every hook the gatherer and reducer installed
        self.steps_in_backward = steps_in_backward  # Note [stepping in backward]
        self.phase = TrainingPhase.IDLE
        self.inside_no_sync = False
        self.accumulating_locally = False  # Note [a pipelined step]: no backward reduces; the update reduces all
        self.gradients = GradientsHeld.LOCAL
        self._early_square: torch.Tensor | None = None  # norm pieces of shards stepped in backward

    def start(self, module: nn.Module) -> None:
        """Every rank starts from rank 0's parameters (trainable and frozen) and buffers, as DDP does; then,
        stage 3, each rank keeps its shards only, and bf16/fp16 masters take the starting weights."""
        chunked = self.chunked
        distributed = self.mesh.zero.size > 1
        with torch.no_grad():
            # zero_init gave every rank rank 0's values, shard by shard (Note [zero_init])
            for state in chunked.all_states if not chunked.values_pending else []:  # frozen chunks too
                filled = chunked.fill_from_sources(state.index)  # stage 3: one chunk at a time (Note [a bounded start])
                if distributed:  # experts: over their group
                    broadcast_from(state.param_chunk.payload, 0, state.place.group_or(self.mesh.zero.group),
                                   self.comm)
                if filled:
                    self.sample_device_bytes()  # the moment of a bounded start's peak: one full chunk is live
                    chunked.sharded_params.take_shard(state.index)  # from here on this rank holds its shard only
            chunked.sharded_params.settle_frozen()  # Note [frozen chunks]: never written again
            if distributed:
                in_chunks = set(chunked.param_chunk_index())
                for t in [p for p in module.parameters() if id(p) not in in_chunks] + list(module.buffers()):
                    broadcast_from(t.data, 0, self.mesh.zero.group, self.comm)
        if chunked.has_masters and not chunked.values_pending:
            chunked.masters.sync_from_params()  # the starting weights are rank 0's (Note [master weights])
        self.sample_device_bytes()

    def sample_device_bytes(self) -> None:
        """Records the model state on the device now in the device memory's sampled peak (Note [separate device
        memory]), when an offloaded optimizer's chunk manager knows that memory."""
        manager = getattr(self.optimizer, "manager", None)
        if manager is not None and manager.memory.separate:  # where the device is the host, nothing to tell apart
            manager.memory.sample(sum(device_state_bytes(self.chunked, self.optimizer).values()))

    def _enter(self, phase: TrainingPhase) -> None:
        if phase not in LEGAL_MOVES[self.phase]:
            raise RuntimeError(f"engine: {phase.value} cannot start while the {self.phase.value} is running; "
                               "call the engine's forward, backward and step one after another, not from hooks "
                               "inside one another")
        self.phase = phase

    # ---- forward ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self, trace_key=None):
        """trace_key: a pipeline action's (stage, kind), whose stage-3 gathers follow a record of their own."""
        self._enter(TrainingPhase.FORWARD)
        try:
            self.pre_forward(trace_key)
            with self._released_parameter_hint():
                yield
        finally:
            try:
                self.post_forward()
            finally:
                self.phase = TrainingPhase.IDLE

    def pre_forward(self, trace_key=None) -> None:
        with record_function("tiers.zero.pre_forward"):
            self.gatherer.begin(TrainingPhase.FORWARD, trace_key)  # stages 0-2: no chunk to gather

    def post_forward(self) -> None:
        with record_function("tiers.zero.post_forward"):
            self.gatherer.end()

    @contextlib.contextmanager
    def _released_parameter_hint(self):
        try:
            yield
        except RuntimeError as e:
            released = "for storage of size 0" in str(e) or "data is not allocated" in str(e)
            if self.chunked.gathers_params and released:
                raise RuntimeError(_RELEASED_PARAMETER_HINT) from e
            raise

    # ---- backward -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip the gradient all-reduce (gradients accumulate locally)."""
        if self.chunked.shards_grads:
            raise RuntimeError("no_sync() is not possible with ZeRO stage 2: gradients are sharded, so every backward "
                               "reduce-scatters them (Note [sharded gradients]); use stage 0 or 1 for local "
                               "accumulation, or simply call backward without it")
        previous, self.inside_no_sync = self.inside_no_sync, True
        try:
            yield
        finally:
            self.inside_no_sync = previous

    @contextlib.contextmanager
    def accumulate_locally(self):
        """Backward passes inside reduce nothing, under every ZeRO stage: gradients accumulate in this rank's full
        gradient chunks (stage 2 and 3 keep them live until the update), and the update reduces them all once
        (Note [a pipelined step])."""
        previous, self.accumulating_locally = self.accumulating_locally, True
        try:
            yield
        finally:
            self.accumulating_locally = previous

    @contextlib.contextmanager
    def backward(self, boundary: bool, loss_scale: float, trace_key=None):
        """Around autograd's backward of one micro-batch; `boundary`: it ends the accumulation. Whether it reduces
        is decided (and a second synchronized backward prepared for) before anything is armed."""
        reduces = self.begin_backward(boundary, loss_scale, trace_key)
        try:
            with self._released_parameter_hint():
                yield
        except BaseException as e:
            self.abandon_backward(reduces, e)
            raise
        self.end_backward(reduces)

    def begin_backward(self, boundary: bool, loss_scale: float, trace_key=None) -> bool:
        """Enters the backward phase (engine.backward, or a PyTorch-style one: Note [tensor backward]); returns
        whether this backward reduces, for end_backward / abandon_backward."""
        self.chunked.check_trainability()  # Note [frozen chunks]: before anything is reduced or stepped
        every_backward = self.chunked.shards_grads  # Note [sharded gradients]
        reduces = self._engine_reduces() and not self.accumulating_locally and (
            every_backward or (boundary and not self.inside_no_sync))
        if reduces:
            self._check_one_synchronized_backward(every_backward)
        elif self.synchronized and not every_backward:  # a local backward onto reduced sums: the update sums once
            self.reducer.keep_reduced_once()
            self.gradients = GradientsHeld.LOCAL
        self._enter(TrainingPhase.BACKWARD)
        try:  # pre_backward: the reducer is armed when this backward reduces (Note [micro-steps and boundaries])
            with record_function("tiers.zero.pre_backward"):
                if reduces:
                    self.reducer.arm(self._shard_stepper(loss_scale) if self.steps_in_backward and boundary else None,
                                     self._norm_measure(boundary))
                self.gatherer.begin(TrainingPhase.BACKWARD, trace_key)
        except BaseException as e:
            self.abandon_backward(reduces, e)
            raise
        return reduces

    def _norm_measure(self, boundary: bool):
        """Note [the norm where the gradient is reduced]: what measures a managed shard's norms as it goes down, in
        a boundary backward whose update needs them; None otherwise."""
        if boundary and self.chunked.grads_managed and self.clipper.needs_norm and not self.steps_in_backward:
            return self.chunked.measure_before_retire
        return None

    def end_backward(self, reduces: bool) -> None:
        """post_backward: stage 3 releases, and the launched reductions are waited for."""
        try:
            with record_function("tiers.zero.post_backward"):
                self.gatherer.end()
                if reduces:
                    self.reducer.complete_backward()
                    self.gradients = GradientsHeld.REDUCED
        except BaseException as e:
            self.abandon_backward(reduces, e)
            raise
        self.phase = TrainingPhase.IDLE

    def _check_one_synchronized_backward(self, every_backward: bool) -> None:
        if self.synchronized and not every_backward:  # Note [several synchronized backward passes]
            self.reducer.keep_reduced_once()
            self.gradients = GradientsHeld.LOCAL
        if self.steps_in_backward and self.optimizer.stepped_early:
            raise RuntimeError(
                "engine.backward() after the accumulation boundary's backward: with "
                "offload_optimizer.step_in_backward that backward already updated the model; call engine.step() "
                "after it (once per micro-batch), or add the losses and call backward once")

    def _shard_stepper(self, loss_scale: float):
        """Note [stepping in backward]: each reduced shard of the coming backward is final; step it at once."""
        unscale = 1.0 / loss_scale  # no clipping (refused by check_run)
        self._early_square = torch.zeros((), dtype=torch.float64) if self.clipper.needs_norm else None
        managed = self.chunked.sharded_grads.managed

        def step_reduced_shard(index: int) -> None:
            if self._early_square is not None:
                self._early_square += square_sum_of_norms(*self.chunked.grad_norms(index, unscale))
            self.optimizer.step_early(managed[index], unscale)

        return step_reduced_shard

    def abandon_backward(self, reduces: bool, error: BaseException | None) -> None:
        """After a failed backward: idle, nothing stays gathered, nothing more is reduced or stepped (even when
        releasing fails too)."""
        self.phase = TrainingPhase.IDLE
        try:
            if self.gatherer.phase is not TrainingPhase.IDLE:
                self.gatherer.end()
        finally:
            if reduces:
                if self.reducer.launched_since_armed():  # some chunks hold sums, the others this rank's own
                    self.gradients = GradientsHeld.PARTLY_REDUCED
                self.reducer.disarm()  # also drops the step callback: nothing more is stepped
        if reduces and self.steps_in_backward and self.optimizer.stepped_early:
            raise RuntimeError(
                f"backward failed after offload_optimizer.step_in_backward had updated {self.optimizer.stepped_early} "
                "parameter shard(s) with their final gradients: the model is partly updated and cannot be rolled "
                "back; restore it from a checkpoint (build the engine again from saved weights)") from error

    def zero_grads(self) -> None:
        """Zeroes the accumulated gradients: a synchronized backward after this reduces its own only."""
        self.chunked.zero_grads()
        self.gradients = GradientsHeld.LOCAL

    @property
    def synchronized(self) -> bool:
        """A synchronized backward reduced the gradients since the last update."""
        return self.gradients is GradientsHeld.REDUCED

    def _engine_reduces(self) -> bool:
        """Whether gradients are reduced here: not for the steps an optimizer averages over the ranks itself
        (Note [optimizers that communicate])."""
        return self.reduces_grads and not (isinstance(self.optimizer, CompressedOptimizer)
                                           and not self.optimizer.engine_reduces_gradients)

    @property
    def reduces_grads(self) -> bool:
        """Gradients are reduced over several ranks or retired into shards (Note [stage predicates]); one process
        with whole gradient chunks has nothing to reduce, and no reducer."""
        return self.reducer is not None

    # ---- the update ---------------------------------------------------------------------------
    def check_steppable(self) -> None:
        """Before engine.step() counts a micro-step: it may run now."""
        if self.phase is not TrainingPhase.IDLE:
            self._enter(TrainingPhase.STEP)  # raises, naming the phase that runs
        if self.inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync() would update from unreduced gradients; "
                               "leave the no_sync() block and run one synchronized backward first")
        if self.gradients is GradientsHeld.PARTLY_REDUCED:
            raise RuntimeError("engine.step() after a backward that failed once some of its gradients were reduced "
                               "would count those twice; call engine.zero_grad() to drop this step's gradients, "
                               "then go on with the next batch")

    @contextlib.contextmanager
    def step(self, loss_scale: float):
        """Around the update at an accumulation boundary: pre_step, then (yielding its GradStats) the caller's
        update, then post_step. A failure leaves the engine idle (not rolled back: the gradients may be reduced,
        unscaled and clipped, the model partly updated)."""
        self._enter(TrainingPhase.STEP)
        try:
            stats = self.pre_step(loss_scale)
            yield stats
            self.post_step()
        finally:
            self.phase = TrainingPhase.IDLE

    @property
    def masters_from_sources(self) -> bool:
        """Note [the host step in tiles]: the optimizer steps the fp32 masters from their 16-bit gradients."""
        return isinstance(self.optimizer, MastersFromSources)

    def pre_step(self, loss_scale: float) -> GradStats:
        """Every gradient reduced, in fp32 where the optimizer reads it, unscaled and clipped."""
        with record_function("tiers.zero.pre_step"):
            chunked = self.chunked
            unreduced = not chunked.shards_grads or self.reduces_grads and self.reducer.holds_unreduced()
            if self._engine_reduces() and not self.synchronized and unreduced:
                self.reducer.reduce_all()  # the boundary backward ran inside no_sync() or accumulate_locally()
            self.gradients = GradientsHeld.LOCAL
            chunked.sharded_grads.settle()  # shards no backward wrote (Note [sharded gradients]); stages 0-1: none
            chunked.sync_views()
            if chunked.has_masters and not chunked.grads_managed and not self.masters_from_sources:
                chunked.masters.stage_grads()  # Note [master weights] (managed or tiled 16-bit ones: as stepped)
            staged_factor = 1.0
            if self.reduces_grads and not self._engine_reduces():  # Note [optimizers that communicate]
                staged_factor = float(self.mesh.zero.size)
                torch._foreach_mul_(chunked.grad_shards(), staged_factor)
            stepped_early = chunked.grads_managed and self.optimizer.stepped_early  # Note [stepping in backward]
            # where the optimizer applies the factors as it steps, what measures the norms (GradientClipper.prepare)
            factored = chunked.master_grad_norms if self.masters_from_sources \
                else factored_norms(self.optimizer, chunked, staged_factor)  # Note [one gradient factor]
            return self.clipper.prepare(loss_scale, self._early_square if stepped_early else None, staged_factor,
                                        factored)

    def update(self, grads: GradStats) -> None:
        """The optimizer steps; the model's chunks take the new values on every rank."""
        with record_function("tiers.zero.update"):
            self.chunked.rebind_optimizer_grads()
            if self.chunked.grads_managed:  # Note [offloaded gradient shards]: unscaled and clipped as stepped
                self.optimizer.step(grad_scale=grads.streamed_scale)
            elif self.masters_from_sources:  # Note [the host step in tiles]: unscaled, clipped and rounded as stepped
                self.optimizer.factors = grads.streamed_scale
                self.optimizer.step()
            else:
                with scaled_by(self.optimizer, grads.streamed_scale):  # Note [one gradient factor]; () for none
                    self.optimizer.step()
            if self.chunked.has_masters and not self.chunked.masters.offloaded and not self.masters_from_sources:
                self.chunked.masters.update_params()  # (offloaded ones are rounded as stepped)
            self.gather_updated_params()

    def gather_updated_params(self) -> None:
        """Sharded optimizer states: each rank updated its shard of every param chunk; all-gather them."""
        chunked = self.chunked
        if not chunked.sharded:
            return
        works = [all_gather_in_place(state.param_chunk.payload, state.place.group_or(self.mesh.shard.group),
                                     state.place.rank, state.place.count, self.comm, async_op=True)
                 for state in chunked.states_gathered_after_step()]
        for work in works:
            work.wait()

    def post_step(self) -> None:
        with record_function("tiers.zero.post_step"):
            if self.chunked.has_masters:
                self.chunked.masters.drop_grads()
            self.chunked.zero_grads()

    def close(self) -> None:
        """Removes the hooks the gatherer and the reducer installed on the model (Note [zero hooks])."""
        self.hooks.remove()
