"""2D (SUMMA) tensor-parallel layers, each built from an existing module and its weights; the same layers run
2.5D and 3D over their grids (Note [tensor-parallel grids]): a layer asks its mesh for the matmul and the cuts.

Every activation between these layers is this rank's block [batch/q, seq, hidden/q] of the whole
one (Note [2D tensor parallelism]); every parameter is a 1/q² piece (engine/tensor_parallel/shards.py).
The model's inputs arrive cut to the batch block (Note [2D batch inputs]); the classifier sums the
hidden blocks into whole-vocabulary logits for this rank's batch block, and (gather_batch) collects
the batch again for a model that computes its own loss. Weights keep the layout of the module they replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.tensor_parallel.mappings import reduce_from_tp
from engine.tensor_parallel.mappings_2d import Mesh2D, gather_batch, gather_down_column
from engine.tensor_parallel.mappings_3d import Mesh3D
from engine.tensor_parallel.norm_2d import normalize_along_row
from engine.tensor_parallel.shards import (
    BlockSpec2D,
    BlockSpec3D,
    PieceSpec2D,
    PieceSpec3D,
    shard_param,
    shared_or_sharded,
)

Grid = Mesh2D | Mesh3D


class Linear2D(nn.Module):
    """y = x W (+ b) by SUMMA; W held as the block [in block r, out block c], b as a piece of out block c. A
    fused projection (parts = 3, q/k/v) keeps block c of each part, so a rank computes whole heads."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, mesh: Grid, *, transposed: bool,
                 parts: int):
        super().__init__()
        self.mesh, self.transposed, self.parts = mesh, transposed, parts
        self.weight_spec, self.bias_spec = self.specs(mesh, transposed, parts)
        self.weight, self.bias = weight, bias

    @staticmethod
    def specs(mesh: Grid, transposed: bool, parts: int) -> tuple[BlockSpec2D | BlockSpec3D, PieceSpec2D | PieceSpec3D]:
        return mesh.weight_spec(in_dim=0 if transposed else 1, out_dim=1 if transposed else 0, parts=parts), \
            mesh.vector_spec(dim=0, parts=parts)

    @classmethod
    def from_module(cls, module: nn.Module, mesh: Grid, name: str, *, transposed: bool, parts: int = 1,
                    shared: dict | None = None) -> "Linear2D":
        weight_spec, bias_spec = cls.specs(mesh, transposed, parts)
        weight = shared_or_sharded(module.weight, weight_spec, mesh.whole, f"{name}.weight", shared)
        bias = shard_param(module.bias, bias_spec, mesh.whole, f"{name}.bias")
        return cls(weight, bias, mesh, transposed=transposed, parts=parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mesh.matmul(x, self.weight, self.transposed, self.parts)
        if self.bias is None:
            return y
        return y + gather_down_column(self.bias, self.mesh, 0).to(y.dtype)  # in y's dtype, as F.linear under autocast

    def extra_repr(self) -> str:
        return f"mesh={self.mesh.describe()}, parts={self.parts}"


class Norm2D(nn.Module):
    """LayerNorm or RMSNorm over a hidden dimension split along the row: the per-token sums are all-reduced
    along the row; weight and bias are 1/q² pieces."""

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None, hidden: int, eps: float,
                 mesh: Grid, *, rms: bool):
        super().__init__()
        self.mesh, self.hidden, self.eps, self.rms = mesh, hidden, eps, rms
        self.weight_spec = self.bias_spec = mesh.vector_spec(dim=0)
        self.weight, self.bias = weight, bias

    @classmethod
    def from_module(cls, module: nn.Module, mesh: Grid, name: str) -> "Norm2D":
        rms = isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")
        if not rms and not isinstance(module, nn.LayerNorm):  # by class: the math must be the one named
            raise ValueError(f"tensor_parallel.plan: style \"norm_2d\" is for nn.LayerNorm, nn.RMSNorm or a Hugging "
                             f"Face *RMSNorm, but {name!r} is a {type(module).__name__}")
        shape = tuple(module.normalized_shape) if hasattr(module, "normalized_shape") else tuple(module.weight.shape)
        if len(shape) != 1:
            raise ValueError(f"{name}: a norm over {len(shape)} dimensions {shape} cannot be split by 2D tensor "
                             "parallelism, which splits the last (hidden) dimension only")
        eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        if eps is None:  # nn.RMSNorm's default
            eps = torch.finfo(module.weight.dtype if module.weight is not None else torch.float32).eps
        weight = shard_param(getattr(module, "weight", None), mesh.vector_spec(0), mesh.whole, f"{name}.weight")
        bias = shard_param(getattr(module, "bias", None), mesh.vector_spec(0), mesh.whole, f"{name}.bias")
        return cls(weight, bias, shape[0], eps, mesh, rms=rms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = normalize_along_row(x, self.mesh, self.hidden, self.eps, self.rms)  # as Llama: fp32, cast back, weight
        if self.weight is not None:
            y = y * gather_down_column(self.weight, self.mesh, 0)
        if self.bias is not None:
            y = y + gather_down_column(self.bias, self.mesh, 0)
        return y

    def extra_repr(self) -> str:
        return (f"{'rms' if self.rms else 'layer'} norm over {self.hidden}, eps={self.eps}, "
                f"mesh={self.mesh.describe()}")


def _check_embedding(module: nn.Module, name: str) -> None:
    if not isinstance(module, nn.Embedding):
        raise ValueError(f"tensor_parallel.plan: an embedding style is for nn.Embedding, but {name!r} is a "
                         f"{type(module).__name__}")
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise ValueError(f"{name}: an embedding with max_norm, sparse gradients or scale_grad_by_freq cannot be split "
                         "by 2D tensor parallelism")


class Embedding2D(nn.Module):
    """An embedding table held as 1/q² pieces of its columns (the hidden dimension); a lookup gathers hidden
    block c down the column. The ids are this rank's batch block already (token ids [batch/q, ...], cut before
    the model's forward, Note [2D batch inputs]) or have no batch (position ids [seq] or [1, seq], broadcast)."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None, mesh: Grid):
        super().__init__()
        self.mesh, self.padding_idx = mesh, padding_idx
        self.weight_spec = mesh.vector_spec(dim=1)
        self.weight = weight

    @classmethod
    def from_module(cls, module: nn.Embedding, mesh: Grid, name: str, shared: dict | None = None) -> "Embedding2D":
        _check_embedding(module, name)
        weight = shared_or_sharded(module.weight, mesh.vector_spec(dim=1), mesh.whole, f"{name}.weight", shared)
        return cls(weight, module.padding_idx, mesh)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, gather_down_column(self.weight, self.mesh, 1), self.padding_idx)

    def extra_repr(self) -> str:
        return f"mesh={self.mesh.describe()}"


class Classifier2D(nn.Module):
    """logits = x Wᵀ for a weight [classes, hidden] (nn.Linear; Conv1D [hidden, classes]) held as 1/q² pieces of
    its hidden dimension, so it can share an Embedding2D's table. The row's partial products are summed into
    whole-vocabulary logits of batch block r; with gather_batch the batch blocks are gathered down the column."""

    def __init__(self, weight: nn.Parameter, mesh: Grid, *, transposed: bool, gather_batch: bool):
        super().__init__()
        self.mesh, self.transposed, self.gather_batch = mesh, transposed, gather_batch
        self.weight_spec = mesh.vector_spec(dim=0 if transposed else 1)
        self.weight = weight

    @classmethod
    def from_module(cls, module: nn.Module, mesh: Grid, name: str, *, transposed: bool, gather_batch: bool,
                    shared: dict | None = None) -> "Classifier2D":
        if getattr(module, "bias", None) is not None:
            raise ValueError(f"{name}: a classifier with a bias is not supported by 2D tensor parallelism yet; use "
                             "a bias-free output layer, or mode \"1d\"")
        spec = mesh.vector_spec(dim=0 if transposed else 1)
        weight = shared_or_sharded(module.weight, spec, mesh.whole, f"{name}.weight", shared)
        return cls(weight, mesh, transposed=transposed, gather_batch=gather_batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = gather_down_column(self.weight, self.mesh, self.weight_spec.dim)
        logits = reduce_from_tp(x @ block if self.transposed else F.linear(x, block), self.mesh.row)
        return gather_batch(logits, self.mesh) if self.gather_batch else logits

    def extra_repr(self) -> str:
        return f"mesh={self.mesh.describe()}, gather_batch={self.gather_batch}"
