"""Activation memory of one micro-step, traced on the meta device (nothing is allocated or computed).

Note [tracing activations]
A TorchDispatchMode sees every tensor an operator returns during one forward and backward of the
model on meta tensors; a storage it has not seen before (not a parameter's, a gradient's, a
buffer's or the inputs') is an allocation, and a weak reference to the storage tells when autograd
and Python have let it go. The running sum of live allocations peaks somewhere in the step: that
peak (saved activations, the logits and their gradient, the fresh gradient autograd adds into a
parameter's chunk view) is what the step needs beyond the model states. Gradients are set to
zeros beforehand, so autograd accumulates into them in place as it does into the engine's chunks.
Activation memory grows with the micro batch: the step is traced at two small batches and
extrapolated linearly (a fixed part, like parameter gradients before accumulation, and a part per
sample). Kernel workspaces outside autograd's tensors (cuBLAS, oneDNN scratch) are not seen.
Given the model's units (the pieces a pipeline splits it into, Note [estimating a pipeline]), the
trace also tags each allocation with the unit whose forward was running (the last one entered:
the loss after the output head counts as the head's) and reports, per unit, the bytes still alive
when the backward starts (what a stage holds for each micro-batch in flight) and its output's bytes
(what a stage sends to the next).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.models.inputs import SEQ_LEN_KEYS, config_seq_len, config_vocab_size, token_model_inputs


class LiveAllocations(TorchDispatchMode):
    """Note [tracing activations]: live bytes of the storages operators allocate, and their peak."""

    def __init__(self, known: list[torch.Tensor]):
        super().__init__()
        self._known = {t.untyped_storage()._cdata for t in known}
        self._live: dict[int, tuple[int, int]] = {}  # storage -> (bytes, tag)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.tag = 0  # what new allocations are attributed to (the unit whose forward runs)

    def _freed(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key)[0]

    def live_by_tag(self, tags: int) -> tuple[int, ...]:
        """Live bytes now, per tag 0 .. tags - 1."""
        out = [0] * tags
        for nbytes, tag in self._live.values():
            out[tag] += nbytes
        return tuple(out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._live or key in self._known:
                continue
            self._live[key] = (storage.nbytes(), self.tag)
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._freed, key)
        return out


@dataclass(frozen=True)
class StepBytes:
    """One traced micro-step: its peak, and per unit (none if no units were given) the bytes its forward
    allocated that are still alive when the backward starts, and the bytes of its output."""

    peak: int
    held: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class ActivationTrace:
    """A traced micro-step at two batch sizes, and the linear fit through them."""

    small_batch: int
    small: StepBytes
    large_batch: int
    large: StepBytes

    @property
    def small_peak(self) -> int:
        return self.small.peak

    @property
    def large_peak(self) -> int:
        return self.large.peak

    @property
    def per_sample(self) -> float:
        return (self.large_peak - self.small_peak) / (self.large_batch - self.small_batch)

    def _at(self, small: float, large: float, micro_batch: int) -> int:
        per_sample = (large - small) / (self.large_batch - self.small_batch)
        return max(round(small + per_sample * (micro_batch - self.small_batch)), 0)

    def peak_at(self, micro_batch: int) -> int:
        return self._at(self.small_peak, self.large_peak, micro_batch)

    def held_at(self, micro_batch: int) -> list[int]:
        """Per unit: the bytes its forward leaves alive for the backward, at `micro_batch`."""
        return [self._at(a, b, micro_batch) for a, b in zip(self.small.held, self.large.held)]

    def outputs_at(self, micro_batch: int) -> list[int]:
        """Per unit: the bytes of its output at `micro_batch`."""
        return [self._at(a, b, micro_batch) for a, b in zip(self.small.outputs, self.large.outputs)]


def language_model_inputs(model: nn.Module, batch: int, seq_len: int,
                          ids: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """(args, kwargs) of a training forward of a token language model: the example GPT or a Hugging Face
    causal LM, `ids` as both inputs and labels (default: [batch, seq_len] on the meta device)."""
    if hasattr(model, "example_inputs"):
        return model.example_inputs(batch, seq_len)
    if config_vocab_size(model) is None:
        raise ValueError(f"{type(model).__name__}: the estimate traces token language models (a .config with "
                         "vocab_size, as the example GPT and Hugging Face models have); give the model an "
                         "`example_inputs(batch_size, seq_len)` method returning (args, kwargs) on the meta device")
    if ids is None:
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    return token_model_inputs(model, ids)


def default_seq_len(model: nn.Module) -> int:
    seq_len = config_seq_len(model)
    if seq_len is None:
        raise ValueError(f"{type(model).__name__}: no sequence length in its config ({', '.join(SEQ_LEN_KEYS)}); "
                         "give seq_len (--seq-len)")
    return seq_len


def loss_of(output) -> torch.Tensor:
    """The scalar loss in a model's output: a tensor, a tuple holding one, or an object with .loss."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.dim() == 0:
                return item
    raise ValueError(f"the model's forward returned {type(output).__name__}, not a loss; the estimate traces a "
                     "training forward that returns a scalar loss (or an output with .loss)")


def peak_step_bytes(model: nn.Module, batch: int, seq_len: int,
                    inputs: Callable[[nn.Module, int, int], tuple[tuple, dict]] = language_model_inputs) -> int:
    """Note [tracing activations]: peak live bytes of one forward + backward of a meta-device model."""
    return step_bytes(model, batch, seq_len, inputs=inputs).peak


def step_bytes(model: nn.Module, batch: int, seq_len: int, units: Sequence[Sequence[nn.Module]] = (),
               inputs: Callable[[nn.Module, int, int], tuple[tuple, dict]] = language_model_inputs) -> StepBytes:
    """Note [tracing activations]: one forward + backward of a meta-device model, its allocations attributed
    to `units` (each a group of modules, the groups run in this order in the forward; a unit's output is its
    last module's)."""
    params = list(model.parameters())
    if any(not p.is_meta for p in params):
        raise ValueError("trace a model on the meta device (build it under `with torch.device('meta'):`)")
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    args, kwargs = inputs(model, batch, seq_len)
    known = params + [p.grad for p in params if p.grad is not None] + list(model.buffers())
    known += [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    mode = LiveAllocations(known)
    outputs = [0] * len(units)
    forward = [True]  # False in the backward: a checkpoint's recomputation is not the forward

    def enter(tag: int):
        def hook(module, args):
            if forward[0]:
                mode.tag = tag
        return hook

    def leave(tag: int):
        def hook(module, args, output):
            first = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
            if first is not None and forward[0]:
                outputs[tag] = first.numel() * first.element_size()
        return hook

    handles = [h for tag, group in enumerate(units) for unit in group
               for h in (unit.register_forward_pre_hook(enter(tag)), unit.register_forward_hook(leave(tag)))]
    try:
        with mode:
            loss = loss_of(model(*args, **kwargs))
            held = mode.live_by_tag(len(units)) if units else ()
            forward[0] = False
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.grad = None
    return StepBytes(mode.peak_bytes, held, tuple(outputs))


def trace_activations(model: nn.Module, seq_len: int, batch_multiple: int = 1,
                      units: Sequence[Sequence[nn.Module]] = ()) -> ActivationTrace:
    """Step bytes at batches m and 2m (m = batch_multiple, e.g. the 2D mesh's q), for extrapolation."""
    small, large = batch_multiple, 2 * batch_multiple
    return ActivationTrace(small, step_bytes(model, small, seq_len, units), large,
                           step_bytes(model, large, seq_len, units))
