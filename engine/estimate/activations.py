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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveAllocations(TorchDispatchMode):
    """Note [tracing activations]: live bytes of the storages operators allocate, and their peak."""

    def __init__(self, known: list[torch.Tensor]):
        super().__init__()
        self._known = {t.untyped_storage()._cdata for t in known}
        self._live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _freed(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._live or key in self._known:
                continue
            self._live[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._freed, key)
        return out


@dataclass(frozen=True)
class ActivationTrace:
    """Peak bytes of a traced micro-step at two batch sizes, and the linear fit through them."""

    small_batch: int
    small_peak: int
    large_batch: int
    large_peak: int

    @property
    def per_sample(self) -> float:
        return (self.large_peak - self.small_peak) / (self.large_batch - self.small_batch)

    def peak_at(self, micro_batch: int) -> int:
        return max(round(self.small_peak + self.per_sample * (micro_batch - self.small_batch)), 0)


def language_model_inputs(model: nn.Module, batch: int, seq_len: int,
                          ids: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """(args, kwargs) of a training forward of a token language model: the example GPT or a Hugging Face
    causal LM, `ids` as both inputs and labels (default: [batch, seq_len] on the meta device)."""
    if hasattr(model, "example_inputs"):
        return model.example_inputs(batch, seq_len)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ValueError(f"{type(model).__name__}: the estimate traces token language models (a .config with "
                         "vocab_size, as the example GPT and Hugging Face models have); give the model an "
                         "`example_inputs(batch_size, seq_len)` method returning (args, kwargs) on the meta device")
    if ids is None:
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    if type(model).__module__.startswith("transformers."):
        return (), {"input_ids": ids, "labels": ids}
    return (ids, ids), {}


def default_seq_len(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("block_size", "n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return min(value, 2048)
    raise ValueError(f"{type(model).__name__}: no sequence length in its config (block_size, n_positions, "
                     "max_position_embeddings); give seq_len (--seq-len)")


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
    with mode:
        loss_of(model(*args, **kwargs)).backward()
    for p in params:
        p.grad = None
    return mode.peak_bytes


def trace_activations(model: nn.Module, seq_len: int, batch_multiple: int = 1) -> ActivationTrace:
    """Peak step bytes at batches m and 2m (m = batch_multiple, e.g. the 2D mesh's q), for extrapolation."""
    small, large = batch_multiple, 2 * batch_multiple
    return ActivationTrace(small, peak_step_bytes(model, small, seq_len), large,
                           peak_step_bytes(model, large, seq_len))
