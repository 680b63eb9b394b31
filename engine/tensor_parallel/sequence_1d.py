"""Megatron sequence parallelism inside 1D tensor parallelism: the activations between the tensor-parallel
regions split along the sequence over the tp ranks.

Note [Megatron sequence parallelism]
With tensor_parallel.sequence_parallel, what each tp rank would hold whole under plain 1D tensor
parallelism (the residual stream, layer norms, dropout, position embeddings) is split along the sequence
(dim 1) over the tp ranks instead (Korthikanti et al. 2022). Only the regions' boundaries change:
- entering a region (the plan's `gather_inputs` modules, attention and MLP): the hidden states are
  all-gathered along the sequence; backward reduce-scatters their gradient (each rank's column-parallel
  layers give a partial one). A column-parallel layer fed that gathered tensor keeps only this rank's
  part for backward and gathers it again there (Megatron's trade: one more all-gather in backward, and
  the gathered copy is never saved);
- leaving it (row-parallel layers): the partial outputs are reduce-scattered along the sequence instead
  of all-reduced; backward all-gathers the gradient. The vocab-parallel embedding likewise;
- a position embedding (`slice_outputs`) keeps this rank's part of its output; the final norm's output
  (`gather_outputs`) is all-gathered, so that the model's own code after it (its reshapes, the lm_head,
  its loss) sees every position; its gradient is whole on every rank, and backward keeps this rank's part.
A replicated parameter now acts on this rank's part of the sequence only, so its gradient is partial: a
hook all-reduces it over the tp group before it accumulates (forgetting this is the known convergence bug
of layer-norm weights under sequence parallelism). Every dropout acts on split activations, so the whole
model draws from the per-rank stream (Note [tensor-parallel RNG]). The model gets the whole sequence's
positions (position_ids 0..T-1 where it takes them; rotary embeddings apply after the gather), T must
divide by t, and an attention_mask is refused (a Hugging Face model builds its mask from the split
embeddings' length). Saved activations per layer go from A + B/t to (A + B)/t, A being what the
replicated regions save, B the tensor-parallel regions. Inside a pipeline (Note [pipeline stages of an
unmodified model]) the hidden state between two blocks is this rank's part, so that is what a stage sends
on and what its gradient comes back as (b·T/t·h); each stage's view shares the model's hooks, so every
stage gets the whole sequence's positions, the first slices the position embeddings, the last gathers the
final norm's output, and a replicated parameter's gradient is all-reduced on whichever stage holds it.
"""

from __future__ import annotations

import fnmatch
import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.comm import all_reduce_sum, reduce_scatter_sum_in_place
from engine.tensor_parallel.mappings import TPGroup, gather_along
from engine.weak_hooks import WeakMethodHook

SEQ_DIM = 1  # activations are [batch, sequence, ...]


@dataclass(frozen=True)
class SequenceRegions:
    """Where a built-in plan's sequence-split regions begin and end, as module-name globs."""

    gather_inputs: tuple[str, ...]  # modules whose hidden-states input is gathered (attention, MLP)
    slice_outputs: tuple[str, ...] = ()  # position embeddings: keep this rank's part of the output
    gather_outputs: tuple[str, ...] = ()  # the final norm: its output gathered for the rest of the model

    def check(self, model: nn.Module) -> None:
        """Refuses a model none of whose modules is a region's entry (before anything changes)."""
        if not any(_matches(name, self.gather_inputs) for name, _ in model.named_modules()):
            raise ValueError(f"tensor_parallel.sequence_parallel: no module of {type(model).__name__} matches the "
                             f"plan's gather_inputs {list(self.gather_inputs)}; turn sequence_parallel off")


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


