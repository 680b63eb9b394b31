"""engine.train_batch under `zero_optimization.offload_param.layer_major`: a step's micro-batches block by block.

Note [layer-major accumulation]
Under ZeRO-3 with offloaded parameters, accumulating one micro-batch at a time gathers (reads) every parameter
chunk twice per micro-batch, in its forward and its backward: 2m reads per step at m micro-batches.
train_batch has every micro-batch up front, so with `offload_param.layer_major: true` it runs them block by
block instead, and reads each chunk twice per step:
- the model is cut as a pipeline cuts it (Note [pipeline stages of an unmodified model]), one stage per block
  of its block list, every stage on this rank. Stage s runs micro-batches 0 … m-1 before stage s + 1 starts,
  each taking the previous stage's output itself (not a detached copy), so each micro-batch's autograd graph
  is the one the whole model's forward makes.
- the forward sweep is one gather pass (Note [gathering around modules]) in which each chunk is held
  (ParamGatherer.hold) from the first stage using it to the last: the m forwards of a block find it gathered.
  A chunk two distant stages use (tied input and output embeddings) stays gathered in between.
- backward is one autograd call over the m losses, each scaled as engine.backward scales it. Autograd runs
  the ready node with the highest sequence number first, and every node of stage s was made after every node
  of stage s - 1, so backward runs block by block too, the last block first. A parameter used by m
  micro-batches gets one gradient, their sum in autograd's input buffer, so the reducer sees each chunk's
  gradients complete once per step and reduces (or pages out) them once, and the gatherer releases the chunk
  then: one read in backward. The gradients are the per-micro-batch run's, summed in another order (fp32:
  equal at 1e-5, not bit for bit). A leaf module's chunks (Note [gathering around modules]) may be released
  after one micro-batch's backward through the leaf and gathered again for the next: read up to m + 1 times.
- before the first sweep, one micro-batch's loss is computed through the whole model and block by block (eval
  mode, no gradients, the random generators restored after); a model whose blocks take more than the hidden
  state from the previous block (T5's position bias), or whose forward runs code between its blocks, gives
  another value and is refused, instead of training another model. It costs two forwards of one micro-batch once.
- the model refuses to run with gradients outside train_batch (a forward pre-hook on it, which the views share):
  a backward over such a forward would reach the gradient chunks unscaled, outside the runtime's phases, and be
  added to the next step's. Forwards under torch.no_grad() run as usual.
- what it trades: autograd keeps the activations of all m micro-batches at once (m × one micro-batch's; with
  activation checkpointing, m × the blocks' inputs), where the per-micro-batch run keeps one micro-batch's.
  The model's forward code outside its blocks (embedding lookup, masks, positions) runs once per block per
  micro-batch, on zeros where it is not the stage's to run (Note [pipeline stages of an unmodified model]);
  only the blocks' own forwards carry the work. With dropout, the micro-batches draw their masks from the
  generator in another order than the per-micro-batch run: the same distribution, other masks.
The loss train_batch returns is the mean of the micro-batches' losses, averaged over the data-parallel ranks.
Refused where micro-batches arrive one at a time (the engine's forward with gradients, backward and step; HF
Trainer and Lightning make those calls), and not built yet with tensor, sequence, expert or pipeline parallelism.
With offload_optimizer.step_in_backward each chunk's shard is stepped in that one backward (Note [stepping in
backward]).
"""

from __future__ import annotations

import torch

from engine.comm import all_reduce_sum
from engine.features import DriverContext
from engine.pipeline.driver import loss_of, microbatch_arguments
from engine.pipeline.model_split import PipelineModel
from engine.pipeline.stage_modules import run_stage_view

LAYER_MAJOR = "zero_optimization.offload_param.layer_major"  # the setting, named in errors
CUT_RTOL = 1e-5  # the same operators on the same values: equal but for a kernel's nondeterminism
REFUSED_FORWARD = ("under zero_optimization.offload_param.layer_major the model trains only inside "
                   "engine.train_batch(data_iter), which runs a step's micro-batches block by block; run other "
                   "forwards under torch.no_grad() (evaluation), or remove layer_major to train micro-batch by "
                   "micro-batch")


