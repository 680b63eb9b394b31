"""Optimizer states in the chunk manager (`offload_optimizer`), stepped chunk by chunk.

Note [offloaded optimizer states]
With `zero_optimization.offload_optimizer.device` cpu or nvme, the states of every stepped tensor
(a parameter chunk, or this rank's shard of one) live in one chunk of the ChunkManager, kind
"optim", registered on that tier: exp_avg and exp_avg_sq side by side (whatever state tensors
the optimizer keeps, in the order it creates them). The step walks the stepped tensors in a fixed
order: `access` makes the state chunk resident where the manager says the tensor is stepped (Note [where a
chunk is used]: on the host unless a device budget has room), the states are handed to a torch optimizer over
that one tensor (torch's fused AdamW: no hand-written kernels), it steps, and `release` lets the chunk go
back down under the tier's budget. The order repeats every step, so after the first step the
manager's trace prefetches the next state chunks from NVMe while Adam runs on the current one
(Note [trace and divergence]). The scalar `step` counters stay in memory.
A stepped tensor whose values are themselves in the manager (an offloaded parameter shard, Note
[offloaded parameter shards]) is a placeholder: the step accesses its manager chunk too, steps that
view in its place (with the placeholder's .grad), and releases it written.

Note [stepping in backward]
With `offload_optimizer.step_in_backward` (Tiers' own key, off by default) the boundary backward
updates each gradient shard as soon as its reduce-scatter is retired (the callback GradReducer.arm takes):
its states, values and gradient are accessed, stepped and released while backward goes on with the
earlier layers, so their NVMe reads and write-backs overlap backward's compute instead of following
it (PyTorch's "optimizer step in backward" technique, per shard). `step` then steps only what is
left. The result is the same as stepping after backward (same gradients, same order of Adam math,
the same learning rate: the scheduler advances in engine.step), but it needs each shard final when
it is reduced: no clipping by the global norm, no loss-scale overflow check (fp32 only), and no
second backward before engine.step(); initialize and backward refuse those. The global norm, when
TensorBoard logs it, is summed shard by shard as they are stepped. A backward that fails half-way
leaves the model partly updated: it raises saying so (restore from a checkpoint).
Every state layout steps a shard as the step after backward does (bf16 masters, bf16 states, the keyed
stochastic rounding, whose bits depend on the element and the step only, block-wise 8- and 4-bit states),
so the weights are equal bit for bit. Under layer-major accumulation (Note [layer-major accumulation]) the one
autograd call over the step's micro-batches gives each parameter one final gradient, after every node that
reads its value has run, so its shard is stepped as soon as it is reduced there too.
"""

from __future__ import annotations

import contextlib
from fractions import Fraction
from typing import Callable, ContextManager

import torch

from engine.zero.fused_tiles import AdamMoments, TileStepper, steps_in_tiles
from engine.zero.gradient_factor import folds_factors, scaled_by
from offload.chunk import Location
from offload.manager import ChunkManager
from offload.states import TensorState