class SequenceShards:
    """This rank's part of the sequence under Megatron sequence parallelism, and the collectives at the
    boundaries of the split regions (Note [Megatron sequence parallelism])."""

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self.length: int | None = None  # the whole sequence's length in the running forward
        self._gathered = None  # (weak reference to the last gathered hidden states, this rank's part of them)
        self._regathered = None  # (part, gathered): one gather serves the backward of every layer on that part

    def check_length(self, length: int) -> None:
        if length % self.tp.size:
            raise ValueError(f"tensor_parallel.sequence_parallel splits each sequence over the {self.tp.size} "
                             f"tensor-parallel ranks, and a sequence of {length} tokens does not divide by "
                             f"{self.tp.size}; pad it to a multiple")
        self.length = length

    def part(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor (a view)."""
        n = x.shape[SEQ_DIM] // self.tp.size
        return x.narrow(SEQ_DIM, self.tp.rank * n, n)

    def gather_input(self, part: torch.Tensor) -> torch.Tensor:
        """A region's input: every rank's part, gathered (backward: reduce-scatter)."""
        gathered = _GatherSequence.apply(part, self, False)
        self._gathered = (weakref.ref(gathered), part)
        return gathered

    def column_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      transposed: bool) -> torch.Tensor:
        """A column-parallel layer on a region's gathered input, saving only this rank's part of it."""
        last = self._gathered
        if last is None or last[0]() is not x:
            raise ValueError("a column-parallel layer under tensor_parallel.sequence_parallel must take the hidden "
                             "states its plan's gather_inputs module gathered; this one was given another tensor "
                             "(the plan does not fit this model): turn tensor_parallel.sequence_parallel off")
        part = last[1]
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):  # as F.linear under autocast: both in the autocast dtype
            dtype = torch.get_autocast_dtype(device_type)
            x, part, weight = x.to(dtype), part.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return _ColumnOnGathered.apply(x, part, weight, bias, transposed, self)

    def regather(self, part: torch.Tensor) -> torch.Tensor:
        """The gathered input again, in backward (q, k and v of one input share one gather)."""
        cached = self._regathered
        if cached is not None and _same_tensor(cached[0], part):
            return cached[1]
        gathered = gather_along(part, self.tp, SEQ_DIM)
        self._regathered = (part, gathered)
        return gathered

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """A region's output: the ranks' partial sums, summed, this rank's part kept (backward: all-gather)."""
        return _ReduceScatterSequence.apply(x, self)

    def gather_output(self, part: torch.Tensor) -> torch.Tensor:
        """The split region's end: every rank's part, gathered; backward keeps this rank's part of the gradient,
        which is whole on every rank."""
        return _GatherSequence.apply(part, self, True)

    def apply(self, model: nn.Module, regions: SequenceRegions, replicated: list[nn.Parameter]) -> None:
        """Hooks the regions' boundaries into `model`, and the tp all-reduce into the replicated parameters'
        gradients."""
        for name, module in model.named_modules():
            if _matches(name, regions.gather_inputs):
                module.register_forward_pre_hook(self._gather_hidden_states, with_kwargs=True)
            if _matches(name, regions.slice_outputs):
                module.register_forward_hook(lambda _m, _a, out: self._slice_positions(out))
            if _matches(name, regions.gather_outputs):
                module.register_forward_hook(lambda _m, _a, out: self.gather_output(out))
        for p in replicated:
            p.register_hook(WeakMethodHook(self._sum_partial_gradient))
        takes_positions = any(p.name == "position_ids" for p in inspect.signature(model.forward).parameters.values())
        model.register_forward_pre_hook(lambda m, a, kw: self._whole_sequence_inputs(a, kw, takes_positions),
                                        with_kwargs=True)

    def _whole_sequence_inputs(self, args: tuple, kwargs: dict, takes_positions: bool):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if not torch.is_tensor(ids) or ids.dim() < 2:
            raise ValueError("tensor_parallel.sequence_parallel needs the token sequence ([batch, sequence]) as the "
                             "forward's first argument or as input_ids / inputs_embeds")
        self.check_length(ids.shape[SEQ_DIM])
        self._gathered = self._regathered = None  # the last step's
        if kwargs.get("attention_mask") is not None:
            raise ValueError("tensor_parallel.sequence_parallel: an attention_mask is not supported (the model would "
                             "build its mask for the split sequence); pass full-length sequences without one, or turn "
                             "tensor_parallel.sequence_parallel off")
        if takes_positions and kwargs.get("position_ids") is None:  # the whole sequence's, not the split part's
            return args, {**kwargs, "position_ids": torch.arange(self.length, device=ids.device).unsqueeze(0)}
        return None

    def _gather_hidden_states(self, _module, args: tuple, kwargs: dict):
        if args:
            return (self.gather_input(args[0]),) + tuple(args[1:]), kwargs
        if torch.is_tensor(kwargs.get("hidden_states")):
            return args, {**kwargs, "hidden_states": self.gather_input(kwargs["hidden_states"])}
        raise ValueError("tensor_parallel.sequence_parallel: a gather_inputs module was called without its hidden "
                         "states as the first argument or as hidden_states")

    def _slice_positions(self, out: torch.Tensor) -> torch.Tensor:
        dim = out.dim() - 2  # [..., sequence, hidden]
        if out.shape[dim] != self.length:
            raise ValueError(f"tensor_parallel.sequence_parallel: a position embedding gave {out.shape[dim]} "
                             f"positions for a sequence of {self.length}; pass position_ids for the whole sequence")
        n = self.length // self.tp.size
        return out.narrow(dim, self.tp.rank * n, n)

    def _sum_partial_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        all_reduce_sum(total, self.tp.group, self.tp.counter, async_op=False)
        return total


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values: one storage place, shape, strides and version (`a` is kept alive, so its place is its)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a._version == b._version)