class LayerMajorDriver:
    """Runs a step's micro-batches through the one-stage-per-block split of the model (Note [layer-major
    accumulation]), inside the runtime's forward and backward phases."""

    def __init__(self, split: PipelineModel, context: DriverContext):
        self.split, self.runtime, self.precision, self.mesh = split, context.runtime, context.precision, context.mesh
        self.features, self.comm, self.loss_fn = context.features, context.comm, context.loss_fn
        runtime, stages = context.runtime, split.plan.stages
        used = [runtime.gatherer.chunks_of(split.views[s].modules()) for s in range(stages)]
        first, last = {}, {}
        for s, chunks in enumerate(used):
            for c in chunks:
                first.setdefault(c, s)
                last[c] = s
        # Note [layer-major accumulation]: the chunks held from the start of their first stage to the end of their last
        self.holds_from = [sorted(c for c in used[s] if first[c] == s) for s in range(stages)]
        self.holds_until = [sorted(c for c in used[s] if last[c] == s) for s in range(stages)]
        self._cut_checked = False
        self._sweeping = False
        # a backward over a forward run outside train_batch would reach the gradient chunks unscaled and outside the
        # runtime's phases: the model refuses to run with gradients anywhere else (its views share this hook)
        self._guard = split.holder.register_forward_pre_hook(self._refuse_outside_sweep)

    def _refuse_outside_sweep(self, module, args) -> None:
        if torch.is_grad_enabled() and not self._sweeping:
            raise RuntimeError(REFUSED_FORWARD)

    def close(self) -> None:
        self._guard.remove()

    # ---- one step ------------------------------------------------------------------------------
    def train(self, microbatches: list, loss_scale: float) -> float:
        """Forward and backward of `microbatches` block by block, leaving their gradients accumulated (reduced as a
        boundary backward reduces them); returns the step's mean loss on every rank."""
        self._check_the_cut(microbatches[0])
        self._set_mode(True)
        losses, aux = self._forward_sweep(microbatches)
        factor = loss_scale * self.features.loss_weight() / (len(microbatches) * self.mesh.zero.size)
        totals = [loss if extra is None else loss + extra.to(loss.device) for loss, extra in zip(losses, aux)]
        scaled = [t.float() * factor if factor != 1.0 else t for t in totals]
        with self.runtime.backward(True, loss_scale):
            torch.autograd.backward(scaled)
        return self._step_loss(losses)

    def evaluate(self, microbatches: list) -> float:
        """The forwards only, block by block, in eval mode without gradients; returns the mean loss on every rank."""
        self._check_the_cut(microbatches[0])
        was_training = self.split.holder.training
        self._set_mode(False)
        try:
            with torch.no_grad():
                losses, _ = self._forward_sweep(microbatches)
        finally:
            self._set_mode(was_training)
        return self._step_loss(losses)

    def _check_the_cut(self, microbatch) -> None:
        """Once, before the first sweep: a micro-batch's loss through the whole model and block by block, in eval
        mode without gradients (and without using up random numbers), must agree; a model that hands its next block
        more than the hidden state, or runs code between its blocks, does not, and is refused by name."""
        if self._cut_checked:
            return
        was_training = self.split.holder.training
        self._set_mode(False)
        devices = [self.mesh.device] if self.mesh.device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                whole = self._whole_loss(microbatch)
                (cut,), _ = self._forward_sweep([microbatch])
        finally:
            self._set_mode(was_training)
        whole, cut = whole.double().item(), cut.double().item()
        if not abs(cut - whole) <= CUT_RTOL * abs(whole):
            name = type(self.split.holder).__name__
            raise RuntimeError(f"layer_major: {name}'s loss run block by block is {cut:.6g}, through the whole model "
                               f"{whole:.6g}: its forward hands its blocks more than the hidden state (a value one "
                               "block passes to the next), or runs code between them, which a block-by-block run "
                               "skips; remove zero_optimization.offload_param.layer_major")
        self._cut_checked = True

    def _arguments(self, microbatch) -> tuple[tuple, dict]:
        """The model's forward arguments from a micro-batch, as the engine's forward prepares them."""
        args, kwargs = microbatch_arguments(microbatch, with_loss_fn=self.loss_fn is not None)
        return self.features.split_inputs(self.precision.forward_args(args), kwargs)

    def _whole_loss(self, microbatch) -> torch.Tensor:
        args, kwargs = self._arguments(microbatch)
        with self.runtime.forward(), self.precision.autocast(self.mesh.device), self.features.around_forward():
            out = self.split.holder(*args, **kwargs)
        self.features.take_aux_loss()
        return self.features.scheduled_loss(loss_of(out, microbatch, self.loss_fn))

    def _forward_sweep(self, microbatches: list) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Every stage over every micro-batch, stage by stage; each micro-batch's loss and router losses."""
        gatherer, last = self.runtime.gatherer, self.split.plan.stages - 1
        hidden: list = [None] * len(microbatches)
        aux: list[torch.Tensor | None] = [None] * len(microbatches)
        held: set[int] = set()
        self._sweeping = True
        with self.runtime.forward(), self.precision.autocast(self.mesh.device):
            try:
                for stage in range(last + 1):
                    for c in self.holds_from[stage]:
                        gatherer.hold(c)
                        held.add(c)
                    for j, microbatch in enumerate(microbatches):
                        hidden[j] = self._run_stage(stage, hidden[j], microbatch, stage == last)
                        extra = self.features.take_aux_loss()  # router losses of this stage's MoE layers
                        if extra is not None:
                            aux[j] = extra if aux[j] is None else aux[j] + extra
                    for c in self.holds_until[stage]:
                        gatherer.let_go(c)
                        held.discard(c)
            except BaseException:
                self.features.take_aux_loss()  # what the failed stage's MoE layers added belongs to no step
                raise
            finally:  # a forward that failed lets go of what it held: the pass end releases it
                self._sweeping = False
                for c in held:
                    gatherer.let_go(c)
        return hidden, aux

    def _run_stage(self, stage: int, received: torch.Tensor | None, microbatch, last: bool) -> torch.Tensor:
        """Stage `stage`'s forward on one micro-batch: its hidden state out, or on the last stage its loss."""
        args, kwargs = self._arguments(microbatch)
        out, ran_to_end = run_stage_view(self.split.views[stage], self.split.state, received, args, kwargs,
                                         self.features.around_forward)
        if not ran_to_end:
            return out
        if not last:
            raise RuntimeError(f"layer_major: the model's forward returned without running block {stage} of its block "
                               f"list {self.split.plan.list_name}, so it cannot run block by block; remove "
                               "zero_optimization.offload_param.layer_major")
        return self.features.scheduled_loss(loss_of(out, microbatch, self.loss_fn))

    def _set_mode(self, training: bool) -> None:
        self.split.holder.train(training)
        for view in self.split.views.values():  # the copies on the path to the blocks keep a flag of their own
            view.train(training)

    def _step_loss(self, losses: list[torch.Tensor]) -> float:
        """The mean micro-batch loss, averaged over the data-parallel ranks."""
        t = torch.stack([loss.detach().double() for loss in losses]).mean().reshape(1).to(self.mesh.device)
        if self.mesh.zero.size > 1:
            all_reduce_sum(t, self.mesh.zero.group, self.comm, async_op=False)
        return t.item() / self.mesh.zero.size
