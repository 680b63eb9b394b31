"""A 2D model's per-sample inputs cut to this rank's batch block before its forward runs.

Note [2D batch inputs]
Under 2D every activation is this rank's batch block [batch/q, ...] (Note [2D tensor parallelism]),
so everything the forward reads per sample is cut the same way before the forward runs: the token
ids (the forward's first argument, `input_ids` for Hugging Face models) and, where they have that
batch, `attention_mask`, `position_ids` and `token_type_ids`. The forward then computes on a batch
of batch/q throughout: a Hugging Face model builds its padding mask, its positions and its batch
size from the cut tensors, exactly as one process does for those samples (a mask cut alone would
meet `view(batch_size, -1)` with the whole ids' batch). Position or token-type ids without a batch
([seq] or [1, seq]) broadcast, and stay whole. Labels and every other argument stay whole: a
"classifier_2d_gather" output layer gathers the whole batch's logits, which the model's own loss
meets, and engine.tensor_parallel.cross_entropy cuts its target itself. Refused by name: a
per-sample input whose batch is not the token ids' (it cannot be cut to the same samples),
`inputs_embeds` and encoder states (no 2D embedding produces them split), and a forward given no
token ids.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from engine.tensor_parallel.mappings_2d import batch_block

PER_SAMPLE = ("attention_mask", "position_ids", "token_type_ids")
BROADCAST = ("position_ids", "token_type_ids")  # may come without a batch: [seq] or [1, seq]
NOT_SPLIT = ("inputs_embeds", "encoder_hidden_states", "encoder_attention_mask")


class BatchInputs2D:
    """A forward pre-hook (with kwargs) cutting `model`'s per-sample inputs to batch block r of `mesh`."""

    def __init__(self, model: nn.Module, mesh):
        """mesh: the grid (a Mesh2D, 2.5D's included, or a Mesh3D): its batch blocks."""
        self.mesh = mesh
        params = inspect.signature(model.forward).parameters.values()
        self.positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.ids_name = self.positional[0] if self.positional else "input_ids"

    def __call__(self, _model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        named = dict(zip(self.positional, args))
        named.update(kwargs)
        given = [name for name in NOT_SPLIT if named.get(name) is not None]
        if given:
            mode = self.mesh.mode.upper()
            raise ValueError(f"{mode} tensor parallelism cuts the batch at the token ids, and {given[0]} is given: it "
                             f"cannot be split into the {mode} blocks; pass {self.ids_name} instead, or use "
                             f"tensor_parallel.mode \"1d\"")
        ids = named.get(self.ids_name)
        if not isinstance(ids, torch.Tensor) or ids.dim() == 0:
            raise ValueError(f"{self.mesh.mode.upper()} tensor parallelism cuts the batch at the token ids, the "
                             f"forward's first argument {self.ids_name!r}, which is {type(ids).__name__}; pass the "
                             f"token ids [batch, ...] there")
        batch = ids.shape[0]
        named[self.ids_name] = batch_block(ids, self.mesh, self.ids_name)
        for name in PER_SAMPLE:
            value = named.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            if name in BROADCAST and (value.dim() == 1 or value.shape[0] == 1):
                continue
            if value.dim() < 2 or value.shape[0] != batch:
                raise ValueError(f"{name} of shape {list(value.shape)} does not have the batch of the token ids "
                                 f"{self.ids_name} ({batch}), so {self.mesh.mode.upper()} tensor parallelism cannot "
                                 f"cut it to the same samples; pass it as [batch, ...] with the ids' batch")
            named[name] = batch_block(value, self.mesh, name)
        positional = tuple(named.pop(name) for name in self.positional[:len(args)]) + tuple(args[len(self.positional):])
        return positional, named