class OffloadedOptimizer(torch.optim.Optimizer):
    """One torch optimizer per stepped tensor, whose state tensors are views of a manager chunk.

    A torch Optimizer itself (LR schedulers accept it): a scheduler changes the options of its
    param groups, and every step copies them to the per-tensor optimizers. Its own `state` stays
    empty: the states are in the manager (`manager.stats` counts them per tier).
    """

    def __init__(self, make: Callable[[list[dict]], torch.optim.Optimizer], groups: list[dict],
                 manager: ChunkManager, homes: list[Location], param_chunks: dict[int, int] | None = None,
                 grad_chunks: dict[int, int] | None = None,
                 round_into: Callable[[int], ContextManager[tuple[torch.Tensor, Location]]] | None = None):
        """homes[i]: the tier stepped tensor i's states are registered on (param-group order; Note [offload
        ratio]); param_chunks: id(stepped tensor) -> the manager chunk holding its values, for placeholders;
        grad_chunks: the same for its gradient (Note [offloaded gradient shards]), multiplied by the `grad_scale`
        the step is given (the loss-scale and clipping factors) as it is stepped, and widened to the stepped
        tensor's dtype when it is 16-bit; round_into(i): for fp32 masters (Note [offloaded master weights]), a
        context manager giving the 16-bit tensor stepped tensor i is rounded into, and the tier it is on. Each
        tensor is stepped where the manager says its states are used (Note [where a chunk is used])."""
        probe = torch.zeros(1, requires_grad=True)
        template = make([{"params": [probe]}])
        super().__init__(groups, dict(template.defaults))  # lr, betas, ...: for schedulers
        self.inner_type = type(template)  # what steps each tensor (a checkpoint records it)
        self.manager = manager
        self._param_chunks = param_chunks or {}
        self._grad_chunks = grad_chunks or {}
        self._round_into = round_into
        self._tiles = TileStepper(manager.staging)  # Note [the host step in tiles]
        self._items: list[tuple[torch.optim.Optimizer, torch.Tensor, int | None, dict]] = []
        self._stepped_early: set[int] = set()  # Note [stepping in backward]: items already stepped this iteration
        self._item_of_grad: dict[int, int] = {}  # gradient chunk -> the item it steps
        for group in self.param_groups:
            for p in group["params"]:
                opt = make([{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}])
                names, states = _state_layout(make, p)
                chunk = None  # an optimizer without state tensors (plain SGD) has nothing to offload
                if states:
                    chunk = manager.register("optim", states, location=homes[len(self._items)],
                                             capacity=sum(s.numel() for s in states), zeros=True)[0].chunk
                    opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
                if id(p) in self._grad_chunks:
                    self._item_of_grad[self._grad_chunks[id(p)]] = len(self._items)
                entries = {n: (Fraction(t.numel(), p.numel()), t.dtype) for n, t in zip(names, states)}
                tiled = names == ["exp_avg", "exp_avg_sq"] and steps_in_tiles(opt, p.dtype, [t.dtype for t in states])
                self._items.append((opt, p, chunk, {"names": names, "group": group, "entries": entries,
                                                    "tiled": tiled}))

    def step(self, closure=None, *, grad_scale: float | tuple[float, ...] = 1.0) -> None:
        """Steps every tensor not stepped early; gradients held in the manager are multiplied by `grad_scale` (a
        factor, or factors applied in turn)."""
        if closure is not None:
            raise ValueError("an offloaded optimizer steps without a closure")
        for i, item in enumerate(self._items):
            if i not in self._stepped_early:
                self._step_one(i, *item, grad_scale)
        self._stepped_early.clear()
        self.manager.end_iteration()

    def step_early(self, grad_chunk: int, grad_scale: float | tuple[float, ...] = 1.0) -> None:
        """Note [stepping in backward]: steps the tensor whose gradient is manager chunk `grad_chunk` now (its
        reduced gradient is final); the next `step` skips it."""
        i = self._item_of_grad[grad_chunk]
        if i in self._stepped_early:
            raise RuntimeError(f"gradient chunk {grad_chunk} was already stepped in this iteration")
        self._stepped_early.add(i)  # counted even if the step raises: its state may be half-updated
        self._step_one(i, *self._items[i], grad_scale)

    @property
    def stepped_early(self) -> int:
        """How many tensors were stepped since the last `step` (Note [stepping in backward])."""
        return len(self._stepped_early)

    def _step_one(self, index: int, opt: torch.optim.Optimizer, p: torch.Tensor, chunk: int | None, info: dict,
                  grad_scale: float | tuple[float, ...]) -> None:
        """One stepped tensor, on the tier its states are used on: its states (and offloaded values, gradient)
        accessed, stepped, released — released and rebound to the placeholder even when the step raises. A
        tensor of the device stepped on the host goes down and comes back up (Note [separate device memory])."""
        inner = opt.param_groups[0]
        values, grad_chunk = self._param_chunks.get(id(p)), self._grad_chunks.get(id(p))
        where = self._step_location(chunk, values, grad_chunk)
        if info["tiled"] and where is Location.CPU and grad_chunk is not None:
            self._step_tiled(index, opt, p, chunk, values, grad_chunk, info, grad_scale)
            return
        memory, on_host = self.manager.memory, where is Location.CPU and self.manager.memory.separate
        folded, factors = folds_factors(opt), ()  # Note [one gradient factor]
        accessed: list[int] = []
        target, bound_grad = p, p.grad
        try:
            if values is not None:  # an offloaded shard: step its manager view in the placeholder's place
                (target,) = self.manager.access(values, where)
                accessed.append(values)
            elif on_host:  # the tensor lives on the device; its states on the host
                target = memory.down(p.detach())
            if target is not p:
                inner["params"] = [target]
                if p in opt.state:
                    opt.state[target] = opt.state.pop(p)
            if grad_chunk is not None:  # read-only: dropped below once stepped, never written back
                (grad,) = self.manager.access(grad_chunk, where, writes=False)
                accessed.append(grad_chunk)
                if grad.dtype != target.dtype:  # a 16-bit gradient shard for an fp32 master
                    grad = grad.to(target.dtype)
                if folded:  # Note [one gradient factor]
                    factors = _factors(grad_scale)
                else:
                    for factor in _factors(grad_scale):  # one by one, as the in-memory gradients are scaled
                        grad.mul_(factor)
                target.grad = grad
            elif target is not p:  # the gradient of a tensor of the device
                target.grad = None if p.grad is None else memory.down(p.grad) if on_host else p.grad
            state = opt.state[target]
            if "step" in state and state["step"].device != target.device:
                state["step"] = state["step"].to(target.device)  # fused Adam wants it beside the tensor
            if chunk is not None:
                views = self.manager.access(chunk, where)
                accessed.append(chunk)
                for name, view in zip(info["names"], views):
                    state[name] = view
            _take_options(inner, info["group"])
            with scaled_by(opt, factors):
                opt.step()
            self._write_back(index, p, target, values is None, where)
        finally:
            self._unbind(opt, p, target, bound_grad, info["names"])
            for c in accessed:
                # a consumed gradient is dropped at once (no write-back): its room serves the next reads
                self.manager.release(c, TensorState.FREE if c == grad_chunk else TensorState.HOLD)

    @torch.no_grad()
    def _write_back(self, index: int, p: torch.Tensor, target: torch.Tensor, in_place: bool, where: Location) -> None:
        """The stepped tensor's values where they are used: the device's tensor (when stepped on the host in its
        place, `in_place`) and the rounded low-precision copy."""
        memory = self.manager.memory
        if in_place and target is not p:  # the updated tensor goes back up (Note [staged copies])
            self.manager.staging.send_all_up(p, target)
        if self._round_into is not None:  # Note [offloaded master weights]
            with self._round_into(index) as (low, low_tier):
                if memory.separate and low_tier is Location.DEVICE and where is Location.CPU:
                    self.manager.staging.send_all_up(low, target)  # Note [staged copies]
                else:
                    memory.copy(low, low_tier, target, where)

    @staticmethod
    def _unbind(opt: torch.optim.Optimizer, p: torch.Tensor, target: torch.Tensor, bound_grad, names) -> None:
        """The optimizer keyed by `p` again, without the chunk views (they go stale when the chunk moves)."""
        state = opt.state.get(target, {})
        for name in names:
            state.pop(name, None)
        if target is not p:
            opt.state[p] = opt.state.pop(target, state)
            opt.param_groups[0]["params"] = [p]
            target.grad = None
        p.grad = bound_grad

    def _step_tiled(self, index: int, opt: torch.optim.Optimizer, p: torch.Tensor, chunk: int, values: int | None,
                    grad_chunk: int, info: dict, grad_scale: float | tuple[float, ...]) -> None:
        """Note [the host step in tiles]: one stepped tensor on the host, with its states, gradient (and offloaded
        values) accessed there and released even when the step raises."""
        group = opt.param_groups[0]
        _take_options(group, info["group"])
        state = opt.state[p]
        if state["step"].device.type != "cpu":
            state["step"] = state["step"].cpu()  # the host kernel wants it beside the tensors
        accessed: list[int] = []
        try:
            # read-only: dropped once stepped, never written back (a grad_scale's kernel writes the divided fp32
            # values into it: Note [one gradient factor])
            (grad,) = self.manager.access(grad_chunk, Location.CPU, writes=False)
            accessed.append(grad_chunk)
            exp_avg, exp_avg_sq = self.manager.access(chunk, Location.CPU)
            accessed.append(chunk)
            if values is not None:
                (target,) = self.manager.access(values, Location.CPU)
                accessed.append(values)
                tier = Location.CPU
            else:  # a tensor of the device (or of the host, where the device is the host)
                target, tier = p.detach(), Location.DEVICE
            rounding = self._round_into(index) if self._round_into is not None else contextlib.nullcontext()
            with rounding as rounded:
                self._tiles.step(group, AdamMoments(state["step"], exp_avg, exp_avg_sq), target, tier, grad,
                                 _factors(grad_scale), rounded)
        finally:
            for c in accessed:
                self.manager.release(c, TensorState.FREE if c == grad_chunk else TensorState.HOLD)

    def _step_location(self, chunk: int | None, values: int | None, grad_chunk: int | None) -> Location:
        """Where a tensor is stepped: where its states, values and gradient, held together, are used (Note [where
        a chunk is used]); a tensor with none of them in the manager stays on the device (DEVICE)."""
        held = [c for c in (chunk, values, grad_chunk) if c is not None]
        if not held:
            return Location.DEVICE if self.manager.memory.separate else Location.CPU
        return self.manager.use_tier(*held)

    @contextlib.contextmanager
    def accessed_state(self, index: int, writes: bool):
        """For a checkpoint: the states of stepped tensor `index` (param-group order) for the block, by name:
        views of its manager chunk, wherever it lives, and the scalar ones (\"step\") kept in memory."""
        opt, p, chunk, info = self._items[index]
        state = opt.state.setdefault(p, {})
        scalars = {k: v for k, v in state.items() if torch.is_tensor(v)}
        if chunk is None:
            yield scalars
            return
        views = self.manager.access(chunk, self.manager.use_tier(chunk), writes=writes)
        try:
            yield {**scalars, **dict(zip(info["names"], views))}
        finally:
            self.manager.release(chunk)

    def state_entries(self, index: int) -> dict[str, tuple[Fraction, torch.dtype]]:
        """The state tensors of stepped tensor `index` by name: entries per stepped element, and dtype."""
        return self._items[index][3]["entries"]

    def state_dict(self):
        raise NotImplementedError("the states of an offloaded optimizer live in its chunk manager; save them with "
                                  "engine.save_checkpoint(dir), which reads them wherever they are")

    def close(self) -> None:
        self.manager.close()


def _state_layout(make, p: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
    """The names and zero initial values of the state tensors the optimizer keeps for `p`: its `state_layout` where
    it has one, else found by one step of a throw-away optimizer on a small tensor (every state it creates with p's
    shape, in the dtype it creates it)."""
    probe = torch.zeros(4, dtype=p.dtype, device=p.device, requires_grad=True)
    opt = make([{"params": [probe]}])
    if hasattr(opt, "state_layout"):
        return opt.state_layout(p)
    probe.grad = torch.zeros_like(probe)
    opt.step()
    states = [(k, v) for k, v in opt.state[probe].items() if torch.is_tensor(v) and v.shape == probe.shape]
    return [k for k, _ in states], [torch.zeros((), dtype=v.dtype, device=p.device).expand(p.shape) for _, v in states]



def _take_options(inner: dict, outer: dict) -> None:
    """The per-tensor optimizer's group takes the outer group's options (a scheduler may have changed them)."""
    for key, value in outer.items():
        if key != "params":
            inner[key] = value


def _factors(scale: float | tuple[float, ...]) -> list[float]:
    """The factors other than 1 of a gradient scale given as one factor or several."""
    return [f for f in (scale if isinstance(scale, tuple) else (scale,)) if f != 1.0]