def _reduce_scatter(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum over the tp ranks, keeping this rank's part of dim 1."""
    if x.shape[SEQ_DIM] % tp.size:
        raise ValueError(f"cannot split a sequence of {x.shape[SEQ_DIM]} over {tp.size} tensor-parallel ranks")
    by_rank = torch.stack(x.chunk(tp.size, dim=SEQ_DIM))  # [tp, batch, part, ...], rank r's part at [r]
    reduce_scatter_sum_in_place(by_rank.view(-1), tp.group, tp.rank, tp.size, tp.counter, async_op=False)
    return by_rank[tp.rank]


class _GatherSequence(torch.autograd.Function):
    """Every rank's part, gathered. Backward: the ranks' partial gradients reduce-scattered, or, when the gradient
    is whole on every rank (`whole_gradient`), this rank's part of it."""

    @staticmethod
    def forward(ctx, part, shards, whole_gradient: bool):
        ctx.shards, ctx.whole_gradient = shards, whole_gradient
        return gather_along(part, shards.tp, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        if ctx.whole_gradient:
            return ctx.shards.part(grad).contiguous(), None, None
        return _reduce_scatter(grad, ctx.shards.tp), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shards):
        ctx.shards = shards
        return _reduce_scatter(x, shards.tp)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.shards.tp, SEQ_DIM), None


class _ColumnOnGathered(torch.autograd.Function):
    """y = x Wᵀ + b on the gathered x; saves this rank's part of x and gathers it again for the weight's
    gradient. The input gradient flows to the gather (whose backward reduce-scatters it), not to the part."""

    @staticmethod
    def forward(ctx, gathered, part, weight, bias, transposed, shards):
        ctx.save_for_backward(part, weight)
        ctx.transposed, ctx.shards, ctx.has_bias = transposed, shards, bias is not None
        out = gathered @ weight if transposed else F.linear(gathered, weight)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        part, weight = ctx.saved_tensors
        whole = ctx.shards.regather(part)
        flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), whole.reshape(-1, whole.shape[-1])
        if ctx.transposed:  # Conv1D, W [in, out]
            grad_x, grad_w = grad @ weight.t(), flat_x.t() @ flat_grad
        else:
            grad_x, grad_w = grad @ weight, flat_grad.t() @ flat_x
        grad_b = flat_grad.sum(0) if ctx.has_bias else None
        return grad_x, None, grad_w, grad_b, None, None
