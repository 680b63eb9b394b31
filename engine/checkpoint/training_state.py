"""The stateful pieces of a run that a checkpoint saves and restores, handed over by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from engine.checkpoint.live_states import LiveStates, chunked_tensors, extra_entries
from engine.features import Features
from engine.mesh import Mesh
from engine.placement import Placement
from engine.precision import LossScaler
from engine.progress import TrainingProgress
from engine.zero.chunked_params import ChunkedParams


@dataclass(frozen=True)
class TrainingState:
    """What Saver and load_checkpoint read and write: the live objects (their contents change as training
    runs), the feature objects that place each tensor in the whole model (Note [placements]), and what makes
    whole chunks from loaded shards."""

    module: nn.Module
    chunked: ChunkedParams
    optimizer: torch.optim.Optimizer
    lr_scheduler: object | None
    loss_scaler: LossScaler
    progress: TrainingProgress
    mesh: Mesh
    features: Features
    stage: int  # zero_optimization.stage
    compute_dtype: torch.dtype
    gather_updated_params: Callable[[], None]  # sharded stages: every rank's updated shards into whole chunks
    gathered_chunks: Callable[[list[int]], ContextManager]  # chunks held whole for a block (a collective: stage 3)

    def frozen_values(self, keep: bool) -> dict[int, torch.Tensor]:
        """id(frozen parameter) -> its whole values, copied to the CPU (where `keep`; else {}), read chunk by chunk
        (gathered under stage 3: every rank calls this). Frozen parameters are saved whole, as extras (Note [frozen
        chunks])."""
        out = {}
        with torch.no_grad():
            for state in self.chunked.frozen_states:
                with self.gathered_chunks([state.index]):
                    if keep:
                        out.update({id(p): p.detach().to("cpu", copy=True) for p in state.params})
        return out

    def load_extra(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """A loaded extra entry into its tensor: a frozen parameter into its chunk (this rank's shard under stage 3),
        anything else in place."""
        if id(tensor) in self.chunked.param_chunk_index():  # int8 chunks: the saved image keeps its scales
            self.chunked.load(tensor, value, keep_scales=True)
        else:
            tensor.data.copy_(value)

    def placements(self) -> dict[str, Placement]:
        """Every tensor a checkpoint holds of this rank (chunked parameters, then extras) by name in the whole model."""
        extras, _ = extra_entries(self.module, self.chunked)
        return self.features.placements({**chunked_tensors(self.chunked), **extras})

    def live_states(self, placements: dict[str, Placement]) -> LiveStates:
        """The chunked states as a checkpoint reads and writes them."""
        return LiveStates(self.chunked, self.optimizer, placements)
