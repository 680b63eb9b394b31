"""The mean cross-entropy over a batch split into the batch blocks of 2D tensor parallelism (and of 2.5D and 3D:
their batch groups in turn, Note [tensor-parallel grids]).

A "classifier_2d" output layer leaves rank (r, c) the whole-vocabulary logits of batch block r. Each
rank sums its block's token losses and counts its targets (ignore_index left out), then the sums and
counts are all-reduced down the column: the mean is over the whole batch's counted tokens, right
also when the blocks count different numbers of targets. Every rank ends with the same loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.tensor_parallel.mappings import reduce_from_tp
from engine.tensor_parallel.mappings_2d import Mesh2D, batch_block
from engine.tensor_parallel.mappings_3d import Mesh3D


def cross_entropy_2d(logits: torch.Tensor, target: torch.Tensor, mesh: Mesh2D | Mesh3D,
                     ignore_index: int = -100) -> torch.Tensor:
    """logits [batch/q, ..., V] of this rank's batch block; target [batch, ...] token ids of the whole batch."""
    target = batch_block(target, mesh, "cross-entropy target")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and this rank's batch block of the target "
                         f"{tuple(target.shape)}: the logits must be the block's, with one more (vocabulary) dimension")
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    count = (target != ignore_index).sum().to(total.dtype)
    # the batch groups' blocks together are the batch; the loss is used alike on every rank (identity backward)
    both = torch.stack([total, count])
    for group in mesh.batch_groups:
        both = reduce_from_tp(both, group)
    return both[0] / both[1].clamp(min=1.0)
