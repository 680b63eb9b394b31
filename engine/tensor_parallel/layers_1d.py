"""1D (Megatron-style) tensor-parallel layers, each built from an existing module and its weights.

A column-parallel linear keeps a slice of the output features (its output is split over the tp
ranks, or gathered back with gather_output); a row-parallel linear keeps a slice of the input
features and sums the ranks' partial outputs; a vocab-parallel embedding keeps a slice of the
vocabulary rows. Each sharded parameter's ShardSpec says how its shards reassemble into the
original tensor (engine.full_state_dict; engine/tensor_parallel/shards.py). Weights keep the layout
of the module they replace: nn.Linear's [out, in], or Hugging Face Conv1D's [in, out] (`transposed`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.tensor_parallel.mappings import TPGroup, copy_to_tp, gather_from_tp, reduce_from_tp
from engine.tensor_parallel.sequence_1d import SequenceShards
from engine.tensor_parallel.shards import ShardSpec, shard_param, shared_or_sharded


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:  # Conv1D: x @ W + b with W [in, out]
        out = x @ weight
        return out + bias if bias is not None else out
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ (+ b) with this rank's slice of the output features (of each of `parts` fused blocks).

    Forward: copy the input to the tp region (its backward all-reduces the input gradient), local
    matmul; with gather_output, all-gather the output slices (else the output stays split). Under
    sequence parallelism (`sequence`) the input arrives gathered along the sequence by the region's entry
    instead (Note [Megatron sequence parallelism])."""

    sequence: SequenceShards | None = None

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, *, transposed: bool = False,
                 parts: int = 1, gather_output: bool = False):
        super().__init__()
        self.tp, self.transposed, self.gather_output = tp, transposed, gather_output
        self.weight_spec = ShardSpec(dim=1 if transposed else 0, parts=parts)
        self.bias_spec = ShardSpec(dim=0, parts=parts)
        self.weight, self.bias = weight, bias

    @classmethod
    def from_module(cls, module: nn.Module, tp: TPGroup, name: str, *, transposed: bool = False, parts: int = 1,
                    gather_output: bool = False, shared: dict | None = None) -> "ColumnParallelLinear":
        spec = ShardSpec(dim=1 if transposed else 0, parts=parts)
        weight = shared_or_sharded(module.weight, spec, tp, f"{name}.weight", shared)
        bias = shard_param(module.bias, ShardSpec(0, parts), tp, f"{name}.bias")
        return cls(weight, bias, tp, transposed=transposed, parts=parts, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None:
            return self.sequence.column_linear(x, self.weight, self.bias, self.transposed)
        y = _linear(copy_to_tp(x, self.tp), self.weight, self.bias, self.transposed)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, parts={self.weight_spec.parts}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with this rank's slice of the input features; the input arrives split (from a
    column-parallel layer). Forward: local matmul, all-reduce the partial outputs, add the
    (replicated) bias. Backward: the gradient passes through the all-reduce unchanged. Under sequence
    parallelism (`sequence`) the partial outputs are reduce-scattered along the sequence instead."""

    sequence: SequenceShards | None = None

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, *, transposed: bool = False):
        super().__init__()
        self.tp, self.transposed = tp, transposed
        self.weight_spec = ShardSpec(dim=0 if transposed else 1)
        self.weight, self.bias = weight, bias

    @classmethod
    def from_module(cls, module: nn.Module, tp: TPGroup, name: str, *, transposed: bool = False,
                    shared: dict | None = None) -> "RowParallelLinear":
        weight = shared_or_sharded(module.weight, ShardSpec(dim=0 if transposed else 1), tp, f"{name}.weight", shared)
        return cls(weight, module.bias, tp, transposed=transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(x, self.weight, None, self.transposed)
        y = self.sequence.reduce_scatter(y) if self.sequence is not None else reduce_from_tp(y, self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the tp ranks. Forward: each rank looks
    up the ids in its range (zeros elsewhere), then the ranks' outputs are all-reduced (reduce-scattered
    along the sequence under sequence parallelism)."""

    sequence: SequenceShards | None = None

    def __init__(self, weight: nn.Parameter, vocab_size: int, padding_idx: int | None, tp: TPGroup):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        rows = vocab_size // tp.size
        self.start, self.end = tp.rank * rows, (tp.rank + 1) * rows
        self.padding_idx = padding_idx
        self.local_padding_idx = padding_idx - self.start if padding_idx is not None and \
            self.start <= padding_idx < self.end else None
        self.weight_spec = ShardSpec(dim=0)
        self.weight = weight

    @classmethod
    def from_module(cls, module: nn.Embedding, tp: TPGroup, name: str,
                    shared: dict | None = None) -> "VocabParallelEmbedding":
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(f"{name}: an embedding with max_norm, sparse gradients or scale_grad_by_freq cannot be "
                             "split over the vocabulary; keep it replicated in tensor_parallel.plan")
        weight = shared_or_sharded(module.weight, ShardSpec(0), tp, f"{name}.weight", shared)
        return cls(weight, module.num_embeddings, module.padding_idx, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.sequence.reduce_scatter(out) if self.sequence is not None else reduce_from_tp(out, self.tp)

    def extra_repr(self) -> str:
        return f"vocab {self.start}..{self.end - 1} of {self.vocab_size}, tp={self.tp.size}"
