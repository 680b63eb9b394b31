"""The stateful pieces of a run that a checkpoint saves and restores, handed over by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from engine.checkpoint.live_states import LiveStates
from engine.pipeline.model_split import PipelineModel
from engine.precision import LossScaler
from engine.progress import TrainingProgress
from engine.tensor_parallel import TensorParallel
from engine.topology import Topology
from engine.zero.chunked_params import ChunkedParams


@dataclass(frozen=True)
class TrainingState:
    """What Saver and load_checkpoint read and write: the live objects (their contents change as training
    runs), the layout they were built for, and what makes whole chunks from loaded shards."""

    module: nn.Module
    chunked: ChunkedParams
    optimizer: torch.optim.Optimizer
    lr_scheduler: object | None
    loss_scaler: LossScaler
    progress: TrainingProgress
    topology: Topology
    tensor_parallel: TensorParallel | None
    tp_mode: str  # tensor_parallel.mode
    stage: int  # zero_optimization.stage
    compute_dtype: torch.dtype
    gather_updated_params: Callable[[], None]  # sharded stages: every rank's updated shards into whole chunks
    pipeline: PipelineModel | None = None  # this rank's part of a split model (Note [checkpoint layout])
    experts: object | None = None  # engine.moe.plan.ExpertParallel: this rank's experts (Note [expert parallelism])

    def live_states(self) -> LiveStates:
        """The chunked states as a checkpoint reads and writes them (fused expert tensors by their whole extent)."""
        return LiveStates(self.chunked, self.optimizer, self.experts.extents() if self.experts is not None else None)
