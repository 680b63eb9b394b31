"""ZeRO stage 3: gathers parameter chunks around each module's forward and backward, ahead in traced order.

Note [gathering around modules]
Every module that directly owns parameters in non-persistent chunks gets hooks:
- before its forward, its chunks are demanded: gathered (a collective) and waited for;
- after its forward, a gradient hook on its outputs demands them again when backward reaches the
  module (autograd computes the outputs' gradient just before the module's own backward);
- after its forward, outside backward, each of its chunks whose owner modules have all finished a
  forward in this pass is released.
In backward a chunk is released as soon as all its parameters' gradients have been accumulated
(the GradReducer reports it), a frozen chunk, which gets no gradients, once every call that runs a
backward over it has computed its inputs' gradients (counted per call, so a module applied twice waits
for both; Note [frozen chunks]), and whatever is still gathered when a pass ends is released then. A
frozen chunk waits for the pass end instead where the inputs' gradients do not prove its weight is done
with: a module owning it also trains a parameter of its own (`W * s`), an input is a leaf (a pipeline
stage's input), a pipeline's passes (the split weight pass gathers nothing again), a leaf module's chunk.
During backward a module's forward runs again only to recompute activations (checkpointing): its
chunks are then gathered on demand and left to the backward release.
Ahead of demand, the chunks the trace says come next (Note [gather trace]) are gathered
asynchronously, up to `prefetch_numel` elements gathered ahead and `max_live_numel` elements
gathered in all, so the all-gathers overlap compute.
Every stage has a gatherer, over every chunk: under stages 0-2 (the degenerate layout, Note [stage predicates])
every chunk is WHOLE, so it hooks no module and its passes touch no chunk.
A chunk's owner modules, those done in this pass and the gathered() blocks holding it are kept in its
ChunkState, with its phase (Note [chunk phases]).
Collectives must match across ranks: every rank must run the same modules in the same order (as
with DeepSpeed and FSDP). Control flow that differs between steps is fine; between ranks it hangs.
A leaf module (marked `_z3_leaf`, as DeepSpeed's set_z3_leaf_modules marks it) is how a model whose
inner control flow differs between ranks (an MoE block routing each rank's tokens to other experts)
keeps them matched: the leaf gets the hooks above for every chunk holding a parameter anywhere in its
subtree (chunks are shared across module boundaries, Note [chunk packing]), and its descendants get
none. Inside it nothing is gathered or released, so every rank issues the same collectives whatever
runs inside. Its chunks are not released when their gradients are all in (an expert one rank did not
run never has them, so that release would differ between ranks and with it the prefetch budget);
those no other module owns are released when backward has computed the leaf's inputs' gradients, the
rest when the pass ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import CommCounter
from engine.zero.chunk_state import ChunkPhase
from engine.zero.gather_trace import GatherTrace
from engine.zero.hooks import ZeroHooks
from engine.zero.param_shards import ShardedParams
from engine.zero.training_phase import TrainingPhase


class ParamGatherer:
    def __init__(self, model: nn.Module, shards: ShardedParams, chunk_of: dict[int, int],
                 group: dist.ProcessGroup | None, counter: CommCounter, prefetch_numel: int, max_live_numel: int,
                 hooks: ZeroHooks):
        self.shards = shards
        self.hooks = hooks  # Note [zero hooks]
        self.states = shards.states  # Note [chunk phases]: owners, done and held live there
        self.group, self.counter = group, counter
        self.prefetch_numel, self.max_live_numel = prefetch_numel, max_live_numel
        self.phase = TrainingPhase.IDLE
        # one record per pass kind; under a pipeline, per pass kind and schedule action (Note [a pipelined step])
        self.traces: dict = {TrainingPhase.FORWARD: GatherTrace(), TrainingPhase.BACKWARD: GatherTrace()}
        self._trace = None  # the running pass's
        self.prefetched = 0  # gathers started ahead of demand, over the run
        self._ahead: set[int] = set()  # gathered ahead of demand, not demanded yet
        self._module_chunks: dict[nn.Module, tuple[int, ...]] = {}
        self._leaves: set[nn.Module] = set()
        self._leaf_chunks: set[int] = set()  # released by their leaf's backward or the pass end only
        # Note [frozen chunks]: a frozen chunk gets no gradients, so backward may release it once every call that will
        # run a backward over it has done so (its inputs' gradients are computed): counted per chunk, one per call
        self._frozen_chunks: dict[nn.Module, tuple[int, ...]] = {}
        self._calls_awaiting: dict[int, int] = {}  # frozen chunk -> calls whose backward is to come
        self._kept_to_pass_end: set[int] = set()  # frozen chunks a call of this backward cannot release early
        self._early_frozen_release = True  # off for a pipeline's passes (one per action, split weight pass)
        for module, recurse in _hooked_modules(model):
            chunks = sorted({chunk_of[id(p)] for p in module.parameters(recurse=recurse)
                             if id(p) in chunk_of and self.states[chunk_of[id(p)]].phase is not ChunkPhase.WHOLE})
            if not chunks:
                continue
            self._module_chunks[module] = tuple(chunks)
            if recurse:
                self._leaves.add(module)
                self._leaf_chunks.update(chunks)
            elif any(self.states[c].frozen for c in chunks):
                self._frozen_chunks[module] = tuple(c for c in chunks if self.states[c].frozen)
            for c in chunks:
                self.states[c].owners.add(module)
            hooks.around_forward(module, self._before_forward, self._after_forward)
        self._early_frozen = self._early_frozen_chunks()

    def _early_frozen_chunks(self) -> set[int]:
        """Frozen chunks backward may release once their calls' inputs' gradients are computed: held by no leaf, and
        no module owning one of their parameters owns a trainable parameter itself (its gradient, computed after the
        inputs', may read the frozen weight: `W * s`)."""
        def trains_own(module: nn.Module) -> bool:
            return any(p.requires_grad for p in module.parameters(recurse=False))

        return {c for chunks in self._frozen_chunks.values() for c in chunks
                if c not in self._leaf_chunks and not any(trains_own(m) for m in self.states[c].owners)}

    # ---- passes --------------------------------------------------------------------------------
    def begin(self, phase: TrainingPhase, key=None) -> None:
        """Starts a pass; `key` (a pipeline action's stage and kind) gives it a trace of its own."""
        self.phase = phase
        self._trace = self.traces.setdefault(phase if key is None else (phase, key), GatherTrace())
        self._trace.begin()
        self._early_frozen_release = key is None
        for c in self.shards.transient:  # only transient chunks have owners (hooked modules)
            self.states[c].done.clear()

    def end(self) -> None:
        """Ends the pass: every transient chunk is released (in-flight gathers are waited for), except
        those user code holds gathered (`gathered`)."""
        if self.phase is not TrainingPhase.IDLE:
            self._trace.end()
        if self.phase is TrainingPhase.BACKWARD:  # the forwards' calls counted so far have had their backward
            self._calls_awaiting.clear()
            self._kept_to_pass_end.clear()
        self.phase, self._trace = TrainingPhase.IDLE, None
        self._ahead.clear()
        for c in self.shards.transient:
            self.release(c)

    # ---- hooks ---------------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args) -> None:
        chunks = self._module_chunks[module]
        for c in chunks:
            self.states[c].done.discard(module)  # running (again): its chunks stay until this call ends
        self.demand(chunks)
        frozen = self._frozen_chunks.get(module)
        if frozen and torch.is_grad_enabled():  # (also a recomputation inside backward: it runs a backward again)
            self._count_frozen_call(module, frozen, args)
        if module in self._leaves and self.phase is TrainingPhase.FORWARD and torch.is_grad_enabled():
            inputs = [t for t in _tensors_in(args) if t.requires_grad]
            if inputs:  # the inputs' gradients are the leaf's backward's last output
                self.hooks.on_grads(inputs, lambda grads: self._after_leaf_backward(module), mode="all")

    def _after_forward(self, module: nn.Module, args, output) -> None:
        if self.phase is TrainingPhase.BACKWARD:  # recomputation inside backward: backward releases
            return
        chunks = self._module_chunks[module]
        if torch.is_grad_enabled():
            needing_grad = [t for t in _tensors_in(output) if t.requires_grad]
            if needing_grad:
                self.hooks.on_grads(needing_grad, lambda grad: self.demand(chunks), mode="any")
        for c in chunks:
            state = self.states[c]
            state.done.add(module)
            if state.done >= state.owners:
                self.release(c)

    def on_grads_complete(self, chunk: int) -> None:
        """Every parameter of the chunk has its gradient for this backward: backward needs it no more."""
        if self.phase is TrainingPhase.BACKWARD and chunk not in self._leaf_chunks:
            self.release(chunk)

    def _count_frozen_call(self, module: nn.Module, frozen: tuple[int, ...], args) -> None:
        """Counts this call as awaiting its backward over `frozen`; a call whose backward's end cannot be told (an
        input that is a leaf: a pipeline stage's input; a pipeline's passes) keeps its chunks to the pass end."""
        inputs = [t for t in _tensors_in(args) if t.requires_grad]
        if not inputs:  # no backward runs over this call (its module trains nothing of its own)
            return
        early = tuple(c for c in frozen if c in self._early_frozen)
        if not early:
            return
        if not self._early_frozen_release or any(t.grad_fn is None for t in inputs):
            self._kept_to_pass_end.update(early)
            return
        for c in early:
            self._calls_awaiting[c] = self._calls_awaiting.get(c, 0) + 1
        self.hooks.on_grads(inputs, lambda grads: self._after_frozen_backward(early), mode="all")

    def _after_frozen_backward(self, chunks: tuple[int, ...]) -> None:
        """A call's backward is done: each of its frozen chunks no other call's backward awaits is released (if it is
        demanded later, it is gathered again)."""
        if self.phase is not TrainingPhase.BACKWARD:
            return
        for c in chunks:
            awaiting = self._calls_awaiting.get(c, 0)
            if awaiting == 0:  # counted before this backward's accounting began: nothing to settle
                continue
            self._calls_awaiting[c] = awaiting - 1
            if awaiting == 1 and c not in self._kept_to_pass_end:
                del self._calls_awaiting[c]
                self.release(c)

    def _after_leaf_backward(self, leaf: nn.Module) -> None:
        """The leaf's backward is done: its chunks that no other module owns are released (a shared one may be
        demanded by the module whose output was the leaf's input, in the same autograd step)."""
        if self.phase is not TrainingPhase.BACKWARD:
            return
        for c in self._module_chunks[leaf]:
            if self.states[c].owners == {leaf}:
                self.release(c)

    # ---- gathering -----------------------------------------------------------------------------
    def demand(self, chunks: tuple[int, ...]) -> None:
        """Gathers `chunks` (waiting for them) and, following the trace, starts the next ones."""
        trace = self._trace
        for c in chunks:
            if trace is not None and (self.shards.is_released(c) or c in self._ahead):
                trace.demand(c)  # a demand is a chunk's first use since it was last released
            self._ahead.discard(c)
            self.shards.gather(c, self.group, self.counter)
        if trace is not None:
            self._prefetch(trace.upcoming())
        for c in chunks:
            self.shards.wait(c)

    def _prefetch(self, upcoming: list[int]) -> None:
        ahead = sum(self.shards.numel(c) for c in self._ahead)
        live = self.shards.live_numel
        for c in upcoming:
            if not self.shards.is_released(c):
                continue
            n = self.shards.numel(c)
            if ahead + n > self.prefetch_numel or live + n > self.max_live_numel:
                break
            self.shards.gather(c, self.group, self.counter)
            self._ahead.add(c)
            self.prefetched += 1
            ahead, live = ahead + n, live + n

    def release(self, chunk: int) -> None:
        if self.states[chunk].held:
            return  # inside gathered(): user code holds it
        self._ahead.discard(chunk)
        self.shards.release(chunk)

    def chunks_of(self, modules) -> set[int]:
        """The gathered (non-persistent) chunks holding a parameter of one of `modules` (hooked ones)."""
        return {c for m in modules for c in self._module_chunks.get(m, ())}

    def hold(self, chunk: int) -> None:
        """Keeps `chunk` from being released once gathered, until `let_go` (Note [layer-major accumulation])."""
        self.states[chunk].held += 1

    def let_go(self, chunk: int) -> None:
        """Ends a `hold`: in a forward whose every owner module of the chunk has run, the chunk is released now;
        otherwise the usual rules release it (a backward, once its gradients are in; the pass end)."""
        state = self.states[chunk]
        state.held -= 1
        if self.phase is TrainingPhase.FORWARD and state.done >= state.owners:
            self.release(chunk)

    @contextlib.contextmanager
    def gathered(self, chunks: list[int]):
        """Chunks gathered for user code (all ranks, same chunks), held through any pass run inside the
        block and released after it."""
        for c in chunks:
            self.shards.gather(c, self.group, self.counter)
        for c in chunks:
            self.shards.wait(c)
            self.states[c].held += 1  # passes inside the block do not release it
        try:
            yield
        finally:
            for c in chunks:
                self.states[c].held -= 1
                if self.phase is TrainingPhase.IDLE:
                    self.release(c)

def is_leaf_module(module: nn.Module) -> bool:
    """Whether `module` is marked a ZeRO-3 leaf (Note [gathering around modules])."""
    return getattr(module, "_z3_leaf", False) is True


def _hooked_modules(model: nn.Module):
    """(module, whether its chunks are its whole subtree's): every module outside leaves, the outermost leaves
    with their subtrees, nothing inside a leaf."""
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if is_leaf_module(module):
            yield module, True
            continue
        yield module, False
        stack.extend(reversed(list(module.children())))


def _tensors_in(value) -> list[torch.Tensor]:
    """Tensors in a module's output: a tensor, or (nested) tuples, lists, mappings, dataclasses of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors_in(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors_in(getattr(value, f.name))]
    return []
