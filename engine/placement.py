"""Where one tensor a rank holds sits in the whole model, composed from each parallelism's cut.

Note [placements]
Every tensor a rank holds in chunks (a parameter) or beside them (a buffer, a frozen parameter) has a
Placement: its name in the whole model; how the tensor-parallel ranks cut the whole tensor (a Spec of
engine/tensor_parallel/shards.py, 1D or 2D, with the cut's rank and size; no cut: every rank holds it
whole); which elements of the whole tensor the piece after that cut starts at, and the whole tensor's
shape (a fused expert tensor of which this rank holds some experts: a contiguous range, experts first);
and the pipeline stage holding it. Each feature object adds its part (Feature.place, Note [feature
objects]), so the checkpoint code receives a mapping name -> Placement and never asks which parallelism
made it: a saved piece is found by name and element range, and a piece saved under an equal placement
is read directly (Note [reading a checkpoint anywhere]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.shards import Spec


@dataclass(frozen=True)
class Placement:
    name: str  # in the whole model
    cut: Spec | None = None  # how the tensor-parallel ranks cut the whole tensor; None: held whole
    cut_rank: int = 0  # whose piece of the cut this is
    cut_size: int = 1  # the pieces it is cut into
    base: int = 0  # the element of the (cut) whole tensor this piece starts at
    whole: tuple[int, ...] | None = None  # that whole tensor's shape; None: the piece's own
    stage: int = 0  # the pipeline stage holding it

    def cut_key(self) -> tuple | None:
        """What decides which elements the tensor-parallel cut leaves here: equal keys, equal pieces."""
        if self.cut is None:
            return None
        return (type(self.cut).__name__, dataclasses.astuple(self.cut), self.cut_rank, self.cut_size)

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This placement's piece of the whole (uncut) tensor."""
        if self.cut is None:
            return whole
        return self.cut.take(whole, TPGroup(None, self.cut_size, self.cut_rank), self.name)

    def with_cut(self, cut: Spec | None, rank: int, size: int) -> Placement:
        return dataclasses.replace(self, cut=cut, cut_rank=rank, cut_size=size)

    def with_extent(self, base: int, whole: tuple[int, ...]) -> Placement:
        return dataclasses.replace(self, base=base, whole=tuple(whole))

    def on_stage(self, stage: int) -> Placement:
        return dataclasses.replace(self, stage=stage)
